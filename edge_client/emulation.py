"""An emulated board's link, battery and energy, read from its board file (written by the fleet).

The fleet rewrites the board file when a scripted event changes the board's link; the client
re-reads it at every heartbeat, so application-level link emulation follows the script too.
A real board has no board file: it reports its real battery (if any) and, given power figures,
its energy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from edgetrain.emulator.battery import BatteryReading, EmulatedBattery, energy_j, real_battery
from edgetrain.emulator.fleet_config import BoardSpec, load_board
from edgetrain.emulator.shaping import LinkShaper

logger = logging.getLogger(__name__)


class EnergyMeter:
    """Energy a board uses: from its emulated battery, or from power figures, else unknown."""

    def __init__(self, battery: EmulatedBattery | None, idle_w: float | None, busy_w: float | None) -> None:
        self._battery = battery
        self._power = (idle_w, busy_w) if idle_w is not None and busy_w is not None else None
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._busy_s = 0.0

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
    def power_w(self) -> tuple[float, float] | None:
        """(idle, busy) watts, when known."""
        return self._power

    def energy_j(self) -> float | None:
        """Joules used since the client started, or None when the board cannot tell."""
        if self._battery:
            return self._battery.read().energy_j
        if self._power:
            with self._lock:
                busy = self._busy_s
            idle = max(0.0, time.monotonic() - self._started - busy)
            return energy_j(busy_s=busy, idle_s=idle, idle_w=self._power[0], busy_w=self._power[1])
        return None


class BoardEmulation:
    """What this client emulates (or, for a real board, what it can measure of itself)."""

    def __init__(self, board: BoardSpec | None, board_file: Path | None = None,
                 power_w: tuple[float, float] | None = None) -> None:
        self.board = board
        self.board_file = board_file
        self._mtime = board_file.stat().st_mtime if board_file else 0.0
        self.shaper = LinkShaper(board.link) if board and board.link else None
        self.battery = EmulatedBattery(board.battery) if board and board.battery else None
        idle_w, busy_w = power_w or ((board.idle_w, board.busy_w) if board else (None, None))
        if idle_w is None and board and board.battery:  # a battery board's power model is its battery's
            idle_w, busy_w = board.battery.idle_w, board.battery.busy_w
        self.energy = EnergyMeter(self.battery, idle_w, busy_w)

    @classmethod
    def from_file(cls, path: str | None, power_w: tuple[float, float] | None = None) -> BoardEmulation:
        """The emulation a board file describes; a real board when `path` is None.

        `power_w` (idle, busy watts) overrides the file's figures: how a real board without a
        readable battery energy counter accounts for its energy.
        """
        return cls(load_board(path), Path(path), power_w) if path else cls(None, power_w=power_w)

    def read_battery(self) -> BatteryReading | None:
        """The emulated battery, else the board's real one (None when it has none)."""
        return self.battery.read() if self.battery else real_battery()

    @property
    def battery_empty(self) -> bool:
        """True once an emulated battery is flat: the board must shut down, as a real one would."""
        return bool(self.battery and self.battery.empty)

    def refresh(self) -> None:
        """Re-read the board file if the fleet changed it (a scripted link change)."""
        if not self.board_file or not self.board_file.exists():
            return
        mtime = self.board_file.stat().st_mtime
        if mtime == self._mtime:
            return
        self._mtime, self.board = mtime, load_board(self.board_file)
        if self.shaper and self.board.link:
            self.shaper.set_link(self.board.link)
            logger.info("[Client.Emulation] link is now %s", self.board.link)
