"""Batteries: an emulated one that drains with the board's work, and the board's real one.

Both are read as a :class:`BatteryReading`, the fields psutil gives for a real battery plus
the energy used, so telemetry treats emulated and real boards alike. A board without a battery
but with known power figures gets its energy from :func:`energy_j` (or
:class:`edgetrain.power.PowerModel`, which adds radio energy). A real battery whose driver
exposes an energy counter (Linux ``/sys/class/power_supply``) measures the board's energy while
it runs from the battery: :class:`BatteryEnergySensor`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

_J_PER_WH = 3600.0


@dataclass(kw_only=True, frozen=True)
class BatterySpec:
    """An emulated battery and the board's power draw."""

    capacity_wh: float
    """Usable capacity, watt-hours."""
    idle_w: float
    """Power draw while not training, watts."""
    busy_w: float
    """Power draw while training, watts."""
    initial_percent: float = 100.0
    """Charge when the board starts."""
    plugged: bool = False
    """On mains power: the board's draw comes from the mains and the battery does not drain."""
    charge_w: float = 0.0
    """Net charging power into the battery while plugged, watts (0: the charge level stays)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.capacity_wh) and self.capacity_wh > 0):
            raise ValueError(f"capacity_wh must be a finite number > 0, got {self.capacity_wh}")
        for name in ("idle_w", "busy_w", "charge_w"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.busy_w < self.idle_w:
            raise ValueError(f"busy_w ({self.busy_w}) must be >= idle_w ({self.idle_w})")
        if not 0 <= self.initial_percent <= 100:
            raise ValueError(f"initial_percent must be in [0, 100], got {self.initial_percent}")


@dataclass(frozen=True)
class BatteryReading:
    """A battery's state as psutil reports a real one, plus the energy used when known."""

    percent: float
    """Charge left, 0-100."""
    charging: bool | None
    """On external power (psutil's ``power_plugged``): the charge is not falling; None: unknown."""
    energy_j: float | None = None
    """Energy the board used since it started, joules; None when unknown (a real battery)."""


def energy_j(*, busy_s: float, idle_s: float, idle_w: float, busy_w: float) -> float:
    """Energy a board used, in joules, from its configured power draw: busy_w while training
    for ``busy_s`` seconds and idle_w for ``idle_s`` seconds."""
    if busy_s < 0 or idle_s < 0:
        raise ValueError(f"durations must be >= 0, got busy_s={busy_s} idle_s={idle_s}")
    return busy_s * busy_w + idle_s * idle_w


class EmulatedBattery:
    """A battery drained by the board's work: busy_w while training, idle_w otherwise.

    Time is integrated on ``clock``: the client marks compute bursts with :meth:`set_busy`.
    A caller that measures its own durations passes ``clock=None`` and reports them with
    :meth:`account` (with a clock, accounted time is charged on top of clock time).
    Unplugged, the battery drains by the energy used; plugged, it gains ``charge_w`` (up to
    full) and the draw comes from the mains. :meth:`energy_j` counts the board's use either
    way, so energy per step is the difference of two readings. Thread-safe.
    """

    def __init__(self, spec: BatterySpec, clock: Callable[[], float] | None = time.monotonic) -> None:
        self.spec = spec
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock() if clock else 0.0
        self._busy = False
        self._used_j = 0.0
        self._capacity_j = spec.capacity_wh * _J_PER_WH
        self._charge_j = self._capacity_j * spec.initial_percent / 100

    def set_busy(self, busy: bool) -> None:
        """The board starts (True) or stops (False) a compute burst."""
        with self._lock:
            self._advance()
            self._busy = busy

    def account(self, busy_seconds: float, idle_seconds: float) -> None:
        """Charge the battery for ``busy_seconds`` of training and ``idle_seconds`` of idling."""
        with self._lock:
            self._advance()
            self._apply(busy_seconds, idle_seconds)

    def percent(self) -> float:
        """Charge left, 0-100."""
        return self.read().percent

    def energy_j(self) -> float:
        """Joules the board used since it started."""
        with self._lock:
            self._advance()
            return self._used_j

    @property
    def charging(self) -> bool:
        """On external power, as psutil's ``power_plugged`` says of a real battery."""
        return self.spec.plugged

    @property
    def empty(self) -> bool:
        """The charge is gone on battery power: a real board would switch off."""
        return not self.spec.plugged and self.percent() <= 0.0

    def read(self) -> BatteryReading:
        """Charge, charging state and energy used, at one instant."""
        with self._lock:
            self._advance()
            percent = 100 * self._charge_j / self._capacity_j
            return BatteryReading(percent=percent, charging=self.spec.plugged, energy_j=self._used_j)

    def _advance(self) -> None:
        if self._clock is None:
            return
        now = self._clock()
        elapsed, self._last = max(0.0, now - self._last), now
        self._apply(elapsed if self._busy else 0.0, 0.0 if self._busy else elapsed)

    def _apply(self, busy_s: float, idle_s: float) -> None:
        spec = self.spec
        used = energy_j(busy_s=busy_s, idle_s=idle_s, idle_w=spec.idle_w, busy_w=spec.busy_w)
        self._used_j += used
        if spec.plugged:
            gained = (busy_s + idle_s) * spec.charge_w
            self._charge_j = min(self._capacity_j, self._charge_j + gained)
        else:
            self._charge_j = max(0.0, self._charge_j - used)


def real_battery() -> BatteryReading | None:
    """The board's own battery from psutil, or None when it has none (energy is unknown)."""
    try:
        battery = psutil.sensors_battery()
    except (AttributeError, NotImplementedError, OSError):
        return None
    if battery is None:
        return None
    plugged = battery.power_plugged  # psutil says None when it cannot tell: keep it unknown
    return BatteryReading(percent=float(battery.percent), charging=None if plugged is None else bool(plugged))


POWER_SUPPLY = Path("/sys/class/power_supply")
"""Where Linux exposes batteries (``type`` Battery; ``energy_now`` in µWh, or ``charge_now`` in
µAh with ``voltage_now`` in µV; ``status`` Discharging / Charging / Full)."""


class BatteryEnergySensor:
    """The energy a board used, measured by its battery's own energy counter while discharging.

    Joules used are the drop of the counter since the sensor started. On mains power the counter
    says nothing about the board's use (it rises or stays full), so :meth:`energy_j` is None then
    and for good once it happened (a measurement with a hole in it is not one). ``root`` is the
    power-supply directory (tests point it at a fake tree).
    """

    def __init__(self, battery_dir: Path) -> None:
        self._dir = battery_dir
        self._start = self._stored_j()
        self._lost = self._start is None

    @classmethod
    def find(cls, root: Path = POWER_SUPPLY) -> BatteryEnergySensor | None:
        """The first battery with an energy (or charge and voltage) counter that is discharging
        now; None when the board has none (then its energy is modelled or unknown)."""
        try:
            entries = sorted(root.iterdir())
        except OSError:
            return None
        for entry in entries:
            if _read(entry / "type") == "Battery" and _read(entry / "status") == "Discharging":
                sensor = cls(entry)
                if not sensor._lost:
                    return sensor
        return None

    def energy_j(self) -> float | None:
        """Joules used since the sensor started, or None once the board was on mains power."""
        if self._lost:
            return None
        now = self._stored_j()
        if now is None or _read(self._dir / "status") != "Discharging":
            self._lost = True
            return None
        return max(0.0, self._start - now)

    def _stored_j(self) -> float | None:
        energy = _read_number(self._dir / "energy_now")  # µWh
        if energy is not None:
            return energy * 1e-6 * _J_PER_WH
        charge, volts = _read_number(self._dir / "charge_now"), _read_number(self._dir / "voltage_now")  # µAh, µV
        if charge is not None and volts is not None:
            return charge * 1e-6 * volts * 1e-6 * _J_PER_WH
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_number(path: Path) -> float | None:
    text = _read(path)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
