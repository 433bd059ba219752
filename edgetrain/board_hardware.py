"""The machine a board runs on, as the board role sees it: compute, memory, link, battery, energy.

The board role (edge_client) takes these seams and nothing else of the machine, so it runs the
same on a real board and on an emulated one:

- a compute throttle (:class:`ComputeThrottle`: ``working()`` around each compute burst);
- a memory gauge (:class:`MemoryGauge`: the memory the board reports and plans by);
- a link shaper (:class:`LinkShaping`: before_send / after_receive / rpc_delay / lost);
- a battery (:class:`DrainingBattery`) and the energy used (:class:`EnergyMeter`).

:class:`BoardHardware` bundles them; its defaults are a real board's: full speed, the host's
memory, the real link, its real battery (psutil) and energy measured by the battery's own
counter (Linux ``/sys/class/power_supply``) or modelled from ``--power-watts``. The emulated fleet
(edgetrain.emulator.board) hands an emulated board its throttle, memory cap, shaped link and
battery inside the board's own process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from edgetrain.power import PowerModel

_J_PER_WH = 3600.0


class ComputeThrottle(Protocol):
    """What the board does around compute: a real board runs at full speed; an emulated one is
    slowed to a fraction of a core (edgetrain.emulator.throttle.CpuLimiter)."""

    @property
    def fraction(self) -> float | None:
        """Cores the board computes with (None: all of the machine's)."""

    @property
    def mode(self) -> str:
        """How the limit is held ("none" when there is none)."""

    def working(self) -> AbstractContextManager[None]:
        """Wrap one burst of compute."""


class MemoryGauge(Protocol):
    """The memory the board reports and is planned by."""

    @property
    def cap_bytes(self) -> int | None:
        """A cap below the host's memory (None: the host's)."""

    def reading(self) -> tuple[int, int]:
        """(total, available) bytes as the board sees them."""


class LinkShaping(Protocol):
    """What the board does to its traffic: a real link passes it; an emulated one is held to a
    rate, delay and loss (edgetrain.emulator.shaping.LinkShaper)."""

    def before_send(self, nbytes: int) -> None:
        """Called before sending each chunk."""

    def after_receive(self, nbytes: int) -> None:
        """Called after receiving each chunk."""

    def rpc_delay(self) -> None:
        """Called once per unary RPC."""

    def lost(self, rng) -> bool:
        """Whether a chunk is lost and must be resent."""


class DrainingBattery(Protocol):
    """A battery the board's work drains (an emulated one: edgetrain.emulator.battery)."""

    @property
    def empty(self) -> bool:
        """The charge is gone on battery power: the board must shut down."""

    def set_busy(self, busy: bool) -> None:
        """The board starts (True) or stops (False) a compute burst."""

    def read(self) -> BatteryReading:
        """Charge, charging state and energy used, at one instant."""


class FullSpeed:
    """A real board's compute: no throttle."""

    fraction: float | None = None
    mode = "none"

    def working(self) -> AbstractContextManager[None]:
        """Nothing to do around compute."""
        return contextlib.nullcontext()


class HostMemory:
    """A real board's memory: the host's, as psutil reports it."""

    cap_bytes: int | None = None
    mode = "none"

    def reading(self) -> tuple[int, int]:
        """(total, available) bytes of the host."""
        memory = psutil.virtual_memory()
        return memory.total, memory.available


@dataclass(frozen=True)
class BatteryReading:
    """A battery's state as psutil reports a real one, plus the energy used when known."""

    percent: float
    """Charge left, 0-100."""
    charging: bool | None
    """On external power (psutil's ``power_plugged``): the charge is not falling; None: unknown."""
    energy_j: float | None = None
    """Energy the board used since it started, joules; None when unknown (a real battery)."""


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


class MeteredLink:
    """The board's link: shaped by `shaper` (None: the real, unshaped link), and counting every
    byte the client sends and receives through it (radio energy is charged per byte)."""

    def __init__(self, shaper: LinkShaping | None = None) -> None:
        self.shaper = shaper
        self._count_lock = threading.Lock()
        self._moved = 0

    def before_send(self, nbytes: int) -> None:
        with self._count_lock:
            self._moved += nbytes
        if self.shaper is not None:
            self.shaper.before_send(nbytes)

    def after_receive(self, nbytes: int) -> None:
        with self._count_lock:
            self._moved += nbytes
        if self.shaper is not None:
            self.shaper.after_receive(nbytes)

    def rpc_delay(self) -> None:
        if self.shaper is not None:
            self.shaper.rpc_delay()

    def lost(self, rng) -> bool:
        return self.shaper is not None and self.shaper.lost(rng)

    def bytes_moved(self) -> int:
        """Bytes sent plus received so far."""
        with self._count_lock:
            return self._moved


class EnergyMeter:
    """Energy a board uses, from the best source it has:

    1. a real battery's energy counter while the board runs from it (measured);
    2. its emulated battery (compute, from the battery's watts) plus radio energy (estimated);
    3. its power model: busy/idle watts plus radio energy per byte (estimated);
    4. else unknown (None).
    """

    def __init__(self, *, battery: DrainingBattery | None = None, power: PowerModel | None = None,
                 radio_bytes: Callable[[], int] = lambda: 0, sensor: BatteryEnergySensor | None = None) -> None:
        self._battery = battery
        self._power = power
        self._radio_bytes = radio_bytes
        self._sensor = sensor
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._busy_s = 0.0
        self.measured = False
        """The last reading came from a sensor, not a model."""

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the board as training for the duration of the block."""
        started = time.monotonic()
        if self._battery:
            self._battery.set_busy(True)
        try:
            yield
        finally:
            if self._battery:
                self._battery.set_busy(False)
            with self._lock:
                self._busy_s += time.monotonic() - started

    @property
    def power(self) -> PowerModel | None:
        """The power model energy is estimated with, when the board has one."""
        return self._power

    @property
    def power_w(self) -> tuple[float, float] | None:
        """(idle, busy) watts, when known."""
        return (self._power.idle_w, self._power.busy_w) if self._power else None

    def energy_j(self) -> float | None:
        """Joules used since the client started, or None when the board cannot tell."""
        measured = self._sensor.energy_j() if self._sensor else None
        if measured is not None:
            self.measured = True
            return measured
        self.measured = False
        radio = self._power.energy_j(busy_s=0, idle_s=0, radio_bytes=self._radio_bytes()) if self._power else 0.0
        if self._battery:
            return self._battery.read().energy_j + radio
        if self._power:
            with self._lock:
                busy = self._busy_s
            idle = max(0.0, time.monotonic() - self._started - busy)
            return self._power.energy_j(busy_s=busy, idle_s=idle) + radio
        return None


class BoardHardware:
    """The machine the board role runs on: its compute throttle, memory, link, battery and energy.

    The defaults are a real board's (see the module docstring); `power` is its power model when
    known (`--power-watts`), `sensor` its battery's energy counter. An emulated board is a
    subclass that installs its throttle and memory cap in :meth:`installed` and follows its
    board file in :meth:`refresh` (edgetrain.emulator.board.BoardEmulation).
    """

    def __init__(self, *, power: PowerModel | None = None, sensor: BatteryEnergySensor | None = None,
                 shaper: LinkShaping | None = None, battery: DrainingBattery | None = None) -> None:
        self.throttle: ComputeThrottle = FullSpeed()
        self.memory: MemoryGauge = HostMemory()
        self.shaper = MeteredLink(shaper)
        """The board's link, counting its bytes (and shaped, on an emulated board)."""
        self.battery = battery
        self.energy = EnergyMeter(battery=battery, power=power, radio_bytes=self.shaper.bytes_moved, sensor=sensor)

    @classmethod
    def real(cls, power_w: tuple[float, float] | None = None) -> BoardHardware:
        """A real board: its energy measured by its battery's counter when it has one, else
        modelled from `power_w` (idle, busy watts) when given, else unknown."""
        power = PowerModel(idle_w=power_w[0], busy_w=power_w[1]) if power_w is not None else None
        return cls(power=power, sensor=BatteryEnergySensor.find())

    @contextlib.contextmanager
    def installed(self, name: str) -> Iterator[BoardHardware]:
        """Hold the board's compute and memory to what it is while the client of board `name`
        runs (a real board: nothing to hold)."""
        yield self

    def read_battery(self) -> BatteryReading | None:
        """The board's battery (None when it has none)."""
        return self.battery.read() if self.battery else real_battery()

    @property
    def battery_empty(self) -> bool:
        """True once a draining battery is flat: the board must shut down, as a real one would."""
        return bool(self.battery and self.battery.empty)

    def refresh(self) -> None:
        """Follow changes to the board (called at every heartbeat; a real board has none)."""
