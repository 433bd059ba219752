"""Results of finished runs: one row per run directory (time and energy to target, throughput).

A run directory (an experiment arm, a baseline, or a plain `edgetrain coordinator` run) holds
metrics.jsonl, summary.json, job.json and, when the experiment runner made it, arm.json (which
arm and repeat it is, the fleet, when it was launched, the stop rule). `collect` turns each into
one row; edgetrain.experiment.report writes them as results.csv and report.md with its plots.

Time to target is measured the way MLPerf and DAWNBench do (docs: RESEARCH.md): the timed window
runs from the first train record's start (its `time - step_s`) to the first eval record whose
test accuracy reaches the target. Evaluating is measurement, not training: the `eval_s` of the
evaluations inside the window is taken out, for every arm alike. Set-up that an arm pays on every
run outside the window and that its `setup` record marks `"counted": true` (the centralized
baseline shipping the boards' data to the gateway) is added. Energy to target is the boards'
energy over the train records in the window (plus counted set-up energy); it is unknown (None)
when any board's energy is, never 0. Other set-up (profiling, process-group start, data fetch) is
reported beside the window, not hidden in it and not added to it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgetrain.catalog import SYNTHETIC_DATASET_NAMES
from edgetrain.config import ConfigError
from edgetrain.plan import plan_from_dict

logger = logging.getLogger(__name__)

ROW_FIELDS = (
    "experiment", "arm", "repeat", "seed", "baseline", "target_accuracy", "reached", "time_to_target_s",
    "energy_to_target_j", "steps_to_target", "setup_s", "setup", "final_accuracy", "samples_per_s",
    "bytes_per_sample", "energy_j", "plan", "steps", "wall_s", "insecure", "synthetic_data", "makespan_s",
    "mean_jct_s", "run_dir")
"""Columns of results.csv, in order (a row of `collect` has exactly these keys)."""

_PSEUDO_DEVICE = re.compile(r"pipeline\d+$")
"""A pipeline's entry in a train record's `devices` (its boards are under `stages`)."""


@dataclass
class RunData:
    """What one run directory holds, parsed (missing files give empty mappings)."""

    path: Path
    records: list[dict]
    summary: dict
    job: dict
    arm: dict
    trace: dict | None = None

    def kind(self, kind: str) -> list[dict]:
        """The metrics records of one kind, in the order written."""
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def name(self) -> str:
        """The arm's name (arm.json, else the directory's name)."""
        return str(self.arm.get("arm") or self.path.name)


@dataclass(frozen=True)
class CurvePoint:
    """One evaluation on the training clock of its arm."""

    step: int
    accuracy: float
    training_s: float
    """Seconds since the first step's start, less evaluation, plus counted set-up."""
    energy_j: float | None
    """The boards' energy up to this evaluation (plus counted set-up); None when unknown."""


@dataclass(frozen=True)
class StepTiming:
    """Where one training step's time went, per board (for the timeline plot)."""

    step: int
    start_s: float
    """Start of the step, seconds after the first shown step's start."""
    step_s: float
    boards: dict[str, dict[str, float]] = field(default_factory=dict)
    """Board -> {"compute", "comm", "wait", "idle"} seconds (wait: a pipeline stage waiting on
    its peers, communication and bubble together)."""


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (the process was killed mid-write) is left out."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                logger.warning("[report] %s: last line is incomplete; left out", path)
                continue
            raise ConfigError(f"{path}: line {number} is not JSON") from None
        if isinstance(record, dict):
            records.append(record)
    return records


def load_run(path: Path) -> RunData:
    """Parse a run directory; ConfigError (naming the path) when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a run directory (no such directory)")
    trace = _read_json(path / "trace.json") or None
    if not (path / "metrics.jsonl").exists() and trace is None:
        raise ConfigError(f"{path}: not a run directory (no metrics.jsonl or trace.json)")
    return RunData(path=path, records=_read_metrics(path / "metrics.jsonl"), summary=_read_json(path / "summary.json"),
                   job=_read_json(path / "job.json"), arm=_read_json(path / "arm.json"), trace=trace)


def target_of(run: RunData, override: float | None = None) -> float | None:
    """The accuracy the run is judged against: the caller's, arm.json's, the job's, or none."""
    if override is not None:
        return override
    for value in (run.arm.get("target_accuracy"), run.job.get("training", {}).get("target_accuracy"),
                  run.summary.get("target_accuracy")):
        if value:
            return float(value)
    return None


def _setup_records(run: RunData) -> list[dict]:
    """Set-up steps: `setup` records, plus arm.json's `setup` entries no record names."""
    records = [r for r in run.kind("setup") if isinstance(r.get("seconds"), (int, float))]
    named = {r.get("what") for r in records}
    for what, seconds in (run.arm.get("setup") or {}).items():
        if what not in named and isinstance(seconds, (int, float)):
            records.append({"kind": "setup", "what": what, "seconds": seconds})
    return records


def _counted(run: RunData) -> tuple[float, float | None]:
    """Seconds and energy of the counted set-up (energy None when a counted step has none given
    and took time; a step without seconds adds nothing)."""
    seconds, energy = 0.0, 0.0
    for r in _setup_records(run):
        if r.get("counted"):
            seconds += float(r["seconds"])
            if isinstance(r.get("energy_j"), (int, float)):
                energy += r["energy_j"]
            elif r["seconds"] > 0:
                energy = math.nan
    return seconds, None if math.isnan(energy) else energy


def _record_energy(record: dict) -> float | None:
    """The boards' energy in one train record; None when any board's is unknown (or none is given)."""
    devices = record.get("devices") or {}
    if not devices:
        return None
    values = [d.get("energy_j") if isinstance(d, dict) else None for d in devices.values()]
    if any(not isinstance(v, (int, float)) for v in values):
        return None
    return float(sum(values))


def window_start(run: RunData) -> float | None:
    """Unix time the first training step started (None: no train record)."""
    trains = run.kind("train")
    if not trains:
        return None
    return min(r["time"] - r.get("step_s", 0.0) for r in trains)


def accuracy_curve(run: RunData) -> list[CurvePoint]:
    """Every evaluation after training began, on the training clock (see the module docstring)."""
    start = window_start(run)
    if start is None:
        return []
    trains = sorted(run.kind("train"), key=lambda r: r["time"])
    setup_s, setup_j = _counted(run)
    points, eval_s, energy, t = [], 0.0, setup_j, 0
    for ev in sorted(run.kind("eval"), key=lambda r: r["time"]):
        if ev["time"] < start or not isinstance(ev.get("test_accuracy"), (int, float)):
            continue
        eval_s += ev.get("eval_s") or 0.0
        while t < len(trains) and trains[t]["time"] <= ev["time"]:
            step_j = _record_energy(trains[t])
            energy = None if energy is None or step_j is None else energy + step_j
            t += 1
        points.append(CurvePoint(step=ev.get("step", -1), accuracy=float(ev["test_accuracy"]),
                                 training_s=ev["time"] - start - eval_s + setup_s, energy_j=energy))
    return points


def step_timings(run: RunData, count: int = 4) -> list[StepTiming]:
    """Per-board timings of up to `count` consecutive steps, the first (warm-up) step left out
    when there are more; [] when the train records carry no per-board timings."""
    trains = sorted(run.kind("train"), key=lambda r: r["time"])
    chosen = trains[1:count + 1] if len(trains) > 1 else trains
    out = []
    origin = chosen[0]["time"] - chosen[0].get("step_s", 0.0) if chosen else 0.0
    for r in chosen:
        step_s = float(r.get("step_s") or 0.0)
        boards: dict[str, dict[str, float]] = {}
        stages = r.get("stages") or {}
        for name, d in (r.get("devices") or {}).items():
            if not isinstance(d, dict) or (stages and _PSEUDO_DEVICE.match(name)):
                continue
            if isinstance(d.get("compute_s"), (int, float)):
                boards[name] = {"compute": d["compute_s"], "comm": d.get("comm_s") or 0.0, "wait": 0.0}
        for name, s in stages.items():
            if isinstance(s, dict) and isinstance(s.get("compute_s"), (int, float)):
                boards[name] = {"compute": s["compute_s"], "comm": 0.0, "wait": s.get("wait_s") or 0.0}
        for b in boards.values():
            b["idle"] = max(0.0, step_s - b["compute"] - b["comm"] - b["wait"])
        if boards:
            out.append(StepTiming(step=r.get("step", -1), start_s=r["time"] - step_s - origin, step_s=step_s,
                                  boards=boards))
    return out


def describe_plan(run: RunData) -> str:
    """How the arm split the work: the planner's plan in force at the end, the baseline, or the
    job's pipeline section / data-parallel split."""
    plans = run.kind("plan")
    baseline = run.arm.get("baseline")
    trains = run.kind("train")
    boards = sorted({n for r in trains for n in (r.get("devices") or {})})
    if plans:
        switched = [p for p in plans if p.get("switched")] or plans
        last = switched[-1]
        try:
            text = plan_from_dict(last.get("plan") or {}, where="plan record").describe()
        except ValueError:
            text = str(last.get("plan_kind") or "plan")
        extra = f"; {len(switched) - 1} re-plans" if len(switched) > 1 else ""
        return f"planner: {last.get('plan_kind', '')} — {text}{extra}".replace(":  — ", ": ")
    if baseline == "ddp":
        return f"DDP, equal split over {len(boards)} boards" if boards else "DDP, equal split"
    if baseline == "single":
        return f"one board alone ({boards[0]})" if len(boards) == 1 else "the fastest board alone"
    if baseline == "centralized":
        return "the gateway alone (the boards' data shipped to it)"
    pipeline = run.job.get("pipeline") or {}
    if pipeline.get("stages"):
        keys = ("stages", "microbatches", "schedule", "dp_boards", "dp_share")
        try:
            return plan_from_dict({k: pipeline[k] for k in keys if k in pipeline}, where="job.json").describe()
        except ValueError:
            return "pipeline (job's stages)"
    rule = (run.job.get("aggregation") or {}).get("rule")
    if rule in ("fedavg", "fedprox"):
        fed = run.job.get("federated") or {}
        rounds = (f", {fed['local_steps']} local steps of {fed['local_batch']} a round"
                  if fed.get("local_steps") and fed.get("local_batch") else "")
        return f"federated rounds ({rule}){rounds}"
    split = (run.job.get("training") or {}).get("split") or run.summary.get("split")
    return f"data parallelism, {split} split" if split else "data parallelism"


def _setup_text(records: list[dict], launch_s: float | None) -> str:
    parts = [f"{r.get('what', 'setup')} {r['seconds']:.1f} s" + (" (counted)" if r.get("counted") else "")
             for r in records]
    if launch_s is not None:
        parts.append(f"launch to first step {launch_s:.1f} s")
    return ", ".join(parts)


def _trace_figures(trace: dict) -> tuple[float | None, float | None]:
    """Makespan and mean job completion time of a multi-job trace: given as `makespan_s` and
    `mean_jct_s`, or computed from `jobs: [{submitted, finished}]` (unix seconds)."""
    makespan, jct = trace.get("makespan_s"), trace.get("mean_jct_s")
    jobs = [j for j in trace.get("jobs") or [] if isinstance(j, dict)
            and isinstance(j.get("submitted", j.get("submitted_at")), (int, float))
            and isinstance(j.get("finished", j.get("finished_at")), (int, float))]
    if jobs:
        sub = [j.get("submitted", j.get("submitted_at")) for j in jobs]
        fin = [j.get("finished", j.get("finished_at")) for j in jobs]
        makespan = makespan if makespan is not None else max(fin) - min(sub)
        jct = jct if jct is not None else statistics.mean(f - s for s, f in zip(sub, fin))
    return makespan, jct


def row_of(run: RunData, target_accuracy: float | None = None) -> dict:
    """The results row of one run directory (keys: ROW_FIELDS)."""
    arm, summary, job = run.arm, run.summary, run.job
    target = target_of(run, target_accuracy)
    trains = run.kind("train")
    evals = [e for e in run.kind("eval") if isinstance(e.get("test_accuracy"), (int, float))]
    curve = accuracy_curve(run)
    hit = next((p for p in curve if target is not None and p.accuracy >= target), None)
    start = window_start(run)
    setups = _setup_records(run)
    recorded = sum(float(r["seconds"]) for r in setups)
    launch_s = start - arm["launched_at"] if start is not None and isinstance(arm.get("launched_at"), (int, float)) \
        else None
    setup_s = max(recorded, launch_s) if launch_s is not None else (recorded if setups else None)
    samples = sum(r.get("samples") or 0 for r in trains)
    train_s = sum(r.get("step_s") or 0.0 for r in trains)
    step_energy = [_record_energy(r) for r in trains]
    if samples and summary.get("bytes_per_sample") is not None:
        bytes_per_sample = summary["bytes_per_sample"]
    elif samples:
        bytes_per_sample = sum(d.get("upload_bytes") or 0 for r in trains for d in (r.get("devices") or {}).values()
                               if isinstance(d, dict)) / samples
    else:
        bytes_per_sample = summary.get("bytes_per_sample")
    if isinstance(arm.get("launched_at"), (int, float)) and isinstance(arm.get("ended_at"), (int, float)):
        wall_s = arm["ended_at"] - arm["launched_at"]
    elif run.records and start is not None:
        wall_s = max(r.get("time", start) for r in run.records) - start
    else:
        wall_s = None
    makespan, jct = _trace_figures(run.trace) if run.trace else (None, None)
    baseline = arm.get("baseline")
    return {
        "experiment": arm.get("experiment") or run.path.parent.name, "arm": run.name,
        "repeat": arm.get("repeat", 0), "seed": arm.get("seed", job.get("seed")), "baseline": baseline,
        "target_accuracy": target, "reached": hit is not None,
        "time_to_target_s": hit.training_s if hit else None,
        "energy_to_target_j": hit.energy_j if hit else None,
        "steps_to_target": hit.step + 1 if hit else None,
        "setup_s": setup_s, "setup": _setup_text(setups, launch_s),
        "final_accuracy": evals[-1]["test_accuracy"] if evals else summary.get("test_accuracy"),
        "samples_per_s": samples / train_s if train_s else summary.get("samples_per_s"),
        "bytes_per_sample": bytes_per_sample,
        "energy_j": None if not trains or any(e is None for e in step_energy) else sum(step_energy),
        "plan": describe_plan(run) if trains else (run.trace or {}).get("scheduler", ""),
        "steps": len({r.get("step") for r in trains}), "wall_s": wall_s,
        "insecure": bool(arm.get("insecure", baseline == "ddp")),
        "synthetic_data": bool(arm.get("synthetic_data", summary.get("synthetic_data",
                                                                     (job.get("dataset") or {}).get("name") in SYNTHETIC_DATASET_NAMES))),
        "makespan_s": makespan, "mean_jct_s": jct, "run_dir": str(run.path),
    }


def collect(run_dirs: Sequence[Path], *, target_accuracy: float | None = None) -> list[dict]:
    """One row per run directory (ROW_FIELDS), in the order given. `target_accuracy` replaces the
    target each run was given (arm.json, else its job's). ConfigError names a directory that is
    not a run directory or a file that cannot be read."""
    return [row_of(load_run(Path(d)), target_accuracy) for d in run_dirs]


def group_by_arm(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows per arm, arms in the order they first appear, repeats in order."""
    arms: dict[str, list[dict]] = {}
    for row in rows:
        arms.setdefault(row["arm"], []).append(row)
    for group in arms.values():
        group.sort(key=lambda r: (r["repeat"] if isinstance(r["repeat"], int) else 0))
    return arms
