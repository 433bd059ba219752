"""Results of finished runs: one row per run directory, and the report over an experiment's arms.

A run directory (an experiment arm, a baseline, or a plain `edgetrain coordinator` run) holds
metrics.jsonl, summary.json, job.json and, when the experiment runner made it, arm.json (which
arm and repeat it is, the fleet, when it was launched, the stop rule). `collect` turns each into
one row; `build_report` writes results.csv, report.md and the plots (edgetrain.experiment.plots).

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

import csv
import dataclasses
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgetrain.catalog import SYNTHETIC_DATASET_NAMES
from edgetrain.config import ConfigError
from edgetrain.experiment.plan_trials import trials_section
from edgetrain.plan import plan_from_dict

logger = logging.getLogger(__name__)

ROW_FIELDS = (
    "experiment", "arm", "repeat", "seed", "baseline", "target_accuracy", "reached", "time_to_target_s",
    "energy_to_target_j", "steps_to_target", "setup_s", "setup", "final_accuracy", "samples_per_s",
    "bytes_per_sample", "energy_j", "plan", "steps", "wall_s", "insecure", "synthetic_data", "makespan_s",
    "mean_jct_s", "run_dir")
"""Columns of results.csv, in order (a row of `collect` has exactly these keys)."""

INSECURE_LABEL = "insecure (gloo, no authentication)"
"""How every output labels a DDP arm: gloo's process group authenticates nobody."""

NO_TARGET = "no target given"
"""What the report says for time and energy to target of a run that had no target accuracy."""

PLAN_TIMEOUT_S = 900
"""How long `edgetrain plan` may take (it measures the model once when the cache lacks it)."""

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


# ---------------------------------------------------------------------------------------------
# The report


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _seconds(x: float) -> str:
    return f"{x:.0f} s" if x >= 100 else f"{x:.1f} s"


def _joules(x: float) -> str:
    return f"{x / 1000:.3g} kJ" if x >= 10_000 else f"{x:.0f} J" if x >= 100 else f"{x:.3g} J"


def _number(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def arm_median(values: list[float | None]) -> float | None:
    """Median over repeats, a repeat without a figure counting as infinitely slow (MLPerf ranks
    a run that missed the target last): None when no repeat has a figure, inf when the median
    repeat has none."""
    known = _finite(values)
    if not known:
        return None
    return statistics.median(sorted(known) + [math.inf] * (len(values) - len(known)))


def spread(values: list[float | None], fmt, *, missing: str) -> str:
    """`median [min–max]` over repeats (arm_median); `missing` (e.g. "not reached within the
    cap") stands for a figure a repeat does not have."""
    median = arm_median(values)
    if median is None:
        return missing
    head = fmt(median) if math.isfinite(median) else missing
    if len(values) == 1:
        return head
    known = sorted(_finite(values))
    top = missing if len(known) < len(values) else fmt(known[-1])
    return f"{head} [{fmt(known[0])}–{top}]"


def _ratio(arm: float | None, ddp: float | None, word: str) -> str:
    if arm is None or not math.isfinite(arm):
        return "—"
    if ddp is None or not math.isfinite(ddp):
        return "ddp did not reach the target"
    if ddp == 0:
        return "—"
    r = arm / ddp
    return f"{r:.2f}× ({1 / r:.1f}× {word})" if r > 0 else "—"


def group_by_arm(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows per arm, arms in the order they first appear, repeats in order."""
    arms: dict[str, list[dict]] = {}
    for row in rows:
        arms.setdefault(row["arm"], []).append(row)
    for group in arms.values():
        group.sort(key=lambda r: (r["repeat"] if isinstance(r["repeat"], int) else 0))
    return arms


def _arm_label(rows: list[dict]) -> str:
    name = rows[0]["arm"]
    return f"{name} — {INSECURE_LABEL}" if any(r["insecure"] for r in rows) else name


def _energy_cells(rows: list[dict]) -> str:
    """Energy to target over repeats: "unknown" when a repeat reached the target without energy figures."""
    if all(r["target_accuracy"] is None for r in rows):
        return NO_TARGET
    if any(r["reached"] and r["energy_to_target_j"] is None for r in rows):
        return "unknown"
    return spread([r["energy_to_target_j"] for r in rows], _joules, missing="not reached within the cap")


def arms_table(rows: list[dict]) -> list[str]:
    """Markdown: one line per arm, median [min–max] over repeats, ratios to ddp when there is one."""
    arms = {a: g for a, g in group_by_arm(rows).items() if not all(r["makespan_s"] is not None for r in g)}
    ddp = next((g for a, g in arms.items() if a == "ddp" or any(r["baseline"] == "ddp" for r in g)), None)
    ddp_time = arm_median([r["time_to_target_s"] for r in ddp]) if ddp else None
    ddp_energy = arm_median([r["energy_to_target_j"] for r in ddp]) if ddp else None
    head = ["arm", "runs", "reached", "time to target", "energy to target", "final accuracy", "samples/s",
            "bytes/sample", "setup", "plan"]
    if ddp:
        head += ["time vs ddp", "energy vs ddp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in arms.values():
        cells = [_arm_label(group), str(len(group)), f"{sum(r['reached'] for r in group)} of {len(group)}",
                 NO_TARGET if all(r["target_accuracy"] is None for r in group) else
                 spread([r["time_to_target_s"] for r in group], _seconds, missing="not reached within the cap"),
                 _energy_cells(group),
                 spread([r["final_accuracy"] for r in group], lambda x: f"{x:.3f}", missing="no evaluation"),
                 spread([r["samples_per_s"] for r in group], _number, missing="—"),
                 spread([r["bytes_per_sample"] for r in group], lambda x: f"{x / 1e3:.1f} kB", missing="—"),
                 spread([r["setup_s"] for r in group], _seconds, missing="—"),
                 group[0]["plan"] or "—"]
        if group is ddp:
            cells += ["1 (reference)", "1 (reference)"]
        elif ddp:
            energy_unknown = any(r["reached"] and r["energy_to_target_j"] is None for r in group + ddp)
            cells += [_ratio(arm_median([r["time_to_target_s"] for r in group]), ddp_time, "sooner"),
                      "unknown" if energy_unknown else
                      _ratio(arm_median([r["energy_to_target_j"] for r in group]), ddp_energy, "less")]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def runs_table(rows: list[dict]) -> list[str]:
    """Markdown: one line per run (arm and repeat)."""
    head = ["arm", "repeat", "seed", "time to target", "steps to target", "energy to target", "final accuracy",
            "samples/s", "set-up", "run directory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["makespan_s"] is not None:
            continue
        energy = (NO_TARGET if r["target_accuracy"] is None else "unknown" if r["reached"] and r["energy_to_target_j"] is None else
                  _joules(r["energy_to_target_j"]) if r["reached"] else "not reached within the cap")
        cells = [_arm_label([r]), str(r["repeat"]), str(r["seed"]),
                 NO_TARGET if r["target_accuracy"] is None else
                 _seconds(r["time_to_target_s"]) if r["reached"] else "not reached within the cap",
                 str(r["steps_to_target"]) if r["reached"] else "—", energy,
                 f"{r['final_accuracy']:.3f}" if r["final_accuracy"] is not None else "no evaluation",
                 _number(r["samples_per_s"]) if r["samples_per_s"] else "—", r["setup"] or "—",
                 f"`{r['run_dir']}`"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def trace_table(rows: list[dict]) -> list[str]:
    """Markdown: multi-job trace arms (makespan and mean job completion time over repeats)."""
    head = ["arm", "runs", "makespan", "mean JCT", "scheduler"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in group_by_arm([r for r in rows if r["makespan_s"] is not None]).values():
        lines.append("| " + " | ".join([
            _arm_label(group), str(len(group)),
            spread([r["makespan_s"] for r in group], _seconds, missing="—"),
            spread([r["mean_jct_s"] for r in group], _seconds, missing="—"), group[0]["plan"] or "—"]) + " |")
    return lines


def write_csv(rows: list[dict], path: Path) -> None:
    """results.csv: ROW_FIELDS, one line per run; an unknown figure is an empty cell."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in ROW_FIELDS})


# ---------------------------------------------------------------------------------------------
# The planner's view of the fleet (for the ideal throughput and the Pareto front)


def _fleet_yaml(fleet, model: str, path: Path) -> None:
    """A fleet file holding `fleet`'s boards (a FleetSpec), for `edgetrain plan`."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        return value
    boards = [plain(b) for b in fleet.boards]
    path.write_text(yaml.safe_dump({"name": fleet.name, "job": {"model": model}, "boards": boards}))


def plan_for_fleet(fleet_file: Path, *, model: str, batch: int | None, pareto: bool,
                   stage_state: str | None = None, replicate: bool = True) -> dict:
    """`edgetrain plan FLEET --json` run as a subprocess of this checkout (the planner lives in
    the coordinator role, which the core does not import). Raises RuntimeError with its error."""
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "edgetrain", "plan", str(fleet_file), "--model", model, "--json",
            "--objective", "pareto" if pareto else "time"]
    if batch:
        argv += ["--batch", str(batch)]
    if stage_state:
        argv += ["--stage-state", stage_state]
    if not replicate:
        argv.append("--no-replicate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"edgetrain plan took more than {PLAN_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"edgetrain plan exited {done.returncode}: {last}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RuntimeError("edgetrain plan printed no JSON") from None


def _fleet_file(runs: list[RunData], fleet, model: str, scratch: Path) -> Path | None:
    """The fleet to plan for: the caller's FleetSpec (written out), else arm.json's fleet file."""
    if fleet is not None:
        path = scratch / "fleet.yaml"
        _fleet_yaml(fleet, model, path)
        return path
    for run in runs:
        given = run.arm.get("fleet")
        if isinstance(given, str) and given and Path(given).is_file():
            return Path(given)
    for run in runs:  # the boards arm.json recorded (the fleet file may be elsewhere or gone)
        boards = run.arm.get("fleet_boards")
        if boards:
            path = scratch / "fleet.yaml"
            path.write_text(yaml.safe_dump({"name": str(run.arm.get("fleet") or "fleet"), "job": {"model": model},
                                            "boards": [_recorded_board(b) for b in boards]}))
            return path
    return None


def _recorded_board(board: dict) -> dict:
    """A fleet file's board entry from arm.json's `fleet_boards` record."""
    entry = {"name": board["name"], "speed": board["speed"], "idle_w": board.get("idle_w"),
             "busy_w": board.get("busy_w"),
             "link": {"mbit_per_s": board["mbit_per_s"]} if board.get("mbit_per_s") else None}
    return {k: v for k, v in entry.items() if v is not None}


def _profiled_ideal(runs: list[RunData]) -> float | None:
    """Fallback ideal: the boards' own profiled samples/s (their join profile, summary.json),
    summed, from the run with the most boards."""
    best = None
    for run in runs:
        rates = [d.get("samples_per_s_estimate") for d in run.summary.get("devices") or []]
        rates = [r for r in rates if isinstance(r, (int, float))]
        if rates and (best is None or len(rates) > best[0]):
            best = (len(rates), sum(rates))
    return best[1] if best else None


# ---------------------------------------------------------------------------------------------


def _title_and_notes(rows: list[dict], title: str | None) -> tuple[str, list[str]]:
    experiments = sorted({r["experiment"] for r in rows})
    name = title or (f"Experiment {experiments[0]}" if len(experiments) == 1 else "EdgeTrain results")
    notes = []
    if any(r["synthetic_data"] for r in rows):
        which = "every run" if all(r["synthetic_data"] for r in rows) else "some runs (marked in results.csv)"
        notes.append(f"**Synthetic data**: {which} trained on EdgeTrain's synthetic dataset, not CIFAR-10; "
                     "the figures say how the methods compare on it, not what CIFAR-10 would give.")
    return name, notes


def build_report(run_dirs: Sequence[Path], out_dir: Path, *, title: str | None = None,
                 target_accuracy: float | None = None, fleet=None) -> Path:
    """Write out_dir/results.csv, out_dir/report.md and out_dir/plots/*.png for the run
    directories given; returns report.md's path. `fleet` (a FleetSpec; else the fleet file named
    in arm.json) gives the fleet's ideal throughput and the planner's Pareto front, both from
    `edgetrain plan`. ConfigError when a directory is not a run directory."""
    from edgetrain.experiment import plots

    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise ConfigError("report: no run directories given")
    rows = [row_of(run, target_accuracy) for run in runs]
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "results.csv")
    synthetic = any(r["synthetic_data"] for r in rows)
    name, notes = _title_and_notes(rows, title)
    targets = sorted({r["target_accuracy"] for r in rows if r["target_accuracy"] is not None})
    caps = sorted({run.arm.get("stop", {}).get("time_cap_s") for run in runs
                   if isinstance(run.arm.get("stop"), dict) and run.arm["stop"].get("time_cap_s")})
    trained = [r for r in rows if r["makespan_s"] is None]
    lines = [f"# {name}", ""] + [n + "\n" for n in notes]
    if targets:
        lines.append("Target: test accuracy ≥ " + ", ".join(f"{t:.3f}" for t in targets)
                     + (f", time cap {', '.join(_seconds(c) for c in caps)} per run" if caps else "") + ".")
    elif trained:
        lines.append("Target: none given (no arm has a target accuracy): time and energy to target are not reported.")
    lines += ["", "How the figures are measured:",
              "- **Time to target**: from the first training step's start to the evaluation that first reaches "
              "the target, less the time spent evaluating inside that window (evaluation is measurement, not "
              "training; every arm gets the same treatment), plus set-up that the arm must pay on every run and "
              "marks as counted (e.g. the centralized baseline shipping the boards' data to the gateway).",
              "- **Energy to target**: the boards' energy over the training steps in the same window (plus counted "
              "set-up energy); \"unknown\" when a board reported none.",
              "- **Set-up** (profiling, process-group start, data fetch; or launch to first step when longer) is "
              "reported beside the window and not included in it unless counted.",
              "- Each arm: median and [min–max] over its repeats; a repeat that did not reach the target counts "
              "as slower than every one that did.", ""]
    if trained:
        lines += ["## Arms", ""] + arms_table(trained) + ["", "## Runs", ""] + runs_table(trained) + [""]
    if len(trained) < len(rows):
        lines += ["## Multi-job traces", ""] + trace_table(rows) + [""]
    lines += trials_section(runs)
    lines += ["## Plots", ""]
    figures = plots.make_plots(runs, rows, out_dir / "plots", synthetic=synthetic,
                               plan_view=_plan_view(runs, rows, fleet, out_dir) if trained else None)
    for figure in figures:
        if figure.path is not None:
            lines += [f"![{figure.path.stem}](plots/{figure.path.name})", "", f"*{figure.caption}*", ""]
        else:
            lines += [f"- {figure.caption}", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report


@dataclass
class PlanView:
    """What `edgetrain plan` said about the fleet, for the throughput and Pareto plots."""

    ideal_samples_per_s: float | None
    ideal_how: str
    front: list[dict] | None
    """The Pareto front (the plan JSON's `plans`); None: not computed (see `front_note`)."""
    front_note: str
    chosen: list[tuple[str, dict]]
    """(arm, its last plan record) for every arm the planner ran (hybrid arms)."""
    fleet_name: str = ""
    model: str = ""


def _plan_view(runs: list[RunData], rows: list[dict], fleet, out_dir: Path) -> PlanView:
    """The fleet's ideal throughput and, with a hybrid arm, the planner's Pareto front."""
    chosen = []
    for run in runs:
        plans = run.kind("plan")
        switched = [p for p in plans if p.get("switched")] or plans
        if switched and run.name not in {a for a, _ in chosen}:
            chosen.append((run.name, switched[-1]))
    trained = [run for run in runs if run.kind("train")]
    source = next((run for run in trained if run.kind("plan")), trained[0] if trained else runs[0])
    model = source.job.get("model") or source.summary.get("model")
    batch = (source.job.get("training") or {}).get("global_batch")
    pipeline = source.job.get("pipeline") or {}
    view = PlanView(ideal_samples_per_s=None, ideal_how="", front=None, front_note="", chosen=chosen,
                    model=model or "")
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        fleet_file = _fleet_file(runs, fleet, model or "", Path(scratch)) if model else None
        if fleet_file is None:
            view.front_note = "No Pareto front: the runs record no fleet (run them through `edgetrain experiment run`)."
        else:
            try:
                planned = plan_for_fleet(fleet_file, model=model, batch=batch, pareto=bool(chosen),
                                         stage_state=pipeline.get("stage_state"),
                                         replicate=pipeline.get("replicate", True))
            except RuntimeError as e:
                view.front_note = f"No Pareto front and no planned fleet ideal: {e}."
                logger.warning("[report] %s", e)
            else:
                view.fleet_name = planned.get("fleet", "")
                view.ideal_samples_per_s = planned.get("ideal_samples_per_s")
                view.ideal_how = (f"fleet ideal {view.ideal_samples_per_s:.1f} samples/s = Σ board speed × "
                                  f"{model}'s one-core samples/s on this machine "
                                  f"({planned.get('one_core_samples_per_s')}, measured by `edgetrain plan`)")
                if chosen:
                    view.front = planned.get("plans") or []
                else:
                    view.front_note = "No Pareto front: no arm ran the planner (no hybrid arm)."
    if view.ideal_samples_per_s is None:
        profiled = _profiled_ideal(trained)
        if profiled is not None:
            view.ideal_samples_per_s = profiled
            view.ideal_how = (f"fleet ideal {profiled:.1f} samples/s = Σ the boards' profiled samples/s "
                              "(their join profile; no fleet file)")
    return view
