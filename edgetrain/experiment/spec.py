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
  - {name: ddp, baseline: ddp, repeats: 1}   # an arm may run only the first seed(s): a costly baseline once
  - {name: proportional, set: {planner.enabled: false, training.split: proportional}}
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
from typing import Any, TypeVar

from edgetrain.config import (
    ConfigError,
    apply_overrides,
    from_mapping,
    job_from_dict,
    job_to_dict,
    load_yaml,
    require,
)

BASELINE_KINDS = ("ddp", "single", "centralized")
"""The baselines of edgetrain.experiment.baselines (its BASELINES), named here so an experiment
file is checked without importing torch or the baselines."""
TRACE_SCHEDULERS = ("rolling", "fifo", "first_fit", "static")
"""The job server's schedulers (`edgetrain coordinator --jobs --scheduler`)."""
UNBOUNDED_STEPS = 1_000_000
"""`training.steps` under a wall-time or target-accuracy stop rule that gives no `steps`: the
time or the accuracy ends the run, not the step count."""

_STOP_FORMS = "{steps: N}, {wall_s: S} or {target_accuracy: A, time_cap_s: S} (wall_s and target rules may add steps: N)"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_NAME_RULE = "must be a name of letters, digits, '.', '_' or '-'"
T = TypeVar("T")


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

    def __post_init__(self) -> None:
        for key in ("steps", "wall_s", "time_cap_s"):
            value = getattr(self, key)
            require(value is None or value > 0, key, value, "must be > 0")
        target = self.target_accuracy
        require(target is None or 0 < target <= 1, "target_accuracy", target, "must be in (0, 1]")
        require(target is None or self.time_cap_s is not None, "target_accuracy", target,
                "needs time_cap_s (a run that never reaches the target must end)")
        require(target is None or self.wall_s is None, "wall_s", self.wall_s,
                "give either wall_s or target_accuracy with time_cap_s, not both")
        require(target is not None or self.time_cap_s is None, "time_cap_s", self.time_cap_s,
                "is the cap of a target_accuracy rule; alone, use wall_s")
        if self.steps is None and self.wall_s is None and target is None:
            raise ConfigError(f"empty; a stop rule is {_STOP_FORMS}")

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
    repeats: int | None = None
    """The arm runs only the experiment's first `repeats` seeds (None: every seed)."""

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
        """Every (arm, seed) run for a fleet of `boards` boards, in rounds: the first seed of every
        arm in file order, then the second, ... (the emulation's speed drifts by minutes, so each
        round compares the arms at one time); `arm_names` keeps only those arms (SpecError naming
        an unknown one)."""
        known = [a.name for a in self.arms]
        for name in arm_names or []:
            if name not in known:
                raise SpecError(f"{self.source}: --arms: no arm {name!r} (arms: {', '.join(known)})")
        arms = [a for a in self.arms if not arm_names or a.name in arm_names]
        return [Run(arm=arm, repeat=k, seed=seed, job=None if arm.trace else self.arm_job(arm, k, seed, boards=boards))
                for k, seed in enumerate(self.seeds) for arm in arms if arm.repeats is None or k < arm.repeats]

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


@dataclass(kw_only=True, frozen=True)
class _TraceRef:
    """A trace arm's `trace` mapping."""

    jobs: str
    """The trace file, relative to the experiment file."""
    scheduler: str = "rolling"
    """The job server's scheduler (TRACE_SCHEDULERS)."""

    def __post_init__(self) -> None:
        require(self.scheduler in TRACE_SCHEDULERS, "scheduler", self.scheduler,
                f"must be one of {', '.join(TRACE_SCHEDULERS)}")


@dataclass(kw_only=True, frozen=True)
class _ArmEntry:
    """One entry of an experiment file's `arms`, as written."""

    name: str
    set: dict = field(default_factory=dict)
    """Overrides for this arm (dotted job keys, or nested sections)."""
    baseline: str | None = None
    trace: _TraceRef | None = None
    repeats: int | None = None
    """Run only the experiment's first `repeats` seeds."""

    def __post_init__(self) -> None:
        require(bool(_NAME.match(self.name)), "name", self.name, _NAME_RULE)
        require(self.repeats is None or self.repeats >= 1, "repeats", self.repeats, "must be >= 1")
        require(self.baseline is None or self.baseline in BASELINE_KINDS, "baseline", self.baseline,
                f"must be one of {', '.join(BASELINE_KINDS)}")
        require(self.trace is None or self.baseline is None, "baseline", self.baseline,
                "an arm is a trace or a baseline, not both")
        require(self.trace is None or not self.set, "set", self.set,
                "a trace arm's jobs take their settings from the trace file")


@dataclass(kw_only=True, frozen=True)
class _ExperimentFile:
    """An experiment file as written (see the module docstring)."""

    name: str | None = None
    """None: the file's stem."""
    job: str | dict | None = None
    fleet: str | None = None
    set: dict = field(default_factory=dict)
    stop: dict | None = None
    """Checked as a StopRule once the job's dataset is known (`target_accuracy: calibrated`)."""
    repeats: int | None = None
    seeds: list[int] | None = None
    arms: list
    """Each entry checked as an _ArmEntry under its name."""

    def __post_init__(self) -> None:
        require(self.name is None or bool(_NAME.match(self.name)), "name", self.name, _NAME_RULE)
        require(bool(self.arms), "arms", self.arms, "must be a non-empty list of arms")
        require(self.repeats is None or self.seeds is None, "repeats", self.repeats,
                "give repeats or seeds, not both")
        require(self.repeats is None or self.repeats >= 1, "repeats", self.repeats, "must be >= 1")
        require(self.seeds is None or (bool(self.seeds) and min(self.seeds) >= 0), "seeds", self.seeds,
                "must be a non-empty list of integers >= 0")
        require(self.seeds is None or len(set(self.seeds)) == len(self.seeds), "seeds", self.seeds,
                "repeats a seed")


@dataclass(kw_only=True, frozen=True)
class _TraceEntry:
    """One job of a trace file, as written."""

    at_s: float = 0.0
    job: str | dict
    """A job file relative to the trace file, or a job mapping."""
    set: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.at_s >= 0, "at_s", self.at_s, "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class _TraceFile:
    """A trace file as written."""

    jobs: list[_TraceEntry]

    def __post_init__(self) -> None:
        require(bool(self.jobs), "jobs", self.jobs, "must be a non-empty list of {at_s, job, set}")


def _checked(cls: type[T], data: Any, where: str) -> T:
    """``from_mapping`` raising SpecError."""
    try:
        return from_mapping(cls, data, where)
    except ConfigError as e:
        raise SpecError(str(e)) from None


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        return load_yaml(path, what=what)
    except ConfigError as e:
        raise SpecError(str(e)) from None


def _apply(data: dict, overrides: dict[str, Any], where: str) -> dict:
    try:
        return apply_overrides(copy.deepcopy(data), overrides)
    except ConfigError as e:
        raise SpecError(f"{where}: {e}") from None


def _overrides(value: dict, where: str) -> dict[str, Any]:
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

    walk(value, "")
    return out


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
    if isinstance(value, dict) and value.get("target_accuracy") == "calibrated":
        value = {**value, "target_accuracy": calibrated_target(str(dataset), where)}
    return _checked(StopRule, value, where)


def _job(value: str | dict, source: Path) -> dict:
    if isinstance(value, str):
        return dict(_read_yaml(source.parent / value, "job file"))
    return copy.deepcopy(value)


def load_trace(path: Path, scheduler: str, where: str) -> Trace:
    """A trace file's jobs, each checked as a job the server would accept."""
    entries = _checked(_TraceFile, _read_yaml(path, "trace file"), str(path)).jobs
    jobs, names = [], set()
    for i, entry in enumerate(entries):
        at = f"{path}: jobs[{i}]"
        job = _apply(_job(entry.job, path), _overrides(entry.set, f"{at}.set"), f"{at}.set")
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
        jobs.append(TraceJob(at_s=entry.at_s, job=checked))
    return Trace(file=path, scheduler=scheduler, jobs=tuple(sorted(jobs, key=lambda j: j.at_s)))


def _arm(entry: Any, index: int, source: Path) -> Arm:
    """Arm `index` of `source`, its errors named by the arm's name once it has a usable one."""
    name = entry.get("name") if isinstance(entry, dict) else None
    named = isinstance(name, str) and _NAME.match(name)
    where = f"{source}: arms: {name}" if named else f"{source}: arms[{index}]"
    arm = _checked(_ArmEntry, entry, where)
    trace = None
    if arm.trace is not None:
        trace = load_trace(source.parent / arm.trace.jobs, arm.trace.scheduler, f"{where}: trace")
    return Arm(name=arm.name, overrides=_overrides(arm.set, f"{where}: set"), baseline=arm.baseline, trace=trace,
               repeats=arm.repeats)


def _seeds(spec: _ExperimentFile, base_job: dict | None) -> tuple[int, ...]:
    """One seed per repeat: the file's seeds, or `repeats` seeds from the job's own seed on."""
    if spec.seeds is not None:
        return tuple(spec.seeds)
    base_seed = (base_job or {}).get("seed", 0)
    base_seed = base_seed if isinstance(base_seed, int) and not isinstance(base_seed, bool) else 0
    return tuple(base_seed + k for k in range(spec.repeats or 1))


def load_experiment(path: str | Path, *, boards: int | None = None) -> Experiment:
    """Load and check an experiment file. With `boards` (the fleet's board count) every arm's job
    is built and checked too (``Experiment.runs`` builds them again for the run)."""
    source = Path(path)
    spec = _checked(_ExperimentFile, _read_yaml(source, "experiment file"), str(source))
    name = spec.name if spec.name is not None else source.stem
    if not _NAME.match(name):
        raise SpecError(f"{source}: name={name!r} (the file's name): {_NAME_RULE}; give a name")
    arms = [_arm(entry, i, source) for i, entry in enumerate(spec.arms)]
    seen: set[str] = set()
    for arm in arms:
        if arm.name in seen:
            raise SpecError(f"{source}: arms: name {arm.name!r} is used twice")
        seen.add(arm.name)
    all_traces = all(a.trace for a in arms)
    base_job = None
    if not all_traces:
        if spec.job is None:
            raise SpecError(f"{source}: missing key 'job' (a job file relative to this file, or a mapping)")
        base_job = _apply(_job(spec.job, source), _overrides(spec.set, f"{source}: set"), f"{source}: set")
    elif spec.job is not None or spec.set:
        key = "job" if spec.job is not None else "set"
        raise SpecError(f"{source}: {key}: every arm is a trace, whose jobs come from its trace file")
    if spec.stop is not None:
        dataset = (base_job or {}).get("dataset")
        dataset = dataset.get("name", "synthetic") if isinstance(dataset, dict) else "synthetic"
        stop = parse_stop(spec.stop, f"{source}: stop", dataset=dataset)
    elif all_traces:
        stop = None
    else:
        raise SpecError(f"{source}: missing key 'stop'; a stop rule is {_STOP_FORMS}")
    experiment = Experiment(name=name, source=source, fleet_file=source.parent / spec.fleet if spec.fleet else None,
                            stop=stop, arms=tuple(arms), seeds=_seeds(spec, base_job), base_job=base_job)
    if boards is not None:
        experiment.runs(boards=boards)
    return experiment
