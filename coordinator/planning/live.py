"""Live re-planning: when the fleet changes enough, plan again, and switch if it pays.

Pure logic over `BoardCost`s (the trainer builds them from the registry each step; see
coordinator.planning.inputs). A re-plan is considered when
- a board joined or left (or was quarantined),
- a board's measured link rate moved by more than `bandwidth_change` (a fraction) from the
  rate the current plan was made with, and that moves what it transfers in a step by at least
  LINK_SHARE of the plan's step time (fast links measured under load wander a lot for nothing),
  at LINK_CONFIRM_DECISIONS decisions in a row (a rate read while a board's CPU was busy with its
  step swings by 10x and back; a link that really changed stays changed, and every switch costs
  the steps that hand the plan over),
- a board's battery crossed `battery_floor` while unplugged, or its plug changed,
- the plan in force measures a step more than `overrun` (a fraction) over its prediction, once
  per plan: what the planner was told about the boards was wrong (a join-time profile taken
  while the machine was busy, say). By then the boards' speeds have been refined from the
  steps they ran (a stage host's from its stage's compute: coordinator.registry), so the
  re-plan sees them as they are. A candidate that is the plan in force keeps it: comparing its
  prediction with its own measurement says nothing.
Every plan is taken as its steps run: DP shards predicted to take less than one sample a step are
left out for no gain (coordinator.planning.local_members.without_empty_shards), so a candidate
measured before is recognised by the boards that work in it.
The new plan replaces the current one only when the current one cannot run (one of its boards
is gone or below the battery floor) or the new one is predicted at least `min_gain` better on
the changed fleet; otherwise the current plan stays (less any DP shard it now gives no work)
and the changed fleet becomes the new reference, so measurement noise around a threshold does
not make plans flip back and forth.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from coordinator.planning.cost import objective_cost, predict
from coordinator.planning.local_members import (
    add_local_members,
    without_empty_shards,
    without_local_members,
)
from coordinator.planning.planner import plan_alternatives, plan_optimal
from coordinator.planning.trials import structure
from edgetrain.config import PlannerConfig
from edgetrain.plan import NO_GAIN, BoardCost, ModelCost, Plan, plan_to_dict

logger = logging.getLogger(__name__)

MEASURED_FOR_STEPS = 500
"""How long a plan's measured step time keeps a slower-measured candidate from replacing it."""

LINK_SHARE = 0.05
"""A link rate change re-plans only when it moves the board's transfers by at least this share
of the plan's predicted step."""


LINK_CONFIRM_DECISIONS = 3
"""A link rate change re-plans once it held at this many decisions in a row (one per attempt)."""


@dataclass(frozen=True)
class PlanDecision:
    """What one re-planning did."""

    step: int
    reasons: tuple[str, ...]
    plan: Plan
    """The plan in force after the decision."""
    switched: bool
    """False: the current plan was kept (the new one was not worth the switch)."""
    candidate_cost: float
    current_cost: float | None
    """Objective of the current plan on the changed fleet (None: it could not run, or none)."""
    fleet: tuple[BoardCost, ...] = ()
    """The boards as the planner saw them."""

    def to_record(self, stage_state: str) -> dict:
        p = self.plan.prediction
        return {"kind": "plan", "step": self.step, "reasons": list(self.reasons), "switched": self.switched,
                "plan": plan_to_dict(self.plan), "plan_kind": self.plan.kind,
                "left_out": dict(self.plan.left_out), "local_boards": list(self.plan.local_boards),
                "predicted_local_samples_per_s": {b: round(v, 3) for b, v in p.local_samples_per_s.items()},
                "stage_state": stage_state,
                "predicted_step_s": round(p.step_s, 4), "predicted_samples_per_s": round(p.samples_per_s, 3),
                "predicted_energy_per_sample_j": round(p.energy_per_sample_j, 4),
                "candidate_cost": self.candidate_cost, "current_cost": self.current_cost,
                "fleet": {b.name: {"gflops": round(b.flops_per_s / 1e9, 3), "overhead_s": round(b.overhead_s, 4),
                                   "mbit_per_s": round(b.mbit_per_s, 2), "rtt_ms": round(b.rtt_s * 1000, 2),
                                   "battery_percent": b.battery_percent, "plugged": b.plugged}
                          for b in self.fleet}}


class LivePlanner:
    """The plan in force for one job, and when to change it."""

    def __init__(self, cfg: PlannerConfig, model: ModelCost, global_batch: int, stage_state: str = "hosts",
                 sync_every: int = 50, replicate: bool = True, *, staleness_bound: int = 2,
                 staleness_exponent: float = 0.5, local_batch: int = 16) -> None:
        self.cfg = cfg
        self.model = model
        self.global_batch = global_batch
        self.local = {"global_batch": global_batch, "staleness_bound": staleness_bound,
                      "staleness_exponent": staleness_exponent, "local_batch": local_batch,
                      "stage_state": stage_state}
        """How boards beside the steps are sized (the job's staleness rule and local batch)."""
        self.stage_options = {"stage_state": stage_state, "sync_every": sync_every, "replicate": replicate}
        """How stages keep their state (the job's pipeline section), for every plan and prediction."""
        self.current: Plan | None = None
        self.measured: dict[tuple, tuple[float, int]] = {}
        """Plan structure (coordinator.planning.trials.structure) -> its measured step seconds and
        the step they were measured at, from trials and from the plan in force as it runs, for
        MEASURED_FOR_STEPS steps and while no board joined or left: a candidate measured slower
        than the plan in force does not replace it, whatever its prediction."""
        self._reference: dict[str, BoardCost] = {}
        self._link_held: dict[str, int] = {}
        """Board -> decisions in a row its link rate has been changed enough from the reference."""
        self._overrun_checked = False
        """The plan in force was re-planned for running over its prediction (once per plan)."""
        self.local_paused_until = -1
        """No boards beside the steps before this step: their updates measured a loss
        (coordinator.planning.local_members.judge_local_updates)."""

    def decide(self, step: int, boards: Sequence[BoardCost], measured_step_s: float | None = None) -> PlanDecision | None:
        """Re-plan if the fleet changed enough since the reference (None: nothing to do).

        `measured_step_s`: the current plan's measured (median) step time so far, if known. A
        current plan that runs faster than predicted is then judged by what it did, scaled by
        how much the fleet change moves its prediction; the candidate has only its prediction.
        This keeps a plan the cost model underrates from being swapped for one it rates about the
        same. One that runs slower than predicted is judged by its prediction, as the candidate
        is: the model's optimism is the candidate's too, and judged by its measurement the plan
        would lose to every candidate the model rates within its error (docs/benchmarks.md#dp)."""
        reasons = self.changes(boards)
        if any(r.endswith((" joined", " left")) for r in reasons):  # measured with other boards
            self.measured.clear()
        self.measured = {k: v for k, v in self.measured.items() if step - v[1] <= MEASURED_FOR_STEPS}
        overrun = self.overrun(measured_step_s)
        if overrun:
            reasons.append(overrun)
            self._overrun_checked = True
        if not reasons:
            return None
        if self.current is not None:  # judged and kept as the planner made it; boards beside it are added after
            self.current = without_local_members(self.current)
        candidate = without_empty_shards(plan_optimal(list(boards), self.model, self.global_batch, self.cfg.weight,
                                                      battery_floor=self.cfg.battery_floor,
                                                      channel_groups=self.cfg.channel_groups, **self.stage_options),
                                         self.global_batch)
        cost = objective_cost(candidate.prediction, boards, self.cfg.weight)
        current_cost = None
        if self.current is not None and self._runnable(self.current, boards):
            now = predict(self.current, list(boards), self.model, self.global_batch, **self.stage_options)
            current_cost = objective_cost(now, boards, self.cfg.weight) if now.fits else None
            if measured_step_s and self.current.prediction is not None:
                # the measurement may keep the plan in force, never condemn it: a cost model that
                # under-predicts this plan under-predicts the candidates alike
                current_cost *= min(1.0, measured_step_s / self.current.prediction.step_s)
        switch = current_cost is None or cost < (1 - self.cfg.min_gain) * current_cost
        if switch and current_cost is not None and structure(candidate) == structure(self.current):
            switch = False  # the plan in force again: nothing to switch to
        if switch and current_cost is not None and self._measured_slower(candidate):
            switch = False  # measured, it was not faster: a prediction does not overrule a measurement
        active = () if switch else tuple(n for n in self.current.dp_boards if now.share.get(n, 0.0) > 0)
        if not switch and not self.current.stages and not active:
            switch = True  # a data-parallel plan that would give none of its boards work cannot be kept
        self._reference, self._link_held = {b.name: b for b in boards}, {}
        if switch:
            self.current, self._overrun_checked = candidate, False
        else:  # keep the plan, with its prediction on today's fleet (shards it gives no work are out)
            idle = tuple((n, NO_GAIN) for n in self.current.dp_boards if n not in active)
            kept = replace(self.current, dp_boards=active, dp_share=self.current.dp_share if active else 0.0,
                           left_out=self.current.left_out + idle)
            self.current = replace(kept, prediction=predict(kept, list(boards), self.model, self.global_batch,
                                                            **self.stage_options))
        if self.cfg.local_updates and step >= self.local_paused_until:
            self.current = add_local_members(self.current, boards, self.model, **self.local)
        return PlanDecision(step, tuple(reasons), self.current, switch, cost, current_cost, tuple(boards))

    def alternatives(self, step: int, boards: Sequence[BoardCost]) -> list[Plan]:
        """The best plan of each other kind on `boards` (coordinator.planning.planner.plan_alternatives),
        with boards beside their steps as the plan in force would have them."""
        plans = [without_empty_shards(p, self.global_batch)
                 for p in plan_alternatives(list(boards), self.model, self.global_batch, self.cfg.weight,
                                            battery_floor=self.cfg.battery_floor,
                                            channel_groups=self.cfg.channel_groups, **self.stage_options)]
        if self.cfg.local_updates and step >= self.local_paused_until:
            plans = [add_local_members(p, boards, self.model, **self.local) for p in plans]
        return plans

    def pause_local(self, step: int) -> Plan:
        """Boards beside the steps measured a loss: the plan in force without them, and none in any
        plan for MEASURED_FOR_STEPS steps (then they are measured again)."""
        self.local_paused_until = step + MEASURED_FOR_STEPS
        self.current = without_local_members(self.current)
        return self.current

    def note_measured(self, plan: Plan, step_s: float, step: int) -> None:
        """A plan of this structure measured `step_s` seconds a step (a trial, or the plan in force)."""
        self.measured[structure(plan)] = (step_s, step)

    def _measured_slower(self, candidate: Plan) -> bool:
        """Optimising time, the candidate's structure and the plan in force's were both measured,
        and the candidate's steps were not `min_gain` faster."""
        if self.cfg.objective != "time" or self.current is None:
            return False
        mine, theirs = self.measured.get(structure(self.current)), self.measured.get(structure(candidate))
        return bool(mine and theirs) and theirs[0] > (1 - self.cfg.min_gain) * mine[0]

    def adopt(self, plan: Plan) -> None:
        """Put `plan` in force (a measured trial chose it over the planner's prediction)."""
        self.current, self._overrun_checked = plan, False

    def changes(self, boards: Sequence[BoardCost]) -> list[str]:
        """Why the fleet differs from the reference enough to plan again (empty: it does not).
        Called once per decision: it counts how long each link change has held."""
        if self.current is None:
            return ["first plan"]
        ref, now = self._reference, {b.name: b for b in boards}
        out = [f"{n} joined" for n in sorted(set(now) - set(ref))]
        out += [f"{n} left" for n in sorted(set(ref) - set(now))]
        for name in sorted(set(now) & set(ref)):
            a, b = ref[name], now[name]
            change = abs(b.mbit_per_s - a.mbit_per_s) / a.mbit_per_s
            if change > self.cfg.bandwidth_change and self._link_matters(a, b):
                self._link_held[name] = self._link_held.get(name, 0) + 1
                if self._link_held[name] >= LINK_CONFIRM_DECISIONS:
                    out.append(f"{name} link {a.mbit_per_s:.1f} -> {b.mbit_per_s:.1f} Mbit/s")
            else:
                self._link_held.pop(name, None)
            if b.memory_bytes < 0.95 * a.memory_bytes:
                out.append(f"{name} memory {a.memory_bytes / 1e6:.0f} -> {b.memory_bytes / 1e6:.0f} MB")
            if self._low(a) != self._low(b):
                out.append(f"{name} battery {b.battery_percent:.0f}% "
                           f"{'plugged' if b.plugged else 'unplugged'}")
        return out

    def _link_matters(self, before: BoardCost, now: BoardCost) -> bool:
        """Whether a board's link rate change moves its transfers by LINK_SHARE of the plan's step
        or more: the most it moves in a step (the model down and up, or a stage's activations for
        the whole batch) at the old rate against the new. A fast link's rate, measured under
        load, wanders by more than bandwidth_change without changing any step."""
        plan = self.current
        if plan is None or plan.prediction is None:
            return True
        params = sum(b.param_bytes for b in self.model.blocks)
        activations = max((b.activation_bytes for b in self.model.blocks), default=0.0) * self.global_batch
        moved = 8 * max(2 * params, 2 * activations)
        shift = abs(moved / (before.mbit_per_s * 1e6) - moved / (now.mbit_per_s * 1e6))
        return shift >= LINK_SHARE * plan.prediction.step_s

    def overrun(self, measured_step_s: float | None) -> str:
        """Why the plan in force must be planned again for running over its prediction ("": it
        need not, or it already was)."""
        if self.current is None or self._overrun_checked or not measured_step_s or self.current.prediction is None:
            return ""
        predicted = self.current.prediction.step_s
        if measured_step_s <= (1 + self.cfg.overrun) * predicted:
            return ""
        return f"step {measured_step_s:.2f} s measured, {predicted:.2f} s predicted"

    def _low(self, b: BoardCost) -> bool:
        return b.battery_percent is not None and b.battery_percent < self.cfg.battery_floor and b.plugged is not True

    def _runnable(self, plan: Plan, boards: Sequence[BoardCost]) -> bool:
        by_name = {b.name: b for b in boards}
        used = [n for s in plan.stages for n in s.boards] + list(plan.dp_boards)
        return all(n in by_name and not self._low(by_name[n]) for n in used)
