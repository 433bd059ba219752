"""An emulated battery that drains with the board's work.

It is read as a :class:`edgetrain.board_hardware.BatteryReading`, as a board's real battery is,
so telemetry treats emulated and real boards alike; the board's real battery and its energy
counter are core code (edgetrain.board_hardware).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from edgetrain.board_hardware import BatteryReading
from edgetrain.fleet_file import BatterySpec

_J_PER_WH = 3600.0


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
