"""Batteries: an emulated one that drains with the board's work, and the board's real one.

Both are read as a `BatteryReading`, so telemetry treats emulated and real boards alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil


@dataclass(kw_only=True, frozen=True)
class BatterySpec:
    """An emulated battery and the board's power draw."""

    capacity_wh: float
    """Usable capacity, watt-hours."""
    idle_w: float
    """Power draw while idle, watts."""
    busy_w: float
    """Power draw while training, watts."""
    initial_percent: float = 100.0
    """Charge when the board starts."""
    plugged: bool = False
    """On mains power: the battery neither drains nor reports discharging."""
    charge_w: float = 0.0
    """Charging power while plugged, watts (0: plugged keeps the charge level)."""

    def __post_init__(self) -> None:
        for name in ("capacity_wh", "idle_w", "busy_w"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.busy_w < self.idle_w:
            raise ValueError(f"busy_w ({self.busy_w}) must be >= idle_w ({self.idle_w})")
        if not 0 <= self.initial_percent <= 100:
            raise ValueError(f"initial_percent must be in [0, 100], got {self.initial_percent}")
        if self.charge_w < 0:
            raise ValueError(f"charge_w must be >= 0, got {self.charge_w}")


@dataclass(frozen=True)
class BatteryReading:
    """A battery's state, the way psutil reports a real one (plus energy when known)."""

    percent: float
    charging: bool
    energy_j: float | None = None
    """Energy the board used since it started, joules; None when unknown (a real battery)."""


class EmulatedBattery:
    """Drains at busy_w while the board trains and idle_w otherwise (unless plugged)."""

    def __init__(self, spec: BatterySpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._busy = False
        self._energy_j = 0.0
        self._charge_j = spec.capacity_wh * 3600 * spec.initial_percent / 100

    def _advance(self) -> None:
        now = self._clock()
        elapsed, self._last = now - self._last, now
        used = elapsed * (self.spec.busy_w if self._busy else self.spec.idle_w)
        self._energy_j += used
        capacity = self.spec.capacity_wh * 3600
        if self.spec.plugged:
            self._charge_j = min(capacity, self._charge_j + elapsed * self.spec.charge_w)
        else:
            self._charge_j = max(0.0, self._charge_j - used)

    def set_busy(self, busy: bool) -> None:
        """The board starts (True) or stops (False) training."""
        with self._lock:
            self._advance()
            self._busy = busy

    def read(self) -> BatteryReading:
        """Current charge, charging state and energy used so far."""
        with self._lock:
            self._advance()
            percent = 100 * self._charge_j / (self.spec.capacity_wh * 3600)
            return BatteryReading(percent=percent, charging=self.spec.plugged, energy_j=self._energy_j)

    @property
    def empty(self) -> bool:
        """True once the charge is gone (a real board would switch off)."""
        return self.read().percent <= 0.0


def real_battery() -> BatteryReading | None:
    """The board's own battery from psutil, or None when it has none (energy is unknown)."""
    try:
        battery = psutil.sensors_battery()
    except (AttributeError, OSError, NotImplementedError):
        return None
    if battery is None:
        return None
    return BatteryReading(percent=float(battery.percent), charging=bool(battery.power_plugged))


def energy_j(*, busy_s: float, idle_s: float, idle_w: float, busy_w: float) -> float:
    """Energy from configured power figures: busy_w while training, idle_w otherwise."""
    return busy_s * busy_w + idle_s * idle_w
