"""An experiment file: arms (a job plus overrides, a baseline, or a multi-job trace), repeats or
seeds, and one stop rule, loaded and checked before anything runs.

```yaml
name: hybrid-vs-baselines-smoke        # results go to results/<name>/
job: ../edgetrain/presets/demo.yaml    # a job file (relative to this file) or an inline mapping
fleet: fleets/compute.yaml             # a fleet file (relative to this file); --fleet replaces it
set: {training.global_batch: 64}       # overrides for every arm (the dotted keys of --set)
stop: {target_accuracy: 0.70, time_cap_s: 900}   # or {steps: N} or {wall_s: S}; target_accuracy:
                                       # calibrated takes the dataset's (edgetrain.catalog)
repeats: 1                             # or seeds: [0, 1, 2] (one repeat per seed)
arms:
  - {name: ddp, baseline: ddp}
  - {name: proportional, set: {training.split: proportional}}
  - {name: hybrid, set: {planner.enabled: true}}
  - {name: rolling, trace: {jobs: traces/lab.yaml, scheduler: rolling}}
```

Every arm's job is built the same way: the job (file or mapping), `training.min_clients` set to
the fleet's board count (every arm trains on the whole fleet unless it says otherwise), the
experiment's `set`, the arm's `set`, then the stop rule and the seed (``StopRule.job_overrides``),
and the run's name. Each is checked with ``edgetrain.config.job_from_dict``; an error names the
experiment file, the key and the value, and nothing runs.

A trace file (a trace arm's `jobs`) lists jobs submitted to a job server at their arrival times:

```yaml
jobs:
  - {at_s: 0, job: ../../edgetrain/presets/jobs/mobilenet-two-boards.yaml}
  - {at_s: 20, job: {name: small, model: small_cnn, training: {steps: 40}}, set: {training.global_batch: 32}}
```
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgetrain.config import ConfigError, apply_overrides, job_from_dict, job_to_dict

BASELINE_KINDS = ("ddp", "single", "centralized")
"""The baselines of edgetrain.experiment.baselines (its BASELINES), named here so an experiment
file is checked without importing torch or the baselines."""
TRACE_SCHEDULERS = ("rolling", "fifo", "first_fit", "static")
"""The job server's schedulers (`edgetrain coordinator --jobs --scheduler`)."""
UNBOUNDED_STEPS = 1_000_000
"""`training.steps` under a wall-time or target-accuracy stop rule that gives no `steps`: the
time or the accuracy ends the run, not the step count."""

_KEYS = ("name", "job", "fleet", "set", "stop", "repeats", "seeds", "arms")
_ARM_KEYS = ("name", "set", "baseline", "trace")
_STOP_FORMS = "{steps: N}, {wall_s: S} or {target_accuracy: A, time_cap_s: S} (wall_s and target rules may add steps: N)"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SpecError(ConfigError):
    """An experiment (or trace) file that cannot be run; the message names the file, the key and
    the value. A ConfigError, so the CLI reports it in one line with exit code 2."""


@dataclass(kw_only=True, frozen=True)
class StopRule:
    """When every arm's run ends: after `steps`, after `wall_s` of training, or at the first
    evaluation reaching `target_accuracy` (or after `time_cap_s` of training without it)."""

    steps: int | None = None
    """Optimizer steps (alone: the rule; with wall_s or a target: the most, and the length of the
    learning-rate schedule)."""
    wall_s: float | None = None
    """Seconds of training (the job's training.time_limit_s)."""
    target_accuracy: float | None = None
    """Test accuracy that ends the run at the evaluation reaching it."""
    time_cap_s: float | None = None
    """With target_accuracy: give up after this many seconds of training."""

    def job_overrides(self) -> dict[str, Any]:
        """The dotted job keys this rule sets (applied after every arm's own overrides)."""
        out: dict[str, Any] = {"training.epochs": 0.0}
        if self.target_accuracy is not None:
            out.update({"training.target_accuracy": self.target_accuracy,
                        "training.time_limit_s": self.time_cap_s,
                        "training.steps": self.steps or UNBOUNDED_STEPS})
        elif self.wall_s is not None:
            out.update({"training.time_limit_s": self.wall_s, "training.steps": self.steps or UNBOUNDED_STEPS,
                        "training.target_accuracy": 0.0})
        else:
            out.update({"training.steps": self.steps, "training.target_accuracy": 0.0})
        return out

    @property
    def cap_s(self) -> float | None:
        """The most training time the rule allows (None: bounded by steps only)."""
        return self.time_cap_s if self.target_accuracy is not None else self.wall_s

    def to_dict(self) -> dict[str, Any]:
        """The rule as written (what arm.json records under "stop")."""
        return {k: v for k, v in (("steps", self.steps), ("wall_s", self.wall_s),
                                  ("target_accuracy", self.target_accuracy),
                                  ("time_cap_s", self.time_cap_s)) if v is not None}


@dataclass(kw_only=True, frozen=True)
class TraceJob:
    """One job of a trace: submitted `at_s` seconds after the boards joined."""

    at_s: float
    job: dict
    """The full job mapping (as edgetrain.config.job_to_dict gives it), name and length written."""


@dataclass(kw_only=True, frozen=True)
class Trace:
    """A trace arm: these jobs on a job server with this scheduler."""

    file: Path
    scheduler: str
    jobs: tuple[TraceJob, ...]


@dataclass(kw_only=True, frozen=True)
class Arm:
    """One arm: EdgeTrain with overrides, a baseline, or a trace of jobs."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted job keys for this arm (after the experiment's own `set`)."""
    baseline: str | None = None
    """None (EdgeTrain), or one of BASELINE_KINDS."""
    trace: Trace | None = None

    @property
    def kind(self) -> str:
        return "trace" if self.trace else ("baseline" if self.baseline else "edgetrain")


@dataclass(kw_only=True, frozen=True)
class Run:
    """One run of an arm: its repeat index, its seed and the job it trains (a checked mapping)."""

    arm: Arm
    repeat: int
    seed: int
    job: dict | None
    """None for a trace arm (its jobs are in arm.trace)."""

    @property
    def name(self) -> str:
        """The run directory's name under the experiment's results: <arm>-r<repeat>."""
        return f"{self.arm.name}-r{self.repeat}"


@dataclass(kw_only=True, frozen=True)
class Experiment:
    """A loaded, checked experiment file."""

    name: str
    source: Path
    fleet_file: Path | None
    """The fleet file it names (None when it names none: --fleet or --live must)."""
    stop: StopRule | None
    """None only when every arm is a trace (its jobs say how long they train)."""
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    """One repeat per seed."""
    base_job: dict | None
    """The job mapping with the experiment's `set` applied (None when every arm is a trace)."""

    def runs(self, arm_names: list[str] | None = None, *, boards: int) -> list[Run]:
        """Every (arm, seed) run, in file order, for a fleet of `boards` boards; `arm_names` keeps
        only those arms (SpecError naming an unknown one)."""
        known = [a.name for a in self.arms]
        for name in arm_names or []:
            if name not in known:
                raise SpecError(f"{self.source}: --arms: no arm {name!r} (arms: {', '.join(known)})")
        arms = [a for a in self.arms if not arm_names or a.name in arm_names]
        return [Run(arm=arm, repeat=k, seed=seed, job=None if arm.trace else self.arm_job(arm, k, seed, boards=boards))
                for arm in arms for k, seed in enumerate(self.seeds)]

    def arm_job(self, arm: Arm, repeat: int, seed: int, *, boards: int) -> dict:
        """The checked job mapping of `arm`'s repeat `repeat` (see the module docstring for the
        order in which it is built)."""
        data = apply_overrides(copy.deepcopy(self.base_job), {"training.min_clients": boards})
        data = _apply(data, arm.overrides, f"{self.source}: arms: {arm.name}: set")
        final = {**(self.stop.job_overrides() if self.stop else {}), "seed": seed, "name": f"{arm.name}-r{repeat}"}
        data = _apply(data, final, f"{self.source}: stop")
        try:
            return job_to_dict(job_from_dict(data, source=f"{self.source}: arms: {arm.name}: job"))
        except ConfigError as e:
            raise SpecError(str(e)) from None


def _apply(data: dict, overrides: dict[str, Any], where: str) -> dict:
    try:
        return apply_overrides(copy.deepcopy(data), overrides)
    except ConfigError as e:
        raise SpecError(f"{where}: {e}") from None


def _read_yaml(path: Path, what: str) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: {what} not found") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _overrides(value: Any, where: str) -> dict[str, Any]:
    """A `set` mapping of dotted job keys (nested mappings are flattened, so `{training: {steps:
    5}}` and `{training.steps: 5}` say the same)."""
    out: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, val in node.items():
            if not isinstance(key, str) or not key:
                raise SpecError(f"{where}: key {key!r}: expected a dotted job key such as training.steps")
            dotted = f"{prefix}{key}"
            if isinstance(val, dict) and val:
                walk(val, dotted + ".")
            else:
                out[dotted] = val

    walk(_mapping(value, where), "")
    return out


def _number(value: Any, where: str, *, positive: bool = True, integer: bool = False) -> float | int:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (positive and value <= 0):
        want = "an integer" if integer else "a number"
        raise SpecError(f"{where}: expected {want}{' > 0' if positive else ''}, got {value!r}")
    return value


def calibrated_target(dataset: str, where: str) -> float:
    """The target accuracy fixed by `dataset`'s calibration: edgetrain.catalog's
    <DATASET>_TARGET (e.g. SYNTHETIC_HARD_TARGET for synthetic-hard)."""
    from edgetrain import catalog

    constant = f"{dataset.upper().replace('-', '_')}_TARGET"
    target = getattr(catalog, constant, None)
    if not isinstance(target, float):
        raise SpecError(f"{where}.target_accuracy: calibrated: dataset {dataset!r} has no calibrated target "
                        f"(edgetrain.catalog.{constant}); give a number")
    return target


def parse_stop(value: Any, where: str, *, dataset: str | None = None) -> StopRule:
    """The stop rule mapping at `where` (SpecError naming the key and value otherwise);
    `target_accuracy: calibrated` takes `dataset`'s calibrated target."""
    data = _mapping(value, where)
    if data.get("target_accuracy") == "calibrated":
        data = {**data, "target_accuracy": calibrated_target(str(dataset), where)}
    unknown = sorted(set(data) - {"steps", "wall_s", "target_accuracy", "time_cap_s"})
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}; a stop rule is {_STOP_FORMS}")
    steps = int(_number(data["steps"], f"{where}.steps", integer=True)) if "steps" in data else None
    if "target_accuracy" in data:
        target = data["target_accuracy"]
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
            raise SpecError(f"{where}.target_accuracy: expected a number in (0, 1], got {target!r}")
        if "time_cap_s" not in data:
            raise SpecError(f"{where}: target_accuracy={target!r} needs time_cap_s (a run that never reaches "
                            "the target must end)")
        if "wall_s" in data:
            raise SpecError(f"{where}: wall_s={data['wall_s']!r}: give either wall_s or target_accuracy with "
                            "time_cap_s, not both")
        return StopRule(steps=steps, target_accuracy=float(target),
                        time_cap_s=float(_number(data["time_cap_s"], f"{where}.time_cap_s")))
    if "time_cap_s" in data:
        raise SpecError(f"{where}: time_cap_s={data['time_cap_s']!r} is the cap of a target_accuracy rule; "
                        "alone, use wall_s")
    if "wall_s" in data:
        return StopRule(steps=steps, wall_s=float(_number(data["wall_s"], f"{where}.wall_s")))
    if steps is None:
        raise SpecError(f"{where}: empty; a stop rule is {_STOP_FORMS}")
    return StopRule(steps=steps)


def _seeds(data: dict, base_seed: int, where: str) -> tuple[int, ...]:
    if "seeds" in data and "repeats" in data:
        raise SpecError(f"{where}: repeats={data['repeats']!r}: give repeats or seeds, not both")
    if "seeds" in data:
        seeds = data["seeds"]
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
            raise SpecError(f"{where}: seeds: expected a non-empty list of integers >= 0, got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise SpecError(f"{where}: seeds: {seeds!r} repeats a seed")
        return tuple(seeds)
    repeats = int(_number(data.get("repeats", 1), f"{where}: repeats", integer=True))
    return tuple(base_seed + k for k in range(repeats))


def _job(value: Any, source: Path) -> dict:
    where = f"{source}: job"
    if isinstance(value, str):
        path = source.parent / value
        data = _read_yaml(path, "job file")
        return dict(_mapping(data if data is not None else {}, str(path)))
    if isinstance(value, dict):
        return copy.deepcopy(value)
    raise SpecError(f"{where}: expected a job file (relative to the experiment) or a mapping, got {value!r}")


def load_trace(path: Path, scheduler: str, where: str) -> Trace:
    """A trace file's jobs, each checked as a job the server would accept."""
    data = _mapping(_read_yaml(path, "trace file"), str(path))
    unknown = sorted(set(data) - {"jobs"})
    if unknown:
        raise SpecError(f"{path}: unknown key {unknown[0]!r} (known: jobs)")
    entries = data.get("jobs")
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{path}: jobs: expected a non-empty list of {{at_s, job, set}}")
    jobs, names = [], set()
    for i, entry in enumerate(entries):
        at = f"{path}: jobs[{i}]"
        entry = _mapping(entry, at)
        unknown = sorted(set(entry) - {"at_s", "job", "set"})
        if unknown:
            raise SpecError(f"{at}: unknown key {unknown[0]!r} (known: at_s, job, set)")
        at_s = float(_number(entry.get("at_s", 0.0), f"{at}.at_s", positive=False))
        if at_s < 0:
            raise SpecError(f"{at}.at_s: expected a number >= 0, got {at_s!r}")
        if "job" not in entry:
            raise SpecError(f"{at}: missing key 'job' (a job file relative to the trace, or a mapping)")
        job = _job(entry["job"], path)
        job = _apply(job, _overrides(entry.get("set", {}), f"{at}.set"), f"{at}.set")
        training = job.get("training") if isinstance(job.get("training"), dict) else {}
        missing = [k for k in ("name", "model") if not job.get(k)] + (
            [] if training.get("steps") or training.get("epochs") else ["training.steps"])
        if missing:
            raise SpecError(f"{at}: the job does not say its {missing[0]}; a trace job writes its name, model "
                            "and length itself (the job server refuses defaults)")
        try:
            checked = job_to_dict(job_from_dict(job, source=f"{at}: job"))
        except ConfigError as e:
            raise SpecError(str(e)) from None
        if checked["name"] in names:
            raise SpecError(f"{at}: name {checked['name']!r} is used by an earlier job of the trace")
        names.add(checked["name"])
        jobs.append(TraceJob(at_s=at_s, job=checked))
    return Trace(file=path, scheduler=scheduler, jobs=tuple(sorted(jobs, key=lambda j: j.at_s)))


def _arm(entry: Any, index: int, source: Path) -> Arm:
    where = f"{source}: arms[{index}]"
    entry = _mapping(entry, where)
    unknown = sorted(set(entry) - set(_ARM_KEYS))
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(_ARM_KEYS)})")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(f"{where}.name: expected a name of letters, digits, '.', '_' or '-', got {name!r}")
    where = f"{source}: arms: {name}"
    baseline = entry.get("baseline")
    if baseline is not None and baseline not in BASELINE_KINDS:
        raise SpecError(f"{where}: baseline={baseline!r}: must be one of {', '.join(BASELINE_KINDS)}")
    trace = None
    if "trace" in entry:
        if baseline is not None:
            raise SpecError(f"{where}: trace: an arm is a trace or a baseline, not both")
        spec = _mapping(entry["trace"], f"{where}: trace")
        unknown = sorted(set(spec) - {"jobs", "scheduler"})
        if unknown:
            raise SpecError(f"{where}: trace: unknown key {unknown[0]!r} (known: jobs, scheduler)")
        scheduler = spec.get("scheduler", "rolling")
        if scheduler not in TRACE_SCHEDULERS:
            raise SpecError(f"{where}: trace.scheduler={scheduler!r}: must be one of {', '.join(TRACE_SCHEDULERS)}")
        if not isinstance(spec.get("jobs"), str):
            raise SpecError(f"{where}: trace.jobs: expected a trace file (relative to the experiment), "
                            f"got {spec.get('jobs')!r}")
        trace = load_trace(source.parent / spec["jobs"], scheduler, f"{where}: trace")
        if "set" in entry:
            raise SpecError(f"{where}: set: a trace arm's jobs take their settings from the trace file")
    return Arm(name=name, overrides=_overrides(entry.get("set", {}), f"{where}: set"), baseline=baseline, trace=trace)


def load_experiment(path: str | Path, *, boards: int | None = None) -> Experiment:
    """Load and check an experiment file. With `boards` (the fleet's board count) every arm's job
    is built and checked too (``Experiment.runs`` builds them again for the run)."""
    source = Path(path)
    data = _mapping(_read_yaml(source, "experiment file"), str(source))
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise SpecError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    name = data.get("name", source.stem)
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(f"{source}: name: expected a name of letters, digits, '.', '_' or '-', got {name!r}")
    entries = data.get("arms")
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{source}: arms: expected a non-empty list of arms, got {entries!r}")
    arms = [_arm(entry, i, source) for i, entry in enumerate(entries)]
    seen: set[str] = set()
    for arm in arms:
        if arm.name in seen:
            raise SpecError(f"{source}: arms: name {arm.name!r} is used twice")
        seen.add(arm.name)
    all_traces = all(a.trace for a in arms)
    base_job = None
    if not all_traces:
        if "job" not in data:
            raise SpecError(f"{source}: missing key 'job' (a job file relative to this file, or a mapping)")
        base_job = _apply(_job(data["job"], source), _overrides(data.get("set", {}), f"{source}: set"),
                          f"{source}: set")
    elif "job" in data or "set" in data:
        key = "job" if "job" in data else "set"
        raise SpecError(f"{source}: {key}: every arm is a trace, whose jobs come from its trace file")
    if "stop" in data:
        dataset = (base_job or {}).get("dataset")
        dataset = dataset.get("name", "synthetic") if isinstance(dataset, dict) else "synthetic"
        stop = parse_stop(data["stop"], f"{source}: stop", dataset=dataset)
    elif all_traces:
        stop = None
    else:
        raise SpecError(f"{source}: missing key 'stop'; a stop rule is {_STOP_FORMS}")
    fleet = data.get("fleet")
    if fleet is not None and not isinstance(fleet, str):
        raise SpecError(f"{source}: fleet: expected a fleet file relative to this file, got {fleet!r}")
    base_seed = (base_job or {}).get("seed", 0)
    base_seed = base_seed if isinstance(base_seed, int) and not isinstance(base_seed, bool) else 0
    experiment = Experiment(name=name, source=source, fleet_file=source.parent / fleet if fleet else None,
                            stop=stop, arms=tuple(arms), seeds=_seeds(data, base_seed, str(source)), base_job=base_job)
    if boards is not None:
        experiment.runs(boards=boards)
    return experiment
