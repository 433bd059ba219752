"""Pipeline rounds: the plan in force, as pipeline stages and DP shards, all or nothing.

Where the plan comes from is a `PlanSource`: the job's own `pipeline` section (`FixedPlan`), a
plan file re-read when it changes (`PlanFile`: re-plan by hand), or the hybrid planner
(`LivePlans`: planned from the live fleet and planned again when it changes enough,
coordinator.planning.live). Whatever the source, the plan is an `edgetrain.plan.Plan`, which
`pipeline_work.assign` turns into each board's work.

Before an attempt, every board of the plan must be ready (the round waits for them, or for a new
plan without them), and stages whose host owns their state are placed on their hosts
(stage_owners). With `pipeline.replicate` the master keeps a replica of every owned stage: what
the attempt changes on each owner is pulled while it runs, and applied to the master when the
step commits. An attempt counts only if every host and shard answered (and, replicating, every
owner's changes arrived); a failed attempt is recorded (which board failed how) and redone after
the failed board had time to miss its heartbeats. A plan without stages is data parallelism over its boards (or every board).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from coordinator.planning.inputs import (
    UNKNOWN_LINK_MBIT,
    board_from_record,
    measure_model_cost,
    train_flops_per_sample,
)
from coordinator.planning.live import LivePlanner, PlanDecision
from coordinator.planning.local_members import local_work_size
from coordinator.planning.trials import (
    TRIAL_SHARE,
    WARMUP_STEPS,
    Trial,
    distinct,
    structure,
    worth_measuring,
)
from coordinator.training.data_parallel import DataParallelRound, OwnSamples
from coordinator.training.pipeline_work import (
    Host,
    assign,
    check_covers,
    merge_pipelines,
    missing_boards,
)
from coordinator.training.rounds import (
    Collected,
    Fleet,
    JobAborted,
    Round,
    RoundContext,
    RoundPolicy,
)
from coordinator.training.stage_owners import REPLICA_ERRORS, Owner, StageOwners, StepPull
from coordinator.training.steps import AttemptOutcome
from edgetrain import transport
from edgetrain.config import ConfigError, load_plan
from edgetrain.plan import Plan, plan_to_dict
from edgetrain.split import share_change_gain
from edgetrain.training import state_tensors
from edgetrain.work import Assignment, LocalWork

logger = logging.getLogger(__name__)

BESIDE_SEED_OFFSET = 7919
"""Boards beside the steps draw their samples in orders seeded apart from their DP orders."""


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
        self._kept: tuple[tuple, float] | None = None
        """The structure the last trial kept and the step time it measured."""

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
            if plan is not None and self._runnable(plan, fleet):
                if self.trial.plan_for(step - 1) is not plan:
                    self._put_in_force(step, plan, trial=True)
                return plan
            self._commit_trial(step)
        boards = [board_from_record(r, self.model_cost) for r in fleet.records.values() if r.ready and not r.quarantined]
        first = self._first_trial(step, fleet, boards)
        if first is not None:
            return first
        measured = self._measured_step_s()
        if measured and self.planner.current is not None:
            self.planner.note_measured(self.planner.current, measured, step)
        before = self.planner.current
        decision = self.planner.decide(step, boards, measured) if boards else None
        if decision is not None:
            self._record(step, decision)
            trial_steps = self.ctx.job.planner.trial_steps
            if decision.switched and trial_steps and self._warmed_up and self._links_known(fleet):
                candidates = [decision.plan]
                if self._may_trial():  # the best of each other kind too
                    candidates = distinct([decision.plan, *worth_measuring(decision.plan,
                                                                           self.planner.alternatives(boards))])
                # the plan in force, if it can still run, competes with the step time it measured (in
                # its trial, when it has not run enough steps since)
                known = measured or (self._kept[1] if self._kept and before is not None
                                     and self._kept[0] == structure(before) else None)
                incumbent = (before, known) if before is not None and known and self._runnable(before, fleet) \
                    else None
                if len(candidates) >= 2 or incumbent is not None:
                    self.trial = Trial(step, candidates, trial_steps, decision.reasons, incumbent)
                    logger.info("[Coordinator.Planner] step %d: measuring %s for %d step(s) each before committing%s",
                                step, " | ".join(p.describe() for p in candidates), trial_steps,
                                f" (against the plan in force, {known:.3f} s/step)" if incumbent else "")
                    return self.trial.plan_for(step)
        return self.planner.current or Plan(dp_share=1.0)  # nobody to plan for yet: DP waits for boards

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
        candidates = distinct([current, *worth_measuring(current, self.planner.alternatives(boards))])
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
        ready = {r.name for r in fleet.records.values() if r.ready and not r.quarantined}
        return all(b in ready for s in plan.stages for b in s.boards) and all(b in ready for b in plan.dp_boards)

    def _commit_trial(self, step: int) -> None:
        """The trial is over (or a candidate cannot run): the best measured candidate stays in force."""
        trial, self.trial = self.trial, None
        job = self.ctx.job
        phi = self.ctx.aggregator.noise.value
        scores = trial.scores(job.training.global_batch, phi)
        chosen = trial.best(job.training.global_batch, phi)
        plan = trial.measured[chosen].plan
        self.trial_seconds += trial.seconds()
        if trial.measured[chosen].step_s() is not None:
            self._kept = (structure(plan), trial.measured[chosen].step_s())
        for m in trial.measured:
            if m.step_s() is not None:
                self.planner.note_measured(m.plan, m.step_s(), step)
        self.planner.adopt(plan)
        kept = PlanDecision(step, (f"measured: kept {scores[chosen]['plan']}",), plan, True,
                            scores[chosen]["score"] or 0.0, None)
        self.ctx.metrics.write(kept.to_record(job.pipeline.stage_state))  # the plan in force from here
        self.ctx.metrics.write({"kind": "plan_trial", "step": step, "started": trial.start_step,
                                "reasons": list(trial.reasons), "candidates": scores, "chosen": chosen,
                                "plan": plan_to_dict(plan), "plan_kind": plan.kind,
                                "local_boards": list(plan.local_boards), "left_out": dict(plan.left_out),
                                "noise_scale": None if phi is None else round(phi, 2),
                                "base_batch": job.training.global_batch,
                                "trial_s": round(trial.seconds(), 3), "trials_total_s": round(self.trial_seconds, 3)})
        lines = [f"  {'kept' if i == chosen else '    '} {s['plan']}: measured {s['measured_step_s']} s/step "
                 f"(predicted {s['predicted_step_s']}), efficiency {s['efficiency']}, score {s['score']}"
                 for i, s in enumerate(scores)]
        logger.info("[Coordinator.Planner] step %d: measured %d plans (noise scale %s); keeping the best:\n%s",
                    step, len(scores), "unknown" if phi is None else f"{phi:.0f}", "\n".join(lines))
        self._put_in_force(step, plan, trial=False)

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
            ready = [r for r in self.ctx.registry.snapshot() if r.ready]
            if all(r.latest_telemetry and r.latest_telemetry.link_mbit_per_s for r in ready):
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


class PipelineRound(RoundPolicy):
    """The plan in force as pipeline stages and DP shards (see the module docstring)."""

    def __init__(self, ctx: RoundContext, plans: PlanSource, dp: DataParallelRound) -> None:
        super().__init__(ctx)
        self.plans_from = plans
        self.dp = dp
        self.settings = ctx.job.pipeline
        self.owners = StageOwners(ctx.job.name, ctx.model, ctx.aggregator.optimizer,
                                  chunk_bytes=ctx.job.training.chunk_bytes,
                                  timeout_s=max(60.0, self.settings.stage_timeout_s),
                                  count_bytes=ctx.registry.count_bytes, security=ctx.board_security)
        self.plans = plans.history if isinstance(plans, LivePlans) else []
        self._committed = (-1, 0)
        """The last committed step and the attempt that counted (hosts owning a stage apply it)."""
        self._dp_shares: dict[str, int] | None = None
        self.beside_samples = OwnSamples(ctx.job.seed + BESIDE_SEED_OFFSET)
        """Boards beside the steps: where each is in its own seeded order of the samples it trains on
        (its own data, or the whole training set; another order than its own data's as a DP shard);
        a hand-out moves it on."""
        self._fleet = Fleet({})
        """The fleet as the plan in force was last checked against."""
        self._missing: list[str] = []
        self._pulls: dict[tuple[int, int], StepPull] = {}
        """Replication: each owned stage's changes in the attempt in flight, being pulled."""
        self._changes: tuple[tuple[int, int], float, dict[tuple[int, int], dict]] | None = None
        """Replication: the changes of the attempt that counted ((step, attempt), its learning
        rate, blocks -> changes), applied to the master when it commits."""

    def configure(self, step: int, attempt: int, indices: list[int]) -> Round | None:
        self._drop_pulls()  # an attempt that counted but brought no usable update: its pulls are void
        plan, hosts = self._plan_with_boards(step)
        if not plan.stages:
            self._release_owned(step, attempt)
            round_ = self.dp.configure_on(step, attempt, indices, plan.dp_boards, exclude=plan.local_boards)
            return replace(round_, beside=self._beside(step, attempt, plan, set(round_.assignments)))
        job = self.ctx.job
        lr = self.ctx.aggregator.step_lr(step)
        assignments = assign(plan, self.settings, step=step, attempt=attempt, indices=indices,
                             block_names=self.ctx.model.block_names, hosts=hosts, augment=job.dataset.augment,
                             data_seed=job.seed, lr=lr, commit=self._committed, previous_shares=self._dp_shares,
                             share_gain=share_change_gain(self.ctx.registry.rate_noise(
                                 hosts[b].device_id for b in plan.dp_boards), len(plan.dp_boards)))
        self.dp.own.forget_pending()
        for device_id, a in assignments.items():  # a shard of a board with its own data: its own samples
            record = self._fleet.records.get(device_id)
            if a.stage is None and record is not None and record.local_samples:
                assignments[device_id] = replace(a, indices=self.dp.own_indices(record, len(a.indices)))
        codec = job.compression.uplink
        if codec not in ("none", "adaptive"):  # the job's codec for every upload (owned stages upload nothing)
            assignments = {d: a if a.stage is not None and a.stage.owned else replace(a, codec=codec)
                           for d, a in assignments.items()}
        self._dp_shares = {d: len(a.indices) for d, a in assignments.items() if a.stage is None}
        failed = self._place_owned(step, attempt, assignments)
        self._republish_if_pulled(step)
        if failed:
            self._note_failures(step, attempt, failed)
            self.ctx.stop.wait(job.training.heartbeat_timeout_s)
            return None
        timeout = job.training.step_timeout_s or 3 * self.settings.stage_timeout_s + 30.0  # a backstop
        if self.settings.replicate:
            self._pulls = {blocks: self.owners.pull_step(owner, step, attempt, timeout + self.owners.timeout_s)
                           for blocks, owner in self.owners.owners.items()}
            self._changes = ((step, attempt), lr, {})
        return Round(step, attempt, assignments, timeout, all_or_nothing=True,
                     beside=self._beside(step, attempt, plan, set(assignments)))

    def complete(self, round_: Round, outcome: AttemptOutcome, elapsed_s: float) -> bool:
        if not round_.all_or_nothing:
            return self.dp.complete(round_, outcome, elapsed_s)
        registry = self.ctx.registry
        failed = dict(outcome.rejected)
        for device_id in outcome.missing:
            failed.setdefault(device_id, "no result before the deadline" if registry.is_alive(device_id)
                              else "gone (no heartbeat)")
        failed.update({d: "no answer (its pipeline failed)" for d in round_.assignments
                       if d not in outcome.accepted and d not in failed})
        if not failed:
            failed = self._receive_changes()
        if not failed:
            return True
        self._drop_pulls()
        self._note_failures(round_.step, round_.attempt, failed, round_.assignments)
        # give a board that died time to miss its heartbeats: the next attempt then waits for a
        # plan without it instead of failing again at once
        self.ctx.stop.wait(self.ctx.job.training.heartbeat_timeout_s)
        return False

    def collect(self, round_: Round, outcome: AttemptOutcome) -> Collected:
        fresh = list(outcome.accepted.values())
        stages = {}
        for c in fresh:
            if c.stage is not None:
                host = c.stage.host(c.device_id)
                fraction = (self.plans_from.work_fraction(c.stage.first_block, c.stage.end_block)
                            if isinstance(self.plans_from, LivePlans) and host is not None and host.channels is None
                            else None)
                calls = sum(e > b for b, e in host.rows) if host is not None else 1
                self.ctx.registry.observe_stage(c.device_id, c.samples, c.compute_s, c.comm_s, c.energy_j,
                                                work_fraction=fraction, calls=max(calls, 1))
                stages[c.device_id] = {"stage": c.stage.stage, "blocks": [c.stage.first_block, c.stage.end_block],
                                       "compute_s": round(c.compute_s, 4), "wait_s": round(c.wait_s, 4),
                                       "peak_activation_bytes": c.peak_activation_bytes,
                                       "peer_bytes": c.peer_bytes, "upload_bytes": c.wire_bytes,
                                       "owned": c.stage.owned}
                if host is not None and host.channels is not None:  # a channel group member's share
                    stages[c.device_id]["channels"] = [round(v, 4) for v in host.channels]
                pull = self._pulls.get((c.stage.first_block, c.stage.end_block))
                if c.stage.owned and pull is not None:
                    stages[c.device_id]["replica_bytes"] = pull.nbytes
        return Collected(merge_pipelines(fresh), stages)

    def committed(self, round_: Round) -> None:
        self.dp.committed(round_)
        self._committed = (round_.step, round_.attempt)
        if self._changes is not None and self._changes[0] == self._committed:
            _, lr, changes = self._changes
            for blocks, tensors in changes.items():
                self.owners.apply_step(blocks, tensors, lr, round_.step)
        self._changes, self._pulls = None, {}

    def state_dict(self) -> dict:
        return {**self.dp.state_dict(), "beside_samples": dict(self.beside_samples.cursors)}

    def load_state_dict(self, state: dict) -> None:
        self.dp.load_state_dict(state)
        self.beside_samples.cursors = {str(k): int(v) for k, v in state.get("beside_samples", {}).items()}

    def after_step(self, step: int, saving: bool) -> None:
        if self.owners.owners and (saving or (step + 1) % self.settings.sync_every == 0):
            self._note_losses(step + 1, self.owners.sync(step + 1, self._committed, self.ctx.registry.is_alive))

    def close(self) -> None:
        self._drop_pulls()
        self.owners.close()

    # --- internals -----------------------------------------------------------------------------------
    def _beside(self, step: int, attempt: int, plan: Plan, working: set[str]) -> dict[str, Assignment]:
        """Local work for the plan's boards beside the steps that are ready, idle and not working
        in the step (`working`), each sized from its measured speed and link to land within the
        staleness bound (coordinator.planning.local_members). None while boards own stages: a
        whole-model update would change blocks whose state lives on their owners. Local updates
        travel uncompressed: a board's error feedback holds gradients, not parameter changes."""
        if not plan.local_boards or not isinstance(self.plans_from, LivePlans) or self.owners.owners:
            return {}
        step_s = self.plans_from.step_s()
        job, busy = self.ctx.job, self.ctx.board.busy()
        lr = self.ctx.aggregator.step_lr(step)
        codec = "none"
        out = {}
        for record in self._fleet.records.values():
            if (record.name not in plan.local_boards or not record.ready or record.quarantined
                    or record.device_id in busy or record.device_id in working or record.speed is None
                    or not step_s):
                continue
            speed = record.speed
            transfer_s = speed.comm_s or self.dp.codecs.step_bytes(codec) * 8 / (
                (self._fleet.link_mbit(record.device_id) or UNKNOWN_LINK_MBIT) * 1e6)
            size = local_work_size(overhead_s=speed.overhead_s, samples_per_s=speed.samples_per_s,
                                   transfer_s=transfer_s, step_s=step_s,
                                   staleness_bound=job.aggregation.staleness_bound,
                                   staleness_exponent=job.aggregation.staleness_exponent,
                                   local_batch=job.federated.local_batch)
            if size is None:
                continue
            data = record.local_samples or self.ctx.train_size
            indices = self.beside_samples.take(record.name, size.samples, data)
            self.beside_samples.committed()
            out[record.device_id] = Assignment(
                step, attempt, step, indices, job.dataset.augment, job.seed, codec=codec,
                local=LocalWork(steps=size.steps, batch_size=size.batch, lr=lr, momentum=0.0, weight_decay=0.0,
                                prox_mu=0.0))
        return out

    def _plan_with_boards(self, step: int) -> tuple[Plan, dict[str, Host]]:
        """The plan in force once every board it names is ready (or a plan without stages)."""
        while True:
            self.plans_from.prepare()
            fleet = self._fleet = Fleet.snapshot(self.ctx.registry)
            plan = self.plans_from.current(step, fleet)
            hosts = {r.name: Host(r.device_id, r.stage_address, r.speed) for r in fleet.records.values() if r.ready}
            missing = missing_boards(plan, hosts) if plan.stages else []
            if not missing:
                self._missing = []
                return plan, hosts
            if missing != self._missing:
                where = f" or for a new plan in {self.settings.plan_file}" if self.settings.plan_file else ""
                logger.warning("[Coordinator.Trainer] the pipeline plan needs board(s) %s, which are not ready; "
                               "waiting for them%s", ", ".join(missing), where)
                self._missing = missing
            if self.ctx.stop.wait(0.5):
                raise JobAborted(f"stopped during step {step}")

    def _receive_changes(self) -> dict[str, str]:
        """Replication: wait for every owner's changes in the attempt (its result is in, so they
        are on their way); returns the owners whose changes did not arrive (device id -> reason)."""
        failed = {}
        if self._changes is None:
            return failed
        for blocks, pull in self._pulls.items():
            try:
                self._changes[2][blocks] = pull.result(self.owners.timeout_s)
            except REPLICA_ERRORS as e:
                failed[pull.owner.device_id] = (f"the replica of blocks [{blocks[0]}, {blocks[1]}) did not get "
                                                f"its changes: {transport.describe(e)}")
        return failed

    def _drop_pulls(self) -> None:
        """The attempt in flight is over uncounted: its pulls are given up."""
        for pull in self._pulls.values():
            pull.cancel()
        self._pulls, self._changes = {}, None

    def _place_owned(self, step: int, attempt: int, assignments: dict[str, Assignment]) -> dict[str, str]:
        """Give owned stages to their planned hosts (taking state back from owners the plan no
        longer wants); returns the hosts that could not take over their stage."""
        wanted = {}
        for device_id, a in assignments.items():
            if a.stage is not None and a.stage.owned:
                blocks = (a.stage.first_block, a.stage.end_block)
                address = next(h.address for h in a.stage.hosts if h.device_id == device_id)
                wanted[blocks] = Owner(device_id, address, blocks)
        losses, failed = self.owners.place(wanted, step, self._committed, attempt, self.ctx.registry.is_alive)
        self._note_losses(step, losses)
        return failed

    def _release_owned(self, step: int, attempt: int) -> None:
        """The plan has no pipeline now: owned stages come back to the master first."""
        if self.owners.owners:
            failed = self._place_owned(step, attempt, {})
            if failed:
                self._note_failures(step, attempt, failed)
            self.ctx.store.publish(step, state_tensors(self.ctx.model))
            self.owners.master_changed = False

    def _republish_if_pulled(self, step: int) -> None:
        """Owned blocks taken back changed the master: serve the parameters as they are now."""
        if self.owners.master_changed:
            self.ctx.store.publish(step, state_tensors(self.ctx.model))
            self.owners.master_changed = False

    def _note_failures(self, step: int, attempt: int, failed: dict[str, str],
                       assignments: dict[str, Assignment] | None = None) -> None:
        self.failures.append({"attempt": attempt, "time": round(time.time(), 3), "failed": failed})
        for device_id, reason in failed.items():
            a = (assignments or {}).get(device_id)
            role = f"stage {a.stage.stage} host" if a and a.stage else "DP shard" if a else "stage host"
            logger.error("[Coordinator.Trainer] step %d attempt %d: %s %s failed: %s", step, attempt, role,
                         device_id, reason)

    def _note_losses(self, step: int, losses) -> None:
        for loss in losses:
            lost = step - max(loss.synced_version, 0)
            self.failures.append({"time": round(time.time(), 3), "lost_state": {
                "blocks": list(loss.blocks), "device": loss.device_id, "restored_version": loss.synced_version,
                "steps_lost": lost, "reason": loss.reason}})
            logger.warning("[Coordinator.Trainer] blocks [%d, %d) go back %d step(s) to version %d: their "
                           "owner %s is lost (%s); pipeline.sync_every bounds this", loss.blocks[0], loss.blocks[1],
                           lost, loss.synced_version, loss.device_id, loss.reason)
