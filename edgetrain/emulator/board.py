"""An emulated board, installed inside its own client process: speed, memory, link and battery.

`edgetrain client --emulate BOARD.yaml` (a board file written by the fleet) or `--speed F` runs
the board role (edge_client.main) with a :class:`BoardEmulation` for its hardware: the CPU
limiter (cgroup quota as root, else duty-cycle sleeps) and memory cap are installed in the
process they hold, its link is shaped by the client itself, and an emulated battery drains with
its work (the board shuts down when it is flat).

The fleet rewrites the board file when a scripted event changes the board's link; the client
re-reads it at every heartbeat, so application-level link emulation follows the script too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from edge_client.main import run_client
from edge_client.worker import ClientOptions
from edgetrain.board_hardware import BatteryEnergySensor, BoardHardware
from edgetrain.emulator.battery import EmulatedBattery
from edgetrain.emulator.shaping import LinkShaper
from edgetrain.emulator.throttle import limit_cpu, limit_memory
from edgetrain.fleet_file import BoardSpec, load_board
from edgetrain.power import PowerModel, board_power, default_power

logger = logging.getLogger(__name__)


class BoardEmulation(BoardHardware):
    """What this client emulates: a board file's board, or a board of `speed` without one."""

    def __init__(self, board: BoardSpec | None, board_file: Path | None = None,
                 power_w: tuple[float, float] | None = None, *, speed: float | None = None,
                 sensor: BatteryEnergySensor | None = None) -> None:
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
        self.link = LinkShaper(board.link if board else None)
        """The emulated link (its rate changes as the board file does)."""
        super().__init__(power=power, sensor=sensor, shaper=self.link,
                         battery=EmulatedBattery(board.battery) if board and board.battery else None)
        self.board = board
        self.board_file = board_file
        self.speed = board.speed if board else speed
        """The fraction of one core the board computes with (None: the whole machine)."""
        self._mtime = board_file.stat().st_mtime if board_file else 0.0

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

    @contextlib.contextmanager
    def installed(self, name: str) -> Iterator[BoardEmulation]:
        """Hold this process to the board's speed and memory while the client runs."""
        with limit_cpu(self.speed, name=name) as limiter, limit_memory(self.memory_cap_bytes, name=name) as memory:
            self.throttle, self.memory = limiter, memory
            if self.speed:
                logger.info("[Client] %s emulates %.2f of a core (%s)", name, self.speed, limiter.mode)
            yield self

    def refresh(self) -> None:
        """Re-read the board file if the fleet changed it (a scripted link change)."""
        if not self.board_file or not self.board_file.exists():
            return
        mtime = self.board_file.stat().st_mtime
        if mtime == self._mtime:
            return
        self._mtime, self.board = mtime, load_board(self.board_file)
        if self.board.link:
            self.link.set_link(self.board.link)
            logger.info("[Client.Emulation] link is now %s", self.board.link)


def run_emulated_client(address: str | None, options: ClientOptions, *, board_file: str | None,
                        speed: float | None, threads: int | None = None, cluster: str | None = None,
                        interfaces: list[str] | None = None) -> str:
    """Run the board role (edge_client.main.run_client) as the board of `board_file`, or as a
    board of `speed` cores without one; returns what run_client returns."""
    emulation = BoardEmulation.from_file(board_file, options.power_w, speed=speed)
    options = replace(options, emulated_speed=emulation.speed)
    if emulation.board:
        options = replace(options, local_data=options.local_data or emulation.board.local_data)
    return run_client(address, options, hardware=emulation, threads=threads, cluster=cluster, interfaces=interfaces)
