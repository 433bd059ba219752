"""Data-parallel and federated training driven by the coordinator.

Each step: publish the parameters, split the step's global batch across the available devices
(proportional to measured speed, or equally) and choose each device's link codecs, wait for
their updates, then screen them (clip, outliers), weight them (samples, staleness) and take one
optimizer step. The master copy of the model and the optimizer live here; devices only ever
compute updates.

When a step is over depends on the aggregation rule: `mean` without a deadline waits for every
device and redoes the step if one died (no sample lost, exactly the single-device arithmetic);
with the `predicted` deadline the step closes at a multiple of its predicted time and is applied
if enough samples arrived; `staleness` also keeps late devices' tickets open and uses their
updates in a later step, down-weighted. In federated rounds (`fedavg`, `fedprox`) each device
trains locally on its own partition and the step averages the parameter changes.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from coordinator.planning.inputs import UNKNOWN_LINK_MBIT, board_from_record, measure_model_cost
from coordinator.planning.live import LivePlanner
from coordinator.registry import DeviceRegistry
from coordinator.training.aggregate import (
    Screening,
    Weighted,
    apply_update,
    combine,
    screen,
    staleness_weight,
)
from coordinator.training.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from coordinator.training.codec_policy import CodecPolicy, LinkChoice
from coordinator.training.metrics import MetricsLog
from coordinator.training.parameters import ParameterStore
from coordinator.training.pipeline_plan import Host, assign, merge_pipelines, missing_boards
from coordinator.training.stage_owners import Owner, StageOwners
from coordinator.training.steps import (
    AttemptOutcome,
    Contribution,
    StepBoard,
)
from edgetrain.config import JobConfig, OptimizerConfig, PipelineConfig, load_pipeline_plan
from edgetrain.data import make_batch
from edgetrain.pipeline import stage_blocks
from edgetrain.sampling import batch_indices, epoch_of
from edgetrain.split import SpeedEstimate, predicted_step_seconds, split_equal, split_sticky
from edgetrain.training import evaluate, lr_factor, make_optimizer, set_learning_rate, state_tensors
from edgetrain.updates import UpdateFormats
from edgetrain.work import Assignment, LocalWork

logger = logging.getLogger(__name__)


UNMEASURED_LINK_S = 30.0
"""Transfer time assumed per step for a device whose link was never measured."""


class JobAborted(RuntimeError):
    """The job cannot go on (a step failed on every attempt, or it was stopped)."""


@dataclass
class StepRecord:
    """What one completed step did, for metrics."""

    step: int
    attempts: int
    seconds: float
    outcome: AttemptOutcome
    shares: dict[str, int]
    used: list[Weighted] = field(default_factory=list)
    """The updates that went into the step, with their staleness and weight factor."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Every update refused this step (upload checks, screening, too stale), by device."""
    clipped: dict[str, float] = field(default_factory=dict)
    codecs: dict[str, str] = field(default_factory=dict)
    quarantined: list[str] = field(default_factory=list)
    stages: dict[str, dict] = field(default_factory=dict)
    """Pipeline hosts: stage, compute and wait seconds, peak activation bytes."""
    failures: list[dict] = field(default_factory=list)
    """Failed attempts of a pipeline step: when, and which board failed how."""


class Trainer:
    """Runs one job's steps — data parallel, federated or pipelined — over the devices in
    `registry`, through `board`."""

    def __init__(self, job: JobConfig, registry: DeviceRegistry, board: StepBoard, model: torch.nn.Module,
                 train_size: int, test_set, run_dir: Path, stop: threading.Event | None = None, *,
                 store: ParameterStore | None = None, formats: UpdateFormats | None = None) -> None:
        self.job = job
        self.registry = registry
        self.board = board
        self.model = model
        self.train_size = train_size
        self.test_set = test_set
        self.run_dir = run_dir
        self.stop = stop or threading.Event()
        self.store = store or ParameterStore(job.compression.downlink)
        self.formats = formats or UpdateFormats(_templates(model))
        agg = job.aggregation
        self.federated = agg.federated
        self.keep_late = agg.rule == "staleness"
        self.use_deadline = agg.deadline == "predicted" or self.keep_late
        if self.federated:
            server = OptimizerConfig(lr=job.federated.server_lr, momentum=0.0, weight_decay=0.0, schedule="constant")
        elif job.compression.boards_keep_momentum and not (job.pipeline.enabled or job.planner.enabled):
            # the boards send momentum, not gradients (pipelines send plain gradients)
            server = replace(job.optimizer, momentum=0.0, nesterov=False)
        else:
            server = job.optimizer
        self.optimizer = make_optimizer(model, server)
        state = state_tensors(model)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        self.policy = CodecPolicy(job.compression, lambda c: self.formats(c).wire_bytes(), full_bytes,
                                  _delta_bytes(state, job.compression.downlink))
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.start_step = 0
        self.train_seconds = 0.0
        self.samples_done = 0
        self.lr = 0.0
        self._partitions: dict[str, int] = {}
        self._plan_cache: tuple[float, PipelineConfig] | None = None
        self._plan_missing: list[str] = []
        self._plan_error = ""
        self._failures: list[dict] = []
        self._late: list[Contribution] = []
        self._late_rejected: dict[str, str] = {}
        self.owners = StageOwners(job.name, model, self.optimizer, chunk_bytes=job.training.chunk_bytes,
                                  timeout_s=max(60.0, job.pipeline.stage_timeout_s),
                                  count_bytes=registry.count_bytes)
        self._committed = (-1, 0)
        """The last committed step and the attempt that counted (hosts owning a stage apply it)."""
        self._dp_shares: dict[str, int] | None = None
        """The data-parallel shares last assigned (kept while near the best split: see split_sticky)."""
        self.live: LivePlanner | None = None
        """Hybrid mode: the planner that chooses (and changes) the plan from the live fleet."""
        self._auto_plan: PipelineConfig | None = None
        self._dp_only: list[str] = []
        if job.planner.enabled:
            self._model_cost = measure_model_cost(job.model)
            self.live = LivePlanner(job.planner, self._model_cost, job.training.global_batch,
                                    job.pipeline.stage_state, job.pipeline.sync_every)
        self._pipelined = job.pipeline.enabled or self.live is not None
        self.plans: list[dict] = []
        """Hybrid mode: every plan put in force (step, kind, predicted step seconds)."""
        self.step_seconds: list[tuple[int, float]] = []

    def resume_if_possible(self) -> None:
        """Continue from the run directory's checkpoint, if there is one."""
        if not has_checkpoint(self.run_dir):
            return
        state = load_checkpoint(self.run_dir, self.model, self.optimizer)
        self.start_step = state["next_step"]
        self.train_seconds, self.samples_done = state["train_seconds"], state["samples_done"]
        self._partitions = dict(state.get("partitions", {}))
        logger.info("[Coordinator.Trainer] resumed from checkpoint at step %d", self.start_step)

    def run(self) -> dict:
        """Train to the configured number of steps; returns the final evaluation."""
        cfg = self.job.training
        try:
            self._wait_for_devices(cfg.min_clients)
            logger.info("[Coordinator.Trainer] devices ready: training starts")
            for step in range(self.start_step, cfg.steps):
                record = self._run_step(step)
                self._log_step(record)
                last = step == cfg.steps - 1
                evaluate = last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                checkpoint = last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
                if self.owners.owners and (evaluate or checkpoint or (step + 1) % self._plan().sync_every == 0):
                    self._sync_owned(step + 1)
                reached = False
                if evaluate:
                    self._evaluate(step)
                    reached = bool(cfg.target_accuracy) and not last and \
                        self.metrics.last_eval["test_accuracy"] >= cfg.target_accuracy
                if checkpoint or reached:
                    self._checkpoint(step + 1)
                if reached:
                    logger.info("[Coordinator.Trainer] test accuracy %.4f reached the target %.4f after step %d: done",
                                self.metrics.last_eval["test_accuracy"], cfg.target_accuracy, step)
                    self.board.finish(f"job {self.job.name} reached test accuracy {cfg.target_accuracy} "
                                      f"after {step + 1} steps")
                    return self.metrics.last_eval
            self.board.finish(f"job {self.job.name} completed {cfg.steps} steps")
            return self.metrics.last_eval
        except BaseException as e:
            self.board.finish(f"job {self.job.name} stopped: {e}")
            raise
        finally:
            self.owners.close()

    def _wait_for_devices(self, count: int) -> dict[str, SpeedEstimate]:
        logged = False
        while not self.stop.is_set():
            speeds = self.registry.wait_ready(count, timeout_s=1.0)
            if len(speeds) >= count:
                return speeds
            if not logged:
                logger.info("[Coordinator.Trainer] waiting for %d ready device(s), have %d", count, len(speeds))
                logged = True
        raise JobAborted("stopped while waiting for devices")

    def _available(self, step: int) -> dict[str, SpeedEstimate]:
        """Ready devices that may get work now: not quarantined, not still busy with a late ticket."""
        while True:
            self.registry.release_quarantine(step)
            speeds = self._wait_for_devices(1)
            quarantined = {r.device_id for r in self.registry.snapshot() if r.quarantined}
            busy = self.board.busy()
            available = {d: s for d, s in speeds.items() if d not in quarantined and d not in busy}
            if self.federated:
                live = {r.name for r in self.registry.snapshot() if r.alive}
                available = {d: s for d, s in available.items() if self._partition(d, live) is not None}
            if available:
                return available
            if speeds and all(d in quarantined for d in speeds):  # nobody left to train: end quarantines early
                logger.warning("[Coordinator.Trainer] every ready device is quarantined; releasing them")
                self.registry.release_quarantine(10**12)
                continue
            if self.federated and not busy:
                logger.warning("[Coordinator.Trainer] ready devices hold no data partition; waiting for a "
                               "partition holder (or a board to take over a departed one's partition)")
                self.stop.wait(1.0)
            self._collect_late(step)  # everyone is busy with late work: wait for some of it
            time.sleep(0.05)

    def _run_step(self, step: int) -> StepRecord:
        cfg = self.job.training
        self.store.publish(step, state_tensors(self.model))
        indices = batch_indices(step, cfg.global_batch, self.train_size, self.job.seed)
        started = time.monotonic()
        for attempt in range(cfg.max_attempts):
            if self.live is not None:
                self._replan(step)
            planned = self._pipeline_assignments(step, attempt, indices) if self._pipelined else None
            if planned is not None:
                plan, assignments = planned
                failed = self._place_owned(step, attempt, assignments)
                if self.owners.master_changed:  # owned blocks taken back: serve them as they are now
                    self.store.publish(step, state_tensors(self.model))
                    self.owners.master_changed = False
                if failed:
                    self._note_failed_placement(step, attempt, failed)
                    self.stop.wait(cfg.heartbeat_timeout_s)
                    continue
                self.board.open_attempt(assignments)
                opened = time.monotonic()
                timeout = cfg.step_timeout_s or 3 * plan.stage_timeout_s + 30.0  # a backstop: hosts report sooner
                outcome = self.board.wait_attempt(step, attempt, opened + timeout, self.registry.is_alive,
                                                  all_or_nothing=True)
                if self.stop.is_set():
                    raise JobAborted(f"stopped during step {step}")
                if self._pipeline_done(step, attempt, outcome, assignments):
                    break
                # give a board that died time to miss its heartbeats: the next attempt then waits
                # for a plan without it instead of failing again at once
                self.stop.wait(cfg.heartbeat_timeout_s)
                continue
            if self.owners.owners:  # the plan has no pipeline now: owned stages come back first
                self._note_failed_placement(step, attempt, self._place_owned(step, attempt, {}))
                self.store.publish(step, state_tensors(self.model))
                self.owners.master_changed = False
            speeds = self._available(step)
            if self._dp_only:  # a planned DP plan: only its boards (others were left out)
                names = {r.device_id: r.name for r in self.registry.snapshot()}
                speeds = {d: s for d, s in speeds.items() if names.get(d) in self._dp_only} or speeds
            shares = self._split(len(indices), speeds)
            choices = self._choose_codecs(shares, speeds)
            assignments = self._assign(step, attempt, indices, shares, choices)
            self.board.open_attempt(assignments)
            opened = time.monotonic()
            deadline = opened + self._timeout(shares, speeds, attempt, choices)
            outcome = self.board.wait_attempt(step, attempt, deadline, self.registry.is_alive,
                                              keep_late=self.keep_late)
            if self.stop.is_set():
                raise JobAborted(f"stopped during step {step}")
            if self._attempt_done(step, attempt, outcome, assignments, time.monotonic() - opened):
                break
            if self.keep_late:  # the redo covers these samples: late answers for them must not count too
                self.board.cancel_step(step)
        else:
            raise JobAborted(f"step {step} failed on all {cfg.max_attempts} attempts")
        record = self._apply(step, outcome)
        self._committed = (step, attempt)
        record.attempts, record.seconds = attempt + 1, time.monotonic() - started
        record.shares = {d: len(a.indices) for d, a in assignments.items()}
        record.codecs = {d: a.codec for d, a in assignments.items()}
        record.failures, self._failures = self._failures, []
        return record

    def _attempt_done(self, step: int, attempt: int, outcome: AttemptOutcome, assignments: dict[str, Assignment],
                      elapsed: float) -> bool:
        """Whether the attempt's results are used (else the step is redone)."""
        overdue = [d for d in outcome.missing + outcome.late if self.registry.is_alive(d)]
        if not self.use_deadline:
            for device_id in outcome.missing:
                self.registry.drop(device_id, f"no result for step {step} attempt {attempt}")
            if outcome.missing:
                logger.warning("[Coordinator.Trainer] step %d attempt %d: %s failed; redoing the step with "
                               "the remaining devices", step, attempt, ", ".join(outcome.missing))
            return not outcome.missing
        for device_id in overdue:
            self.registry.observe_late(device_id, len(assignments[device_id].indices), elapsed)
        arrived = sum(c.samples for c in outcome.accepted.values())
        wanted = sum(len(a.indices) for a in assignments.values())
        if overdue:
            logger.info("[Coordinator.Trainer] step %d: deadline passed without %s (%d of %d samples arrived)%s",
                        step, ", ".join(overdue), arrived, wanted,
                        "; their updates may still count, down-weighted" if self.keep_late else "")
        if arrived >= self.job.aggregation.min_fraction * wanted:
            return True
        logger.warning("[Coordinator.Trainer] step %d attempt %d: only %d of %d samples by the deadline; "
                       "redoing the step", step, attempt, arrived, wanted)
        return False

    # --- pipelines -----------------------------------------------------------------------------
    def _replan(self, step: int) -> None:
        """Hybrid mode: plan from the live fleet, and again when it changed enough (LivePlanner)."""
        if self.live.current is None:
            self._wait_for_links()
        boards = []
        for r in self.registry.snapshot():
            if r.ready and not r.quarantined:
                boards.append(board_from_record(r, self._model_cost))
        if not boards:
            return
        decision = self.live.decide(step, boards, self._measured_step_s())
        if decision is None:
            return
        plan = decision.plan
        self.metrics.write(decision.to_record(self.job.pipeline.stage_state))
        logger.info("[Coordinator.Planner] step %d: %s -> %s\n%s", step, "; ".join(decision.reasons),
                    "new plan" if decision.switched else "plan kept (the new one is not "
                    f"{self.job.planner.min_gain:.0%} better)", plan.explain())
        entry = {"step": step, "kind": plan.kind, "predicted_step_s": plan.prediction.step_s,
                 "predicted_samples_per_s": plan.prediction.samples_per_s}
        if decision.switched or not self.plans:
            self.plans.append(entry)
        else:  # the same plan, predicted on today's fleet: its measured steps still count
            self.plans[-1].update(entry, step=self.plans[-1]["step"])
        section = plan.to_pipeline_section()
        self._dp_only = list(plan.dp_boards) if not plan.stages else []
        if not plan.stages:
            section.update(dp_boards=[], dp_share=0.0)
        self._auto_plan = replace(self.job.pipeline, **section)

    def _measured_step_s(self) -> float | None:
        """Median step time under the plan in force (its first step, carrying the hand-over, left
        out); None before 3 such steps."""
        if not self.plans:
            return None
        since = self.plans[-1]["step"]
        times = sorted(sec for st, sec in self.step_seconds if st > since)
        return times[len(times) // 2] if len(times) >= 3 else None

    def _wait_for_links(self) -> None:
        """Before the first plan: give every ready board up to link_wait_s to report its link."""
        deadline = time.monotonic() + self.job.planner.link_wait_s
        while time.monotonic() < deadline and not self.stop.is_set():
            ready = [r for r in self.registry.snapshot() if r.ready]
            if all(r.latest_telemetry and r.latest_telemetry.link_mbit_per_s for r in ready):
                return
            self.stop.wait(0.2)
        logger.warning("[Coordinator.Planner] some boards have not measured their link yet; planning with "
                       "%.0f Mbit/s for them", UNKNOWN_LINK_MBIT)

    def _note_failed_placement(self, step: int, attempt: int, failed: dict[str, str]) -> None:
        if failed:
            self._failures.append({"attempt": attempt, "time": round(time.time(), 3), "failed": failed})
            logger.error("[Coordinator.Trainer] step %d attempt %d: %s", step, attempt,
                         "; ".join(f"{d} {r}" for d, r in failed.items()))

    def _plan(self) -> PipelineConfig:
        """The pipeline plan: the planner's (hybrid mode), the job's, or its plan file as it is
        now (edited by hand to re-plan)."""
        if self.live is not None:
            return self._auto_plan or self.job.pipeline
        plan = self.job.pipeline
        if not plan.plan_file:
            return plan
        cached = self._plan_cache
        try:
            mtime = Path(plan.plan_file).stat().st_mtime
            if cached is None or cached[0] != mtime:
                fresh = load_pipeline_plan(plan.plan_file)
                stage_blocks([s.blocks for s in fresh.stages], len(self.model.block_names))
                self._plan_cache = (mtime, fresh)
                logger.info("[Coordinator.Trainer] pipeline plan from %s: %s", plan.plan_file, describe_plan(fresh))
        except (OSError, ValueError) as e:  # ConfigError is a ValueError
            if cached is None:
                raise JobAborted(f"pipeline plan {plan.plan_file}: {e}") from None
            if str(e) != self._plan_error:  # read again next time: the file may be mid-write
                logger.error("[Coordinator.Trainer] pipeline plan %s refused (%s); keeping the previous plan",
                             plan.plan_file, e)
                self._plan_error = str(e)
        return self._plan_cache[1]

    def _pipeline_assignments(self, step: int, attempt: int, indices: list[int]):
        """Wait until every board of the plan is ready, then assign the attempt's stages and shards
        (None: the plan has no stages, the attempt is data parallel)."""
        while True:
            if self.live is not None:
                self._replan(step)
            plan = self._plan()
            if not plan.stages:
                return None  # (hybrid mode) the plan has no pipeline now
            records = {r.name: r for r in self.registry.snapshot() if r.ready}
            hosts = {n: Host(r.device_id, r.stage_address, r.speed) for n, r in records.items()}
            missing = missing_boards(plan, hosts)
            if not missing:
                self._plan_missing = []
                lr = self.job.optimizer.lr * lr_factor(step, self.job.training.steps, self.job.optimizer)
                assignments = assign(plan, step=step, attempt=attempt, indices=indices,
                                     block_names=self.model.block_names, hosts=hosts,
                                     augment=self.job.dataset.augment, data_seed=self.job.seed, lr=lr,
                                     commit=self._committed, previous_shares=self._dp_shares)
                self._dp_shares = {d: len(a.indices) for d, a in assignments.items() if a.stage is None}
                return plan, assignments
            if missing != self._plan_missing:
                logger.warning("[Coordinator.Trainer] the pipeline plan needs board(s) %s, which are not ready; "
                               "waiting for them%s", ", ".join(missing),
                               f" or for a new plan in {plan.plan_file}" if plan.plan_file else "")
                self._plan_missing = missing
            if self.stop.wait(0.5):
                raise JobAborted(f"stopped during step {step}")

    def _place_owned(self, step: int, attempt: int, assignments: dict[str, Assignment]) -> dict[str, str]:
        """Give owned stages to their planned hosts (taking state back from owners the plan no
        longer wants); returns the hosts that could not take over their stage."""
        wanted = {(a.stage.first_block, a.stage.end_block): Owner(d, _address(a, d),
                                                                  (a.stage.first_block, a.stage.end_block))
                  for d, a in assignments.items() if a.stage is not None and a.stage.owned}
        losses, failed = self.owners.place(wanted, step, self._committed, attempt, self.registry.is_alive)
        self._note_losses(step, losses)
        return failed

    def _sync_owned(self, version: int) -> None:
        """Bring the master's copy of owned stages up to `version` (hosts keep their stages)."""
        self._note_losses(version, self.owners.sync(version, self._committed, self.registry.is_alive))

    def _note_losses(self, step: int, losses) -> None:
        for loss in losses:
            lost = step - max(loss.synced_version, 0)
            self._failures.append({"time": round(time.time(), 3), "lost_state": {
                "blocks": list(loss.blocks), "device": loss.device_id, "restored_version": loss.synced_version,
                "steps_lost": lost, "reason": loss.reason}})
            logger.warning("[Coordinator.Trainer] blocks [%d, %d) go back %d step(s) to version %d: their "
                           "owner %s is lost (%s); pipeline.sync_every bounds this", loss.blocks[0], loss.blocks[1],
                           lost, loss.synced_version, loss.device_id, loss.reason)

    def _pipeline_done(self, step: int, attempt: int, outcome: AttemptOutcome, assignments) -> bool:
        """A pipeline attempt counts only if every host and shard answered."""
        failed = {d: r for d, r in outcome.rejected.items()}
        for device_id in outcome.missing:
            if not self.registry.is_alive(device_id):
                failed[device_id] = "gone (no heartbeat)"
            else:
                failed.setdefault(device_id, "no result before the deadline")
        failed.update({d: "no answer (its pipeline failed)" for d in assignments
                       if d not in outcome.accepted and d not in failed})
        if not failed:
            return True
        self._failures.append({"attempt": attempt, "time": round(time.time(), 3), "failed": failed})
        for device_id, reason in failed.items():
            a = assignments[device_id]
            role = f"stage {a.stage.stage} host" if a.stage else "DP shard"
            logger.error("[Coordinator.Trainer] step %d attempt %d: %s %s failed: %s", step, attempt, role,
                         device_id, reason)
        return False  # live boards stay: the plan decides who works next (re-plan by hand meanwhile)

    def _split(self, total: int, speeds: dict[str, SpeedEstimate]) -> dict[str, int]:
        if self.federated:
            n = self.job.federated.local_steps * self.job.federated.local_batch
            return dict.fromkeys(speeds, n)
        if self.job.training.split == "equal":
            return split_equal(total, list(speeds))
        self._dp_shares = split_sticky(total, speeds, self._dp_shares)
        return self._dp_shares

    def _choose_codecs(self, shares: dict[str, int], speeds: dict[str, SpeedEstimate]) -> dict[str, LinkChoice]:
        compute_s = max((speeds[d].overhead_s + n / speeds[d].samples_per_s for d, n in shares.items() if n),
                        default=0.0)
        latest = {r.device_id: r.latest_telemetry for r in self.registry.snapshot()}
        choices = {}
        for device_id in shares:
            sample = latest.get(device_id)
            choices[device_id] = self.policy.choose(device_id, sample.link_mbit_per_s if sample else None,
                                                    compute_s)
            self.registry.set_codec(device_id, choices[device_id].codec)
        self.policy.retain({d for d in latest if self.registry.is_alive(d)})
        return choices

    def _assign(self, step: int, attempt: int, indices: list[int], shares: dict[str, int],
                choices: dict[str, LinkChoice]) -> dict[str, Assignment]:
        out, start = {}, 0
        local = self._local_work(step) if self.federated else None
        for device_id, count in shares.items():
            if not count:
                continue
            if self.federated:
                mine = self._partition_indices(device_id, step, count)
            else:
                mine, start = tuple(indices[start : start + count]), start + count
            out[device_id] = Assignment(step, attempt, step, mine, self.job.dataset.augment, self.job.seed,
                                        codec=choices[device_id].codec, delta_codec=choices[device_id].delta_codec,
                                        local=local)
        return out

    def _timeout(self, shares: dict[str, int], speeds: dict[str, SpeedEstimate], attempt: int,
                 choices: dict[str, LinkChoice]) -> float:
        """How long the attempt may take: the configured timeout, the predicted deadline, or
        3 x the prediction + 10 s. Until a device's communication time has been observed, its
        prediction includes its transfers at its measured bandwidth."""
        latest = {r.device_id: r.latest_telemetry for r in self.registry.snapshot()}
        speeds = {d: self._with_transfers(speeds[d], choices[d], latest.get(d)) for d in shares}
        configured = self.job.training.step_timeout_s
        predicted = predicted_step_seconds(shares, speeds)
        if self.federated:
            predicted += max(speeds[d].overhead_s for d in shares) * (self.job.federated.local_steps - 1)
        if self.use_deadline:  # the typical device's time: a straggler does not set the pace
            agg = self.job.aggregation
            typical = statistics.median_low([speeds[d].seconds(n) for d, n in shares.items() if n])
            if self.federated:
                typical += statistics.median_low([speeds[d].overhead_s for d in shares]) * (
                    self.job.federated.local_steps - 1)
            deadline = (agg.deadline_factor * typical + agg.deadline_slack_s) * (attempt + 1)
            return min(deadline, configured) if configured > 0 else deadline
        return configured if configured > 0 else 3 * predicted + 10.0

    def _with_transfers(self, speed: SpeedEstimate, choice: LinkChoice, sample) -> SpeedEstimate:
        if speed.comm_s > 0:
            return speed
        mbit = sample.link_mbit_per_s if sample else None
        transfer_s = self.policy.step_bytes(choice.codec) * 8 / (mbit * 1e6) if mbit else UNMEASURED_LINK_S
        return SpeedEstimate(speed.overhead_s, speed.samples_per_s, transfer_s)

    # --- federated rounds ------------------------------------------------------------------------
    def _partition(self, device_id: str, live_names: set[str]) -> int | None:
        """The data partition of a device (by board name, in order of arrival; a newcomer takes over
        the partition of a board that left); None while every partition has a live holder."""
        name = device_id.rsplit("-", 1)[0]
        if name not in self._partitions:
            count = self.job.federated.partitions or self.job.training.min_clients
            orphaned = sorted(p for holder, p in self._partitions.items() if holder not in live_names)
            if len(self._partitions) < count:
                self._partitions[name] = len(self._partitions)
            elif orphaned:
                holder = next(h for h, p in self._partitions.items() if p == orphaned[0])
                self._partitions[name] = self._partitions.pop(holder)
            else:
                return None
            logger.info("[Coordinator.Trainer] board %s holds data partition %d of %d", name,
                        self._partitions[name], count)
        return self._partitions[name]

    def _partition_indices(self, device_id: str, round_: int, count: int) -> tuple[int, ...]:
        return tuple(partition_indices(self._partitions[device_id.rsplit("-", 1)[0]],
                                       self.job.federated.partitions or self.job.training.min_clients,
                                       self.train_size, self.job.seed, round_, count))

    def _local_work(self, step: int) -> LocalWork:
        fed, opt = self.job.federated, self.job.optimizer
        self.lr = opt.lr * lr_factor(step, self.job.training.steps, opt)
        return LocalWork(steps=fed.local_steps, batch_size=fed.local_batch, lr=self.lr, momentum=opt.momentum,
                         weight_decay=opt.weight_decay,
                         prox_mu=fed.prox_mu if self.job.aggregation.rule == "fedprox" else 0.0)

    # --- the update --------------------------------------------------------------------------------
    def _collect_late(self, step: int) -> None:
        """Keep late answers that arrived (they enter the next update) and expire too-old tickets."""
        if self.keep_late:
            late, rejected = self.board.take_late(oldest_step=step - self.job.aggregation.staleness_bound)
            self._late += late
            self._late_rejected.update(rejected)

    def _apply(self, step: int, outcome: AttemptOutcome) -> StepRecord:
        agg = self.job.aggregation
        self._collect_late(step)
        late, self._late = self._late, []
        rejected = dict(outcome.rejected)
        rejected.update(self._late_rejected)
        self._late_rejected = {}
        fresh = list(outcome.accepted.values())
        stages = {}
        for c in fresh:
            if c.stage is not None:
                self.registry.observe_stage(c.device_id, c.samples, c.compute_s, c.comm_s, c.energy_j)
                stages[c.device_id] = {"stage": c.stage.stage, "blocks": [c.stage.first_block, c.stage.end_block],
                                       "compute_s": round(c.compute_s, 4), "wait_s": round(c.wait_s, 4),
                                       "peak_activation_bytes": c.peak_activation_bytes,
                                       "peer_bytes": c.peer_bytes, "upload_bytes": c.wire_bytes,
                                       "owned": c.stage.owned}
        fresh = merge_pipelines(fresh)
        usable = fresh[:]
        for c in late:
            tau = step - c.param_version
            if tau > agg.staleness_bound:
                rejected[c.device_id] = f"stale: computed on version {c.param_version}, {tau} steps old " \
                                        f"(bound {agg.staleness_bound})"
            else:
                usable.append(c)
        screening = screen(usable, clip_norm=agg.clip_norm, outlier_factor=agg.outlier_factor) if usable \
            else Screening([], {}, {}, {})
        rejected.update(screening.rejected)
        used = [Weighted(c, step - c.param_version, staleness_weight(step - c.param_version, agg.staleness_exponent))
                for c in screening.kept]
        if not self.federated:
            self.lr = set_learning_rate(self.optimizer, step, self.job.training.steps, self.job.optimizer)
        if used:
            apply_update(self.model, self.optimizer, combine(used))
        else:
            logger.error("[Coordinator.Trainer] step %d: no usable update; parameters unchanged", step)
        for item in used:
            c = item.contribution
            self.registry.observe_step(c.device_id, c.samples, c.compute_s, c.comm_s, c.energy_j)
        quarantined = []
        for device_id, reason in rejected.items():
            if reason.startswith("stale:"):
                continue  # slowness is not misbehaviour
            if self.registry.note_rejection(device_id, step, reason, limit=agg.quarantine_after,
                                            window=agg.quarantine_window, quarantine_steps=agg.quarantine_steps):
                quarantined.append(device_id)
        return StepRecord(step, 0, 0.0, outcome, {}, used=used, rejected=rejected, clipped=screening.clipped,
                          quarantined=quarantined, stages=stages)

    def _log_step(self, record: StepRecord) -> None:
        self.step_seconds.append((record.step, record.seconds))
        samples = sum(w.contribution.samples for w in record.used)
        self.samples_done += samples
        self.train_seconds += record.seconds
        self.metrics.train_step(record, lr=self.lr,
                                epoch=epoch_of(record.step, self.job.training.global_batch, self.train_size),
                                total_steps=self.job.training.steps, log_every=self.job.training.log_every)

    def _evaluate(self, step: int) -> None:
        started = time.monotonic()
        loss_sum, correct, seen = 0.0, 0, 0
        for begin in range(0, len(self.test_set), 256):
            idx = list(range(begin, min(begin + 256, len(self.test_set))))
            x, y = make_batch(self.test_set, idx, augment=False, seed=0, step=0)
            batch_loss, batch_correct = evaluate(self.model, x, y)
            loss_sum, correct, seen = loss_sum + batch_loss, correct + batch_correct, seen + len(idx)
        self.metrics.evaluation(step, loss_sum / seen, correct / seen, seen, time.monotonic() - started)

    def _checkpoint(self, next_step: int) -> None:
        save_checkpoint(self.run_dir, self.model, self.optimizer, {
            "next_step": next_step, "train_seconds": self.train_seconds, "samples_done": self.samples_done,
            "job": self.job.name, "partitions": self._partitions})


def _address(a: Assignment, device_id: str) -> str:
    return next(h.address for h in a.stage.hosts if h.device_id == device_id)


def describe_plan(plan: PipelineConfig) -> str:
    """One line: stages (blocks and boards), micro-batches, schedule, DP shards."""
    stages = "; ".join(f"{s.blocks} blocks on {'+'.join(s.boards)}" for s in plan.stages)
    shards = f"; DP shards {'+'.join(plan.dp_boards)} ({plan.dp_share:.0%})" if plan.dp_boards else ""
    return f"{stages}; {plan.microbatches} micro-batches, {plan.schedule}{shards}"


def partition_indices(partition: int, partitions: int, train_size: int, seed: int, round_: int,
                      count: int) -> list[int]:
    """A federated board's `count` samples for a round: its partition (every `partitions`-th sample
    of a seeded permutation) read cyclically, so the board's data never leaves its partition."""
    order = torch.randperm(train_size, generator=torch.Generator().manual_seed(seed + 7919))
    mine = order[partition::partitions].tolist()
    start = (round_ * count) % len(mine)
    return [mine[(start + i) % len(mine)] for i in range(count)]


def _templates(model: torch.nn.Module):
    from edgetrain.training import shard_tensor_names

    return shard_tensor_names(model)


def _delta_bytes(state: dict[str, torch.Tensor], downlink: str) -> int:
    """Bytes of one parameter delta in the downlink codec (full bytes when there is none)."""
    if downlink == "none":
        return sum(t.numel() * t.element_size() for t in state.values())
    from edgetrain.updates import DeltaFormat

    return sum(m.nbytes for m in DeltaFormat(state, downlink).chain_metas(0, 1))
