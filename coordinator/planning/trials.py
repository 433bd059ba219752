"""Measure, then commit: the planner's candidates run a few real training steps each, and the best
measured one stays in force.

A cost model misses what matters often enough (per-step overheads, codecs, a board's neighbours on
the same machine) that a plan is only as good as its measurement. After the first WARMUP_STEPS
steps (the plan in force against the others), and whenever the live planner puts a new plan in
force on a changed fleet, a `Trial` runs it and the
structurally different alternatives (coordinator.planning.planner.plan_alternatives: pure data
parallelism, pipeline stages, one board alone) predicted within TRIAL_SPREAD of its step time,
one after another for `steps` steps each. Trial steps are training steps: their updates count.
A candidate's first step carries the hand-over (owned stages placed, boards starting) and is not
scored; the others give its measured step time. The live planner remembers every measured
structure: a later candidate measured slower than the plan in force does not replace it.

Evidence accumulates: the live planner pools the scored step times of each structure (its trial
steps, and its steps while in force), and a candidate measured before competes with all of its
steps so far (`Measured.earlier`), not only this trial's few. A challenger that measured faster by
less than one trial's margin twice is then judged on twice the steps, so a consistent difference
wins where one noisy trial could not tell it.

Each candidate is scored by goodput, measured throughput x statistical efficiency (Pollux): its
samples per step M over its measured step time, times (phi + M0) / (phi + M), with phi the
gradient noise scale estimated in training (coordinator.training.noise_scale) and M0 the global
batch. M counts the step's own samples only: what boards beside the steps add arrives after a
trial's few steps, so it is not measured there, and counting their predicted samples made plans
with boards beside them win trials they measured slower in. The best score is committed when it
beats the trial's default (the plan in force when it competes with its earlier measurement, else
the data-parallel candidate over the most boards) by more than `min_gain` and TRIAL_CONFIDENCE
standard errors of the two measurements: a few steps of one plan scatter by tens of percent, and
a switch on noise costs the rest of the run.

A plan made while some board's link is not measured yet (planned with an assumed rate) goes in
force unmeasured: the re-plan its measured links cause is the one that is measured.
Alternatives are measured only while all trials so far took at most `TRIAL_SHARE` of the
training time (the first trial always measures them): repeated re-plans cannot turn a run into
trials. Beyond that a switch is still measured before it is committed: the new plan alone runs
its trial steps and is kept only if it scores better than the plan in force did (its measured
step time from before the trial).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from edgetrain.plan import Plan

TRIAL_SHARE = 0.05
"""Most of the training time that trials may take (measured so far, the trial itself included)."""

WARMUP_STEPS = 10
"""Steps a run trains before its first trial: its first steps are slower whatever the plan (the
boards' first passes, caches), and would condemn the candidate measured first."""

TRIAL_CONFIDENCE = 2.0
"""Standard errors by which a candidate must measure better than the trial's default to replace it."""

MIN_STEP_SPREAD = 0.1
"""Least relative spread of step times assumed for a trial's few steps (on the emulated fleet one
plan's steps scatter by 20-40%)."""

EVIDENCE_STEPS = 40
"""Most recent step times pooled per structure: older ones ran minutes ago, on a machine whose speed
drifts by minutes."""

TRIAL_SPREAD = 2.0
"""Alternatives predicted more than this many times slower a step than the planner's choice are
not measured."""


def efficiency(noise_scale: float | None, base_batch: float, batch: float) -> float:
    """Pollux's statistical efficiency of a batch of `batch` samples against `base_batch`:
    (phi + M0) / (phi + M); 1 when the noise scale is unknown."""
    if noise_scale is None or not math.isfinite(noise_scale) or batch <= 0:
        return 1.0
    phi = max(noise_scale, 0.0)
    return (phi + base_batch) / (phi + batch)


@dataclass
class Measured:
    """One candidate's trial."""

    plan: Plan
    steps: list[tuple[int, float]] = field(default_factory=list)
    """(step, seconds) of its steps in this trial (the first, the hand-over, included)."""
    earlier: list[float] = field(default_factory=list)
    """Scored step seconds of its structure measured before this trial (earlier trials; the plan in
    force's own steps)."""
    in_force: bool = False
    """The plan in force: it does not run in the trial and competes with its `earlier` steps."""
    skipped: str = ""
    """Why its turn ended before its steps ran ("" when it ran them)."""

    def times(self) -> list[float]:
        """Every scored step time it has: `earlier`, then this trial's steps after the hand-over."""
        return [*self.earlier, *(s for _, s in self.steps[1:])]

    def relative_error(self) -> float:
        """Standard error of its step time over the step time: its scored steps' spread (at least
        MIN_STEP_SPREAD, which a few steps can underrate) over the square root of their count."""
        times = self.times()
        if not times:
            return 0.0
        mean = statistics.fmean(times)
        spread = statistics.stdev(times) / mean if len(times) > 1 and mean > 0 else 0.0
        return max(spread, MIN_STEP_SPREAD) / math.sqrt(len(times))

    def step_s(self) -> float | None:
        """Median seconds of its scored steps (None: none yet)."""
        times = self.times()
        return statistics.median(times) if times else None


class Trial:
    """Candidates run one after another, `steps` scored steps each (plus a hand-over step)."""

    def __init__(self, start_step: int, candidates: Sequence[Plan], steps: int, reasons: Sequence[str] = (),
                 incumbent: tuple[Plan, Sequence[float]] | None = None,
                 evidence: Mapping[tuple, Sequence[float]] | None = None) -> None:
        """`incumbent`: the plan in force and its scored step times so far (it does not run again);
        `evidence`: structure -> scored step times measured before, which a candidate of that
        structure starts from (not given to one of the incumbent's structure: it is what differs
        from the plan in force, its split, that is measured then)."""
        if not candidates or steps < 1:
            raise ValueError("a trial needs at least one candidate and one step each")
        self.start_step = start_step
        self.per = steps + 1
        self.reasons = tuple(reasons)
        known = evidence or {}
        held = structure(incumbent[0]) if incumbent is not None else None
        self.measured = [Measured(p, earlier=[] if structure(p) == held else list(known.get(structure(p), ())))
                         for p in candidates]
        """The candidates that run, in order (then, if given, the plan in force, already measured)."""
        self.runs = len(self.measured)
        self.turns = [[start_step + self.per * i, start_step + self.per * (i + 1)] for i in range(self.runs)]
        """Each candidate's turn, [first step, first step after it) (moved up when one before it
        is skipped)."""
        self.margin: float | None = None
        """By how much (a fraction) the best score had to beat the default's at the last `best`
        (None: the best was the default)."""
        if incumbent is not None:
            self.measured.append(Measured(incumbent[0], earlier=list(incumbent[1]), in_force=True))

    @property
    def end_step(self) -> int:
        """The first step after the trial."""
        return self.turns[-1][1]

    def _turn(self, step: int) -> int | None:
        """Index of the candidate whose turn holds `step` (None: before or after the trial)."""
        return next((i for i, (first, end) in enumerate(self.turns) if first <= step < end), None)

    def plan_for(self, step: int) -> Plan | None:
        """The candidate that runs `step`, or None once the trial is over."""
        i = self._turn(step)
        return None if i is None else self.measured[i].plan

    def skip(self, step: int, why: str) -> None:
        """End the turn that holds `step` now (a board it needs cannot run it): the candidates
        after it move up, so the next one runs `step`."""
        i = self._turn(step)
        if i is None:
            return
        self.measured[i].skipped = why
        shift = self.turns[i][1] - step
        self.turns[i][1] = step
        for turn in self.turns[i + 1:]:
            turn[0] -= shift
            turn[1] -= shift

    def observe(self, step_seconds: Sequence[tuple[int, float]]) -> None:
        """Take each candidate's steps from the run's (step, seconds)."""
        for m in self.measured[:self.runs]:
            m.steps = []
        for step, seconds in step_seconds:
            i = self._turn(step)
            if i is not None:
                self.measured[i].steps.append((step, seconds))

    def seconds(self) -> float:
        """Training seconds the trial took so far."""
        return sum(s for m in self.measured for _, s in m.steps)

    def scores(self, global_batch: int, noise_scale: float | None) -> list[dict]:
        """Each candidate's evidence and goodput score (None: it was not measured)."""
        out = []
        for m in self.measured:
            p = m.plan.prediction
            step_s = m.step_s()
            batch = float(global_batch)  # local updates land after the trial: their samples are not measured in it
            eff = efficiency(noise_scale, global_batch, batch)
            out.append({"plan": m.plan.describe(), "kind": m.plan.kind, "in_force_before": m.in_force,
                        "boards": sorted({b for s in m.plan.stages for b in s.boards} | set(m.plan.dp_boards)),
                        "local_boards": list(m.plan.local_boards),
                        "steps": [s for s, _ in m.steps], "earlier_steps": len(m.earlier),
                        "skipped": m.skipped, "measured_step_s": _round(step_s),
                        "predicted_step_s": _round(p.step_s if p else None),
                        "samples_per_step": round(batch, 2),
                        "measured_samples_per_s": _round(batch / step_s if step_s else None),
                        "efficiency": round(eff, 4),
                        # a skipped candidate's boards were not ready: what it measured before cannot put it in force
                        "score": _round(batch / step_s * eff if step_s and not m.skipped else None)})
        return out

    def best(self, global_batch: int, noise_scale: float | None, min_gain: float = 0.0) -> int:
        """Index of the candidate to keep: the best score, unless it is not `min_gain` and
        TRIAL_CONFIDENCE standard errors of the two measurements better than the default's
        (`default`); the first candidate when none was measured."""
        scores = self.scores(global_batch, noise_scale)
        scored = [(s["score"], -i) for i, s in enumerate(scores) if s["score"] is not None]
        if not scored:
            return 0
        best = -max(scored)[1]
        default = self.default()
        self.margin = None
        if best == default or scores[default]["score"] is None:
            return best
        self.margin = max(min_gain, TRIAL_CONFIDENCE * math.hypot(self.measured[best].relative_error(),
                                                                  self.measured[default].relative_error()))
        return best if scores[best]["score"] > (1 + self.margin) * scores[default]["score"] else default

    def default(self) -> int:
        """The candidate kept unless another measures clearly better: the plan in force when it
        competes with what it measured before, else the data-parallel candidate over the most boards
        (what users of data parallelism run; it keeps no state on boards, so the syncs that stage
        hosts pay at evaluations and checkpoints, which a trial does not see, cost it nothing),
        else the first."""
        if self.measured[-1].in_force:
            return len(self.measured) - 1
        pure = [i for i, m in enumerate(self.measured) if not m.plan.stages and m.plan.dp_boards]
        return max(pure, key=lambda i: len(self.measured[i].plan.dp_boards)) if pure else 0


def worth_measuring(best: Plan, others: Sequence[Plan]) -> list[Plan]:
    """The plans of `others` predicted within TRIAL_SPREAD of `best`'s step time (the cost model
    errs by tens of percent, not by factors: measuring a plan predicted twice as slow wastes the
    trial)."""
    if best.prediction is None:
        return []
    return [p for p in others if p.prediction is not None and p.prediction.step_s <= TRIAL_SPREAD * best.prediction.step_s]


def structure(plan: Plan) -> tuple:
    """What makes two plans structurally different: which boards work in the steps and how (the
    order DP shards are listed in is not a difference)."""
    return (tuple((s.begin, s.end, s.boards, s.split) for s in plan.stages), tuple(sorted(plan.dp_boards)),
            plan.kind)


def distinct(plans: Sequence[Plan]) -> list[Plan]:
    """`plans` without repeated structures (the first of each kept)."""
    seen, out = set(), []
    for p in plans:
        key = structure(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
