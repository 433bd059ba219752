"""Light fake boards for load measurements: many boards in one process, no model, no training.

Each board is its own thread with its own fleet certificate and its own channel
(``CoordinatorConnection``, the real client's calls): it registers, reports a SYNTHETIC profile,
sends a heartbeat with SYNTHETIC telemetry every heartbeat interval of the job, and — as an idle
real board does — holds its presence stream open and long-polls for work. What it measures is each heartbeat's round trip as the
board sees it. The emulated fleet's load benchmark (edgetrain.emulator.fleet_load) starts these
processes; run alone:

    python -m edgetrain.emulator.light_boards --coordinator HOST:PORT --identities DIR NAME...

DIR/NAME holds each board's key, certificate and CA (trust.Identity.save). The process speaks
JSON lines: it prints {"registered": n, "failed": {...}} once every board has registered (or
failed to), records round trips from a "measure" line on stdin to a "pause" line, and on "stop"
(or the end of stdin) prints {"boards": [...]} with each board's round trips and errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from edge_client.connection import CoordinatorConnection
from edge_client.credentials import BoardCredentials
from edgetrain import transport, trust
from edgetrain.telemetry import TelemetrySample
from edgetrain.work import BoardProfile, Finished

logger = logging.getLogger(__name__)

SYNTHETIC_PROFILE = BoardProfile(timings=((4, 0.05), (16, 0.15)), memory_total_bytes=2 * 2**30,
                                 memory_available_bytes=2**30, peak_rss_bytes=200 * 2**20)
"""The profile every light board reports (synthetic: nothing was timed)."""
POLL_S = 10.0
"""How long an idle light board's work poll waits, as an idle real board's (ClientOptions.poll_s)."""


@dataclass
class LightBoard:
    """One light board's registration and what it measured."""

    name: str
    device_id: str = ""
    rtts_ms: list[float] = field(default_factory=list)
    """Heartbeat round trips while measuring, in milliseconds."""
    heartbeat_errors: int = 0
    last_error: str = ""
    polls: int = 0
    """Work polls answered (with nothing to do, or the end of the job)."""
    presence_events: int = 0
    """Messages received on the presence stream."""

    def result(self) -> dict:
        return {"name": self.name, "device_id": self.device_id, "rtts_ms": [round(r, 3) for r in self.rtts_ms],
                "heartbeat_errors": self.heartbeat_errors, "last_error": self.last_error, "polls": self.polls,
                "presence_events": self.presence_events}


def synthetic_telemetry(rtt_ms: float | None) -> TelemetrySample:
    """A telemetry sample of the size a real board sends (SYNTHETIC values, the last round trip real)."""
    return TelemetrySample(timestamp=time.time(), cpu_percent=random.uniform(5, 15), memory_used_bytes=600 * 2**20,
                           memory_total_bytes=2 * 2**30, temperature_c=45.0, cpu_freq_mhz=1500.0,
                           link_mbit_per_s=90.0, rtt_ms=rtt_ms, plugged=True)


class LightFleet:
    """The light boards of this process, sharing a stop and a measuring switch."""

    def __init__(self, address: str, identities: Path, names: list[str], *, idle_calls: bool = True) -> None:
        self.address = address
        self.identities = Path(identities)
        self.boards = [LightBoard(name) for name in names]
        self.idle_calls = idle_calls
        """Whether each board also holds what an idle real board holds open: its presence stream and
        a work poll (each takes a coordinator thread while open)."""
        self.measuring = threading.Event()
        self.stop = threading.Event()
        self._settled = threading.Semaphore(0)
        self._failed: dict[str, str] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start every board's thread."""
        for board in self.boards:
            thread = threading.Thread(target=self._run, args=(board,), name=board.name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_registered(self) -> dict:
        """Block until every board has registered and profiled or failed; how many did, and why not."""
        for _ in self.boards:
            self._settled.acquire()
        return {"registered": len(self.boards) - len(self._failed), "failed": dict(self._failed)}

    def finish(self, timeout_s: float = 30.0) -> dict:
        """Stop every board and return what each measured."""
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return {"boards": [board.result() for board in self.boards]}

    def _run(self, board: LightBoard) -> None:
        path = self.identities / board.name
        connection = None
        try:
            credentials = BoardCredentials(trust.Identity.load(path), path)
            connection = CoordinatorConnection(self.address, credentials=credentials)
            board.device_id, job = connection.register(board.name, None, "")
            presence = connection.attach(board.device_id) if self.idle_calls else None
            connection.report_profile(board.device_id, SYNTHETIC_PROFILE)
        except (grpc.RpcError, ConnectionError, trust.TrustError) as e:
            self._failed[board.name] = transport.describe(e)
            self._settled.release()
            if connection is not None:
                connection.close()
            return
        self._settled.release()
        if presence is not None:
            threading.Thread(target=self._follow, args=(presence, board), name=f"{board.name}-presence",
                             daemon=True).start()
            threading.Thread(target=self._poll, args=(connection, board), name=f"{board.name}-poll",
                             daemon=True).start()
        try:
            self._heartbeats(connection, board, job.heartbeat_interval_s)
        finally:
            if presence is not None:
                presence.cancel()
            connection.close()

    def _heartbeats(self, connection: CoordinatorConnection, board: LightBoard, interval_s: float) -> None:
        """Heartbeats as the real board sends them (the next one an interval after the last one
        ended), the first after a random part of an interval: real boards do not start in step."""
        rtt_ms = None
        if self.stop.wait(random.uniform(0, interval_s)):
            return
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                connection.heartbeat(board.device_id, synthetic_telemetry(rtt_ms))
                rtt_ms = (time.perf_counter() - started) * 1000
                if self.measuring.is_set():
                    board.rtts_ms.append(rtt_ms)
            except grpc.RpcError as e:
                board.heartbeat_errors += self.measuring.is_set()
                board.last_error = transport.describe(e)
            if self.stop.wait(interval_s):
                return

    def _follow(self, presence, board: LightBoard) -> None:
        """Read the presence stream until it ends (a break the board did not ask for is noted)."""
        try:
            for _ in presence:
                board.presence_events += 1
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                board.last_error = transport.describe(e)

    def _poll(self, connection: CoordinatorConnection, board: LightBoard) -> None:
        """Long-poll for work as an idle board does (the job never starts: nothing comes)."""
        while not self.stop.is_set():
            try:
                work = connection.get_work(board.device_id, POLL_S)
            except (grpc.RpcError, ConnectionError, ValueError) as e:  # ValueError: closed under the call
                if not self.stop.is_set():
                    board.last_error = transport.describe(e)
                return
            board.polls += 1
            if isinstance(work, Finished):
                return


def main(argv: list[str] | None = None) -> int:
    """Run light boards until told to stop (see the module docstring for the protocol)."""
    parser = argparse.ArgumentParser(prog="python -m edgetrain.emulator.light_boards", description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    parser.add_argument("--identities", required=True, type=Path, help="DIR/NAME holds each board's credentials")
    parser.add_argument("--heartbeats-only", action="store_true",
                        help="no presence stream and no work poll held open, only heartbeats")
    parser.add_argument("names", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fleet = LightFleet(args.coordinator, args.identities, args.names, idle_calls=not args.heartbeats_only)
    fleet.start()
    print(json.dumps(fleet.wait_registered()), flush=True)
    for line in sys.stdin:
        if line.strip() == "measure":
            fleet.measuring.set()
        elif line.strip() == "pause":
            fleet.measuring.clear()
        elif line.strip() == "stop":
            break
    print(json.dumps(fleet.finish()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
