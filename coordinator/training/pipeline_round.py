"""Pipeline rounds: the plan in force, as pipeline stages and DP shards, all or nothing.

Where the plan comes from is a `PlanSource` (coordinator.training.plan_sources: the job's
`pipeline` section, a plan file, or the live planner). Whatever the source, the plan is an
`edgetrain.plan.Plan`, which `pipeline_work.assign` turns into each board's work; boards the
plan puts beside its steps get local work that no attempt waits for.

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

from coordinator.planning.inputs import (
    UNKNOWN_LINK_MBIT,
)
from coordinator.planning.local_members import local_work_size
from coordinator.training.data_parallel import DataParallelRound, OwnSamples
from coordinator.training.pipeline_work import (
    Host,
    assign,
    merge_pipelines,
    missing_boards,
)
from coordinator.training.plan_sources import LivePlans, PlanSource
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
from edgetrain.plan import Plan
from edgetrain.split import share_change_gain
from edgetrain.training import state_tensors
from edgetrain.work import Assignment, LocalWork

logger = logging.getLogger(__name__)

BESIDE_SEED_OFFSET = 7919
"""Boards beside the steps draw their samples in orders seeded apart from their DP orders."""


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
        staleness bound (coordinator.planning.local_members), at its local pace (a board whose
        updates miss the bound gets smaller work: coordinator.registry.DeviceRegistry.pace_local). None while boards own stages: a
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
            size = local_work_size(overhead_s=speed.overhead_s, samples_per_s=speed.samples_per_s * record.local_pace,
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
