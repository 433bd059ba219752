"""The job server's jobs on disk: one JSON file rewritten atomically, so jobs survive a restart.

Each job keeps the YAML it was submitted with, its request, its state and, while it runs, the
process id and port of its own coordinator (a restarted job server adopts a coordinator that is
still running, and re-queues one that died, to resume from its checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

STATES = ("waiting", "starting", "running", "finished", "failed", "cancelled")
ACTIVE = ("starting", "running")
DONE = ("finished", "failed", "cancelled")


@dataclass
class JobRecord:
    """One submitted job and what has happened to it."""

    id: str
    name: str
    """The job's own name (from its YAML); its run directory is ``<id>-<name>``."""
    yaml: str
    """The job YAML as submitted."""
    model: str
    kind: str
    request: str
    """What it asked for, in words (``boards a,b``, ``2 boards``, ``1-4 boards``)."""
    priority: float
    submitted: float
    """Unix time."""
    steps: int
    global_batch: int
    state: str = "waiting"
    boards: list[str] = field(default_factory=list)
    """Boards it runs on; for a waiting job, the boards the current plan gives it."""
    planned_start: float = 0.0
    predicted_finish: float = 0.0
    predicted_samples_per_s: float = 0.0
    measured_samples_per_s: float = 0.0
    """Median samples/s of its steps in its latest launch, timed by its coordinator (0: not yet)."""
    started: float = 0.0
    finished: float = 0.0
    steps_done: int = 0
    """Steps completed when its coordinator last reported (or the checkpoint it resumes from)."""
    message: str = ""
    pid: int = 0
    pid_started: float = 0.0
    """The coordinator process's creation time (a recycled pid is not ours)."""
    port: int = 0
    overhead_s: float = 0.0
    """Measured seconds it ran besides training steps: launch to first step, last step to exit
    (0: not measured)."""
    launches: int = 0
    """How often its coordinator was started (more than once: the server restarted, or a board
    did not join)."""
    stepped: bool = False
    """Its coordinator has logged a step since this launch."""
    resume: bool = False
    """Start from the run's newest complete checkpoint, or from step 0 if it wrote none
(`--resume-or-start`: the job ran before the job server restarted, perhaps not long enough for
a checkpoint)."""

    idempotency_key: str = ""
    """The key of the Submit that queued it (a retried Submit with it returns this job)."""

    @property
    def run_name(self) -> str:
        return f"{self.id}-{self.name}"

    @property
    def work_samples(self) -> float:
        """Samples left to train."""
        return float(max(1, self.steps - self.steps_done) * self.global_batch)


class StoreError(RuntimeError):
    """The jobs file exists but cannot be read."""


class JobStore:
    """Jobs by id, in submission order, saved to ``path`` on every change."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.jobs: dict[str, JobRecord] = {}
        self.counter = 0
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.counter = int(data["counter"])
                known = {f.name for f in dataclasses.fields(JobRecord)}
                for item in data["jobs"]:
                    record = JobRecord(**{k: v for k, v in item.items() if k in known})
                    self.jobs[record.id] = record
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise StoreError(f"{self.path}: cannot read the job server's jobs: {e}") from None

    def new_id(self) -> str:
        self.counter += 1
        return f"j{self.counter}"

    def add(self, record: JobRecord) -> None:
        self.jobs[record.id] = record
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # one writer per name
        tmp.write_text(json.dumps({"counter": self.counter,
                                   "jobs": [dataclasses.asdict(j) for j in self.jobs.values()]}, indent=1))
        os.replace(tmp, self.path)

    def by_key(self, key: str) -> JobRecord | None:
        """The job a Submit with idempotency key `key` queued (None: none, or no key)."""
        return next((j for j in self.jobs.values() if key and j.idempotency_key == key), None)

    def in_state(self, *states: str) -> list[JobRecord]:
        return [j for j in self.jobs.values() if j.state in states]
