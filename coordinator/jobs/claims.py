"""Each board's claimed speed checked against the steps of the jobs it ran alone: a claim far off
is flagged and the board planned by the measurement (``coordinator.jobs.lobby``)."""

from __future__ import annotations

import logging
import math
import time

from coordinator.jobs.lobby import LobbyBoard, fleet_ratio, step_rate, upload_mbit
from coordinator.jobs.runfiles import RunFiles
from coordinator.jobs.speed import implied_speed
from coordinator.jobs.store import DONE, JobRecord
from coordinator.jobs.submission import parse_job

logger = logging.getLogger(__name__)


class ClaimChecker:
    """Measures boards by their single-board jobs, at most every `poll_s`."""

    def __init__(self, runs: RunFiles, poll_s: float) -> None:
        self.runs, self.poll_s = runs, poll_s
        self._checked = -math.inf
        self._implied: dict[tuple[str, float, float], float] = {}
        """Speed implied by (job id, measured samples/s, link): the planner is asked once."""
        self._measured_done: set[str] = set()
        """Finished jobs whose steps were read for their board's measurement."""

    def due(self) -> None:
        """Check at the next `check` (a job ended: its last steps count)."""
        self._checked = -math.inf

    def check(self, jobs: list[JobRecord], boards: dict[str, LobbyBoard]) -> bool:
        """Each board's speed as its latest job alone measured it; whether a planned speed changed."""
        if time.monotonic() - self._checked < self.poll_s:
            return False
        self._checked = time.monotonic()
        before = judgements(boards)
        latest: dict[str, JobRecord] = {}
        for job in sorted(jobs, key=lambda j: j.started):
            if job.started and len(job.boards) == 1 and job.state not in ("waiting", "starting"):
                latest[job.boards[0]] = job
        for name, job in latest.items():
            board = boards.get(name)
            if board is not None and not (job.state in DONE and job.id in self._measured_done
                                          and board.measured_in == job.id):
                self._measure(board, job)
        return judge(boards, before)

    def _measure(self, board: LobbyBoard, job: JobRecord) -> None:
        records = self.runs.train_records(job)
        rate, link = step_rate(records, job.started), max(board.mbit_per_s, upload_mbit(records, job.started))
        if job.state in DONE:
            self._measured_done.add(job.id)
        if not rate:
            return
        key = (job.id, round(rate, 4), round(link, 1))
        if key not in self._implied:
            try:
                self._implied[key] = implied_speed(parse_job(job.yaml), board.name, link, rate)
            except Exception:  # a measurement must never stop the server  # noqa: BLE001
                logger.exception("[JobServer] cannot judge board %s by job %s", board.name, job.id)
                self._implied[key] = 0.0
        if self._implied[key]:
            board.implied_speed, board.measured_in = self._implied[key], job.id


def judgements(boards: dict[str, LobbyBoard]) -> dict[str, tuple[bool, float]]:
    """Each board's (flagged, planned speed)."""
    return {name: (b.far_off, b.speed) for name, b in boards.items()}


def judge(boards: dict[str, LobbyBoard], before: dict[str, tuple[bool, float]]) -> bool:
    """Calibrate every board by the fleet's ratio of measured to claimed speed and log the boards
    flagged or cleared since `before`; whether a planned speed changed."""
    ratio = fleet_ratio(list(boards.values()))
    changed = False
    for name, board in boards.items():
        board.fleet_ratio = ratio
        flagged, planned = before.get(name, (False, board.claimed_speed))
        if board.far_off and not flagged:
            logger.warning("[JobServer] board %s %s: planned at the measured speed", name, board.flag)
        elif flagged and not board.far_off:
            logger.info("[JobServer] board %s: its claim %.2f agrees with its steps in job %s (%.2f) again",
                        name, board.claimed_speed, board.measured_in, board.measured_speed)
        changed |= board.speed != planned
    return changed
