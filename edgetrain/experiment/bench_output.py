"""What every benchmark in scripts/ shares: its smoke size, its last line, its record, and SIGTERM.

A benchmark's last line is one JSON object. With `--record` that object, with `date` (UTC, ISO
8601) and `commit` (git rev-parse HEAD, `-dirty` when the tree has changes; "unknown" without
git) added, is appended as one line to docs/results/<benchmark>.jsonl, where <benchmark> is the
script's name without `bench_` and `.py`. `--record-to DIR` (or EDGETRAIN_RESULTS_DIR) writes
there instead, so tests do not touch the repository's files.

SIGTERM is turned into KeyboardInterrupt (`stop_on_sigterm`), so a benchmark killed by its
supervisor takes the same path as Ctrl-C: its `finally` blocks and context managers stop the
processes, namespaces and cgroups it started.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
from pathlib import Path

from edgetrain import supervisor

REPO = Path(__file__).resolve().parent.parent.parent
RESULTS_DIR = REPO / "docs" / "results"
RESULTS_ENV = "EDGETRAIN_RESULTS_DIR"
"""Environment variable naming another directory for the records (tests)."""


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """--smoke, --record and --record-to, the same in every benchmark."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes everywhere, one repeat: a check that it runs end to end (seconds)")
    parser.add_argument("--record", action="store_true",
                        help="append the last line, dated and with the commit, to docs/results/<benchmark>.jsonl")
    parser.add_argument("--record-to", type=Path, default=None, help=argparse.SUPPRESS)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _interrupt)


def commit_id(repo: Path = REPO) -> str:
    """HEAD's commit, with `-dirty` when the work tree has changes; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def benchmark_name(script: str) -> str:
    """scripts/bench_time_to_accuracy.py -> time_to_accuracy."""
    stem = Path(script).stem
    return stem.removeprefix("bench_")


def record_path(benchmark: str, record_to: Path | None = None) -> Path:
    directory = record_to or (Path(os.environ[RESULTS_ENV]) if os.environ.get(RESULTS_ENV) else RESULTS_DIR)
    return Path(directory) / f"{benchmark}.jsonl"


def finish(script: str, out: dict, args: argparse.Namespace) -> dict:
    """Print `out` (with `smoke`) as the last line; with `--record`, append it dated to the record."""
    out = {**out, "smoke": bool(getattr(args, "smoke", False))}
    if getattr(args, "record", False):
        stamped = {**out, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "commit": commit_id()}
        path = record_path(benchmark_name(script), getattr(args, "record_to", None))
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(stamped) + "\n")
    print(json.dumps(out), flush=True)
    return out


def run_child(command: list[str], *, grace_s: float = 60.0, **popen_kwargs) -> int:
    """subprocess.run for a child that starts processes of its own (`edgetrain experiment run`):
    when this benchmark is interrupted, the child gets SIGTERM (which it handles as Ctrl-C, stopping
    what it started) and `grace_s` to end before SIGKILL; subprocess.run would SIGKILL it at once
    and orphan its coordinator and boards."""
    child = subprocess.Popen(command, **popen_kwargs)
    try:
        return child.wait()
    except BaseException:
        supervisor.terminate(child, grace_s=grace_s)
        raise
