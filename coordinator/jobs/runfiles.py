"""What a job's coordinator wrote to its run directory, as the job server reads it: its step
records (progress, measured samples/s, time besides training) and its end summary."""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.jobs.lobby import step_rate
from coordinator.jobs.store import JobRecord


class RunFiles:
    """The run directories under `runs_dir`, one per launched job (``<id>-<name>``)."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = Path(runs_dir)

    def train_records(self, job: JobRecord) -> list[dict]:
        """Every step record its coordinator logged in metrics.jsonl ([] when unreadable)."""
        try:
            with (self.runs_dir / job.run_name / "metrics.jsonl").open("rb") as f:
                return [json.loads(line) for line in f if b'"kind": "train"' in line]
        except (OSError, ValueError):
            return []

    def train_steps(self, job: JobRecord) -> list[tuple[int, float]]:
        """(step, time) of every step its coordinator logged ([] when unreadable)."""
        try:
            return [(int(r["step"]), float(r["time"])) for r in self.train_records(job)]
        except (KeyError, TypeError, ValueError):
            return []

    def progress(self, job: JobRecord) -> None:
        """Its steps done (what its coordinator logged, at least what it had before) and the
        samples/s its coordinator measured in this launch."""
        records = self.train_records(job)
        job.steps_done = max([job.steps_done] + [int(r["step"]) + 1 for r in records
                                                 if isinstance(r.get("step"), int)])
        rate = step_rate(records, job.started) if job.started else 0.0
        if rate:
            job.measured_samples_per_s = rate

    def measured_overhead(self, job: JobRecord) -> float:
        """Launch to exit minus its training steps, from its coordinator's step log (0: unknown)."""
        times = [t for _, t in self.train_steps(job)]
        if len(times) < 2 or not job.started or job.resume:
            return 0.0
        training = (times[-1] - times[0]) * len(times) / (len(times) - 1)
        return max(0.0, job.finished - job.started - training)

    def stepped_since(self, job: JobRecord, since: float) -> bool:
        """Whether its coordinator logged a step after `since`."""
        return any(t >= since for _, t in self.train_steps(job))

    def summary(self, job: JobRecord) -> dict | None:
        """The summary its coordinator wrote at its end (None: none, or unreadable)."""
        try:
            summary = json.loads((self.runs_dir / job.run_name / "summary.json").read_text())
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None

    def dashboard_url(self, job: JobRecord) -> str | None:
        """The URL (token included) its coordinator's dashboard wrote (None: none yet)."""
        try:
            return (self.runs_dir / job.run_name / "dashboard.url").read_text().strip() or None
        except OSError:
            return None
