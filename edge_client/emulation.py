"""An emulated board's link, battery and energy, read from its board file (written by the fleet).

The fleet rewrites the board file when a scripted event changes the board's link; the client
re-reads it at every heartbeat, so application-level link emulation follows the script too.
A real board has no board file: it reports its real battery (if any) and its energy, measured
by the battery's energy counter when it has one, else estimated from `--power-watts` figures.
Every board counts the bytes it moves; its power model charges radio energy for them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from edgetrain.emulator.battery import (
    BatteryEnergySensor,
    BatteryReading,
    EmulatedBattery,
    real_battery,
)
from edgetrain.emulator.fleet_config import BoardSpec, load_board
from edgetrain.emulator.shaping import LinkShaper, LinkSpec
from edgetrain.emulator.throttle import MemoryLimiter
from edgetrain.power import PowerModel, board_power, default_power

logger = logging.getLogger(__name__)


class MeteredLink(LinkShaper):
    """The board's link: shaped as its board file says (or unshaped), and counting every byte the
    client sends and receives through it (radio energy is charged per byte)."""

    def __init__(self, spec: LinkSpec | None = None) -> None:
        super().__init__(spec)
        self._count_lock = threading.Lock()
        self._moved = 0

    def before_send(self, nbytes: int) -> None:
        with self._count_lock:
            self._moved += nbytes
        super().before_send(nbytes)

    def after_receive(self, nbytes: int) -> None:
        with self._count_lock:
            self._moved += nbytes
        super().after_receive(nbytes)

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

    def __init__(self, *, battery: EmulatedBattery | None = None, power: PowerModel | None = None,
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


class BoardEmulation:
    """What this client emulates (or, for a real board, what it can measure of itself)."""

    def __init__(self, board: BoardSpec | None, board_file: Path | None = None,
                 power_w: tuple[float, float] | None = None, *, speed: float | None = None,
                 sensor: BatteryEnergySensor | None = None) -> None:
        self.board = board
        self.board_file = board_file
        self._mtime = board_file.stat().st_mtime if board_file else 0.0
        self.shaper = MeteredLink(board.link if board else None)
        self.battery = EmulatedBattery(board.battery) if board and board.battery else None
        if board:  # its battery's watts, its own, else a Pi-class board of its speed
            power = board_power(board)
        elif speed:  # `--speed` alone: an emulated board with no figures
            power = default_power(speed)
        else:  # a real board: a model only when told its watts
            power = None
        if power_w is not None:
            idle_w, busy_w = power_w
            power = PowerModel(idle_w=idle_w, busy_w=busy_w,
                               **({"radio_nj_per_byte": power.radio_nj_per_byte} if power else {}))
        self.energy = EnergyMeter(battery=self.battery, power=power, radio_bytes=self.shaper.bytes_moved,
                                  sensor=sensor)
        self.memory = MemoryLimiter(cap_bytes=None, mode="none")
        """The memory cap in force (main sets it from `memory_cap_bytes`); reads what the board reports."""

    @property
    def memory_cap_bytes(self) -> int | None:
        """The board file's memory cap in bytes (None: the host's memory)."""
        return int(self.board.memory_mb * 2**20) if self.board and self.board.memory_mb else None

    @classmethod
    def from_file(cls, path: str | None, power_w: tuple[float, float] | None = None, *,
                  speed: float | None = None) -> BoardEmulation:
        """The emulation a board file describes; an emulated board of `speed` without one; a real
        board when both are None (its battery's energy counter measures its energy, if it has one).

        `power_w` (idle, busy watts) overrides the file's or the default figures: how a real board
        without a readable battery energy counter accounts for its energy.
        """
        if path:
            return cls(load_board(path), Path(path), power_w)
        if speed:
            return cls(None, power_w=power_w, speed=speed)
        return cls(None, power_w=power_w, sensor=BatteryEnergySensor.find())

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
