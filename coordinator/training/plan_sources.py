"""Where the plan in force comes from: the job's `pipeline` section (`FixedPlan`), a plan file re-read
when it changes (`PlanFile`: re-plan by hand), or the hybrid planner (`LivePlans`: planned from the
live fleet, measured before it is committed (coordinator.planning.trials), and planned again when
the fleet changes enough, coordinator.planning.live). Whatever the source, the plan is an
`edgetrain.plan.Plan`, which coordinator.training.pipeline_round runs.
"""

from __future__ import annotations

import logging
import time
from itertools import takewhile
from pathlib import Path
from typing import Protocol

from coordinator.planning.inputs import (
    UNKNOWN_LINK_MBIT,
    board_from_record,
    measure_model_cost,
    train_flops_per_sample,
)
from coordinator.planning.live import MEASURED_FOR_STEPS, LivePlanner, PlanDecision
from coordinator.planning.local_members import LOCAL_JUDGED_AT, judge_local_updates
from coordinator.planning.trials import (
    EVIDENCE_STEPS,
    TRIAL_SHARE,
    WARMUP_STEPS,
    Trial,
    distinct,
    structure,
    worth_measuring,
)
from coordinator.training.pipeline_work import check_covers
from coordinator.training.rounds import Fleet, JobAborted, RoundContext
from edgetrain.config import ConfigError, load_plan
from edgetrain.plan import Plan, plan_to_dict

logger = logging.getLogger(__name__)

class PlanSource(Protocol):
    """Where the plan in force comes from."""

    def prepare(self) -> None:
        """Called before each attempt looks at the fleet (the planner may wait for measurements)."""

    def current(self, step: int, fleet: Fleet) -> Plan:
        """The plan for `step` on `fleet` (JobAborted when there is none and cannot be one)."""


class FixedPlan:
    """The plan written in the job's `pipeline` section."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def prepare(self) -> None:
        pass

    def current(self, step: int, fleet: Fleet) -> Plan:
        return self.plan


class PlanFile:
    """A plan file, read again whenever it changes (re-planning by hand); a plan that does not
    load or does not fit the model keeps the previous one in force."""

    def __init__(self, path: str, block_names: list[str]) -> None:
        self.path = Path(path)
        self.block_names = block_names
        self._cached: tuple[float, Plan] | None = None
        self._error = ""

    def prepare(self) -> None:
        pass

    def current(self, step: int, fleet: Fleet) -> Plan:
        try:
            mtime = self.path.stat().st_mtime
            if self._cached is None or self._cached[0] != mtime:
                fresh = load_plan(self.path)
                check_covers(fresh, self.block_names)
                self._cached = (mtime, fresh)
                logger.info("[Coordinator.Trainer] pipeline plan from %s: %s", self.path, fresh.describe())
        except (OSError, ValueError) as e:  # ConfigError is a ValueError
            if self._cached is None:
                raise JobAborted(f"pipeline plan {self.path}: {e}") from None
            if str(e) != self._error:  # read again next time: the file may be mid-write
                logger.error("[Coordinator.Trainer] pipeline plan %s refused (%s); keeping the previous plan",
                             self.path, e)
                self._error = str(e)
        return self._cached[1]


class LivePlans:
    """Hybrid mode: the planner's plan for the live fleet, planned again when the fleet changes
    enough (coordinator.planning.live); every decision is a `plan` record in metrics.jsonl."""

    def __init__(self, ctx: RoundContext) -> None:
        job = ctx.job
        self.ctx = ctx
        self.model_cost = measure_model_cost(job.model)
        self.planner = LivePlanner(job.planner, self.model_cost, job.training.global_batch,
                                   job.pipeline.stage_state, job.pipeline.sync_every, job.pipeline.replicate,
                                   staleness_bound=job.aggregation.staleness_bound,
                                   staleness_exponent=job.aggregation.staleness_exponent,
                                   local_batch=job.federated.local_batch)
        self.history: list[dict] = []
        """Every plan put in force (step, kind, predicted step seconds), for the run's summary."""
        self.trial: Trial | None = None
        """The measured comparison under way (coordinator.planning.trials), if any."""
        self.trial_seconds = 0.0
        """Training seconds every trial so far took."""
        self.in_force: Plan | None = None
        """The plan the last attempt ran (a trial's candidate while one runs)."""
        self._warmed_up = False
        """The first WARMUP_STEPS steps ran and the first trial began (switches are measured from then)."""
        self.evidence: dict[tuple, list[float]] = {}
        """Scored step seconds measured per plan structure (trial steps, steps in force), the
        most recent EVIDENCE_STEPS of each: what a later trial weighs a candidate by."""
        self._pooled_through = -1
        """The last step whose time is in `evidence`."""

    def prepare(self) -> None:
        if self.planner.current is None:
            self._wait_for_links()

    def current(self, step: int, fleet: Fleet) -> Plan:
        self.in_force = self._current(step, fleet)
        return self.in_force

    def _current(self, step: int, fleet: Fleet) -> Plan:
        for record in fleet.records.values():
            if record.out_of_memory:
                self._cap_memory(record)
        if self.trial is not None:
            self.trial.observe(self.ctx.step_seconds)
            plan = self.trial.plan_for(step)
            while plan is not None and (missing := self._missing(plan, fleet)):
                self.trial.skip(step, f"{', '.join(missing)} not ready at step {step}")
                logger.info("[Coordinator.Planner] step %d: trial candidate %s skipped: %s not ready", step,
                            plan.describe(), ", ".join(missing))
                plan = self.trial.plan_for(step)
            if plan is not None:
                if self.trial.plan_for(step - 1) is not plan:
                    self._put_in_force(step, plan, trial=True)
                return plan
            self._commit_trial(step)
        boards = [board_from_record(r, self.model_cost) for r in fleet.records.values() if r.ready and not r.quarantined]
        first = self._first_trial(step, fleet, boards)
        if first is not None:
            return first
        self._judge_local(step)
        measured = self._measured_step_s()
        if measured and self.planner.current is not None:
            self.planner.note_measured(self.planner.current, measured, step)
        self._pool_in_force()
        before = self.planner.current
        decision = self.planner.decide(step, boards, measured) if boards else None
        if decision is not None:
            self._record(step, decision)
            trial_steps = self.ctx.job.planner.trial_steps
            if decision.switched and trial_steps and self._warmed_up and self._links_known(fleet):
                candidates = [decision.plan]
                if self._may_trial():  # the best of each other kind too
                    candidates = distinct([decision.plan, *worth_measuring(decision.plan,
                                                                           self.planner.alternatives(step, boards))])
                # the plan in force, if it can still run, competes with every step it measured (in its
                # trials and in force)
                known = self.evidence.get(structure(before)) if before is not None else None
                incumbent = (before, known) if before is not None and known and self._runnable(before, fleet) \
                    else None
                if len(candidates) >= 2 or incumbent is not None:
                    self.trial = Trial(step, candidates, trial_steps, decision.reasons, incumbent, self.evidence)
                    logger.info("[Coordinator.Planner] step %d: measuring %s for %d step(s) each before committing%s",
                                step, " | ".join(p.describe() for p in candidates), trial_steps,
                                f" (against the plan in force, {self.trial.measured[-1].step_s():.3f} s/step)"
                                if incumbent else "")
                    return self.trial.plan_for(step)
        return self.planner.current or Plan(dp_share=1.0)  # nobody to plan for yet: DP waits for boards

    def _judge_local(self, step: int) -> None:
        """At LOCAL_JUDGED_AT steps of a plan in force with boards beside its steps: keep them only
        while what they add is worth what they cost the steps (measured, judge_local_updates)."""
        plan = self.planner.current
        if plan is None or not plan.local_boards or not self.history:
            return
        since = self.history[-1]["step"]
        steps = [(s, sec) for s, sec in self.ctx.step_seconds if s > since]
        if len(steps) not in LOCAL_JUDGED_AT:
            return
        verdict = judge_local_updates(steps, self.ctx.local_work, self.ctx.job.training.global_batch,
                                      self.ctx.aggregator.noise.value)
        if verdict is None:
            return
        self.ctx.metrics.write({"kind": "local_updates", "step": step, "boards": list(plan.local_boards),
                                "cost_s": round(verdict.cost_s, 4), "gain_s": round(verdict.gain_s, 4),
                                "efficiency": round(verdict.efficiency, 4),
                                "steps_with": verdict.touched, "steps_without": verdict.untouched,
                                "kept": verdict.pays})
        if verdict.pays:
            logger.info("[Coordinator.Planner] step %d: %s: kept", step, verdict.describe())
            return
        kept = self.planner.pause_local(step)
        self._record(step, PlanDecision(step, (f"{verdict.describe()}: none for {MEASURED_FOR_STEPS} steps",),
                                        kept, True, 0.0, None))

    def _first_trial(self, step: int, fleet: Fleet, boards: list) -> Plan | None:
        """Once WARMUP_STEPS steps ran (the first steps of a run are slower whatever the plan:
        they would condemn the candidate measured first) and every link is measured: the plan in
        force against the best plan of each other kind. Its first candidate, or None."""
        trial_steps = self.ctx.job.planner.trial_steps
        if (self._warmed_up or not trial_steps or self.planner.current is None
                or len(self.ctx.step_seconds) < WARMUP_STEPS or not self._links_known(fleet)):
            return None
        self._warmed_up = True
        current = self.planner.current
        candidates = distinct([current, *worth_measuring(current, self.planner.alternatives(step, boards))])
        if len(candidates) < 2:
            return None
        self.trial = Trial(step, candidates, trial_steps, (f"{WARMUP_STEPS} steps warmed up",))
        logger.info("[Coordinator.Planner] step %d: measuring %s for %d step(s) each before committing", step,
                    " | ".join(p.describe() for p in candidates), trial_steps)
        return self.trial.plan_for(step)

    @staticmethod
    def _links_known(fleet: Fleet) -> bool:
        """Whether every ready board has measured its link: a plan made with assumed links is put
        in force unmeasured (when the links arrive, the re-plan they cause is measured)."""
        return all(r.latest_telemetry and r.latest_telemetry.link_mbit_per_s
                   for r in fleet.records.values() if r.ready)

    def _may_trial(self) -> bool:
        """Whether a trial may run now: trials are on, and (after the first) those so far took at
        most TRIAL_SHARE of the training time."""
        if not self.ctx.job.planner.trial_steps:
            return False
        trained = sum(s for _, s in self.ctx.step_seconds)
        return not self.trial_seconds or self.trial_seconds <= TRIAL_SHARE * trained

    def _runnable(self, plan: Plan, fleet: Fleet) -> bool:
        """Every board the plan's steps need is ready."""
        return not self._missing(plan, fleet)

    @staticmethod
    def _missing(plan: Plan, fleet: Fleet) -> list[str]:
        """The boards the plan's steps need that are not ready (or quarantined)."""
        ready = {r.name for r in fleet.records.values() if r.ready and not r.quarantined}
        return sorted(({b for s in plan.stages for b in s.boards} | set(plan.dp_boards)) - ready)

    def _commit_trial(self, step: int) -> None:
        """The trial is over (or a candidate cannot run): the best measured candidate stays in force."""
        trial, self.trial = self.trial, None
        job = self.ctx.job
        phi = self.ctx.aggregator.noise.value
        scores = trial.scores(job.training.global_batch, phi)
        chosen = trial.best(job.training.global_batch, phi, job.planner.min_gain)
        plan = trial.measured[chosen].plan
        self.trial_seconds += trial.seconds()
        for m in trial.measured[:trial.runs]:
            self._pool(m.plan, [s for _, s in m.steps[1:]])
        self._pooled_through = max(self._pooled_through, step - 1)
        for m in trial.measured:
            if m.step_s() is not None:
                self.planner.note_measured(m.plan, m.step_s(), step)
        self.planner.adopt(plan)
        kept = PlanDecision(step, (f"measured: kept {scores[chosen]['plan']}",), plan, True,
                            scores[chosen]["score"] or 0.0, None)
        self.ctx.metrics.write(kept.to_record(job.pipeline.stage_state))  # the plan in force from here
        self.ctx.metrics.write({"kind": "plan_trial", "step": step, "started": trial.start_step,
                                "reasons": list(trial.reasons), "candidates": scores, "chosen": chosen,
                                "default": trial.default(),
                                "margin": None if trial.margin is None else round(trial.margin, 4),
                                "plan": plan_to_dict(plan), "plan_kind": plan.kind,
                                "local_boards": list(plan.local_boards), "left_out": dict(plan.left_out),
                                "noise_scale": None if phi is None else round(phi, 2),
                                "base_batch": job.training.global_batch,
                                "trial_s": round(trial.seconds(), 3), "trials_total_s": round(self.trial_seconds, 3)})
        lines = [f"  {'kept' if i == chosen else '    '} {s['plan']}: measured {s['measured_step_s']} s/step "
                 f"(predicted {s['predicted_step_s']}), efficiency {s['efficiency']}, score {s['score']}"
                 + (f"; skipped: {s['skipped']}" if s["skipped"] else "") for i, s in enumerate(scores)]
        logger.info("[Coordinator.Planner] step %d: measured %d plans (noise scale %s); keeping the best:\n%s",
                    step, len(scores), "unknown" if phi is None else f"{phi:.0f}", "\n".join(lines))
        self._put_in_force(step, plan, trial=False)

    def _pool(self, plan: Plan, times: list[float]) -> None:
        """Add scored step times of `plan` to its structure's evidence."""
        if times:
            pooled = self.evidence.setdefault(structure(plan), [])
            pooled.extend(times)
            del pooled[:-EVIDENCE_STEPS]

    def _pool_in_force(self) -> None:
        """Add the plan in force's scored steps not pooled yet (its first, the hand-over, left out;
        none before the first trial: the first steps of a run are slower whatever the plan)."""
        if not self._warmed_up or not self.history or self.planner.current is None:
            return
        since = max(self.history[-1]["step"], self._pooled_through)
        fresh = list(takewhile(lambda entry: entry[0] > since, reversed(self.ctx.step_seconds)))  # newest first
        if fresh:
            self._pool(self.planner.current, [sec for _, sec in reversed(fresh)])
            self._pooled_through = fresh[0][0]

    def _put_in_force(self, step: int, plan: Plan, *, trial: bool) -> None:
        """A plan starts running at `step` (its measured steps are those after)."""
        p = plan.prediction
        if self.history and self.history[-1]["step"] == step:
            self.history.pop()  # replaced before it ran a step
        self.history.append({"step": step, "kind": plan.kind, "trial": trial,
                             "predicted_step_s": p.step_s if p else None,
                             "predicted_samples_per_s": p.samples_per_s if p else None})

    def _cap_memory(self, record) -> None:
        """A board's device ran out of memory for its stage: from now on the planner counts on at
        most 90% of what the plan in force predicted that stage needs there (half its memory when
        there is no such prediction), so it plans without that placement."""
        plan = self.planner.current
        needed = plan.prediction.memory_bytes.get(record.name) if plan and plan.prediction else None
        had = board_from_record(record, self.model_cost).memory_bytes
        record.memory_cap_bytes, record.out_of_memory = int(0.9 * needed if needed else 0.5 * had), False
        self.ctx.registry.cap_memory(record.device_id, record.memory_cap_bytes)
        logger.warning("[Coordinator.Planner] %s ran out of device memory for its stage: planning with at most "
                       "%.0f MB for it (it had %.0f)", record.name, record.memory_cap_bytes / 1e6, had / 1e6)

    def work_fraction(self, first_block: int, end_block: int) -> float:
        """Blocks [first_block, end_block)'s share of the model's training work (what the planner
        costs them at): how a stage host's measured compute refines its whole-model speed."""
        blocks = self.model_cost.blocks[first_block:end_block]
        return sum(b.train_flops for b in blocks) / train_flops_per_sample(self.model_cost)

    def _record(self, step: int, decision) -> None:
        plan, job = decision.plan, self.ctx.job
        self.ctx.metrics.write(decision.to_record(job.pipeline.stage_state))
        logger.info("[Coordinator.Planner] step %d: %s -> %s\n%s", step, "; ".join(decision.reasons),
                    "new plan" if decision.switched else "plan kept (the new one is not "
                    f"{job.planner.min_gain:.0%} better)", plan.explain())
        entry = {"step": step, "kind": plan.kind, "predicted_step_s": plan.prediction.step_s,
                 "predicted_samples_per_s": plan.prediction.samples_per_s}
        if decision.switched or not self.history:
            self.history.append(entry)
        else:  # the same plan, predicted on today's fleet: its measured steps still count
            self.history[-1].update(entry, step=self.history[-1]["step"])

    def step_s(self) -> float | None:
        """The plan in force's step time: measured (median) once known, else predicted (None: no plan)."""
        plan = self.in_force or self.planner.current
        if plan is None or plan.prediction is None:
            return None
        return self._measured_step_s() or plan.prediction.step_s

    def _measured_step_s(self) -> float | None:
        """Median step time under the plan in force (its first step, carrying the hand-over, left
        out); None before 3 such steps."""
        if not self.history:
            return None
        since = self.history[-1]["step"]
        times = sorted(sec for st, sec in self.ctx.step_seconds if st > since)
        return times[len(times) // 2] if len(times) >= 3 else None

    def _wait_for_links(self) -> None:
        """Before the first plan: give every ready board up to link_wait_s to report its link."""
        deadline = time.monotonic() + self.ctx.job.planner.link_wait_s
        while time.monotonic() < deadline and not self.ctx.stop.is_set():
            if self._links_known(Fleet.snapshot(self.ctx.registry)):
                return
            self.ctx.stop.wait(0.2)
        logger.warning("[Coordinator.Planner] some boards have not measured their link yet; planning with "
                       "%.0f Mbit/s for them", UNKNOWN_LINK_MBIT)


def plan_source(ctx: RoundContext) -> PlanSource:
    """The job's plan source: the planner, a plan file, or its pipeline section."""
    if ctx.job.planner.enabled:
        return LivePlans(ctx)
    if ctx.job.pipeline.plan_file:
        return PlanFile(ctx.job.pipeline.plan_file, list(ctx.model.block_names))
    plan = ctx.job.pipeline.plan()
    try:
        check_covers(plan, ctx.model.block_names)
    except ValueError as e:
        raise ConfigError(f"pipeline.stages: {e}") from None
    return FixedPlan(plan)
