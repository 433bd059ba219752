"""The step loop: the same for every training mode.

Each step: publish the parameters (version = step), take the step's global batch from a seeded
per-epoch permutation, and run attempts until one counts: the job's round policy says what each
board does and when the attempt counts (rounds.py), the step board hands the work out and
collects the updates (steps.py), and the aggregator combines them and takes the optimizer step
(aggregator.py). An attempt that brought no usable update (every one refused, failed or screened
out) changed nothing and does not count either: the step is redone. After
`training.max_attempts` attempts without one the job stops (JobAborted) — a step is never counted
as trained without an update. Then it records the step, evaluates and checkpoints on schedule,
and stops at the last step, at the first evaluation reaching `training.target_accuracy`, or once
`training.time_limit_s` seconds of training passed (then evaluating and checkpointing as after a
last step).

Checkpoints (checkpoint.py) are written every `training.checkpoint_every_s` seconds of training
and/or `training.checkpoint_every` steps, and always at the end (the last step, or the target
reached). Each carries the ledger `applied_steps`: how often each step's update was applied to
the checkpointed model, counted as each step's record is logged, right after the aggregator
applied it. A resume continues from the newest complete checkpoint with its ledger.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coordinator.registry import DeviceRegistry
from coordinator.training.aggregator import Aggregator, Weighted
from coordinator.training.checkpoint import (
    KEEP,
    CheckpointSet,
    Restored,
    load_newest,
    prune,
    save_checkpoint,
    set_aside,
)
from coordinator.training.metrics import MetricsLog, TimeSplit
from coordinator.training.parameters import ParameterStore
from coordinator.training.rounds import JobAborted, RoundContext, make_round_policy
from coordinator.training.steps import AttemptOutcome, StepBoard
from edgetrain import transport
from edgetrain.config import JobConfig
from edgetrain.data import dataset_is_synthetic
from edgetrain.sampling import batch_indices, epoch_of
from edgetrain.training import evaluate_dataset, state_tensors

logger = logging.getLogger(__name__)

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
    """Failed attempts of the step: when, and which board failed how (a pipeline's), or which
    updates were refused when none was usable."""
    attempt_log: list[dict] = field(default_factory=list)
    """Every attempt of the step: when it was opened and ended (wall clock), the boards it was
    handed to and when each took its work, those lost in it (gone or silent), and how it ended:
    applied, redone (it did not count) or void (it counted, but no update was usable)."""
    predicted_s: float | None = None
    """The step time predicted for the applied attempt: its split's (or plan's) time for the boards,
    plus the coordinator's own part as measured over the last steps (None: no prediction)."""
    coordinator: dict[str, float] = field(default_factory=dict)
    """The coordinator's own part of the step, seconds: publishing the parameters, configuring
    the attempts, and aggregating + applying the update (the boards wait through all three)."""
    noise_scale: float | None = None
    """The run's gradient noise scale after this step (None: not estimated yet)."""
    beside: dict[str, int] = field(default_factory=dict)
    """Local updates handed out with the step to boards training beside it: device -> samples."""

    @property
    def lost(self) -> list[str]:
        """Boards lost in any attempt of the step."""
        return sorted({d for entry in self.attempt_log for d in entry["lost"]})


class Trainer:
    """Runs one job's steps over the devices in `registry`, through `board`."""

    def __init__(self, job: JobConfig, registry: DeviceRegistry, board: StepBoard, model: torch.nn.Module,
                 train_size: int, test_set, run_dir: Path, stop: threading.Event | None = None, *,
                 store: ParameterStore, aggregator: Aggregator,
                 board_security: transport.Security = transport.INSECURE) -> None:
        self.job = job
        self.registry = registry
        self.board = board
        self.model = model
        self.test_set = test_set
        self.run_dir = run_dir
        self.stop = stop or threading.Event()
        self.store = store
        self.aggregator = aggregator
        synthetic = dataset_is_synthetic(job.dataset)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl",
                                  tensorboard=run_dir / "tensorboard" if job.training.tensorboard else None,
                                  note=f"job {job.name}: " + ("SYNTHETIC CIFAR-shaped data, not CIFAR-10: accuracy "
                                                              "says training works, not how well a model learns"
                                                              if synthetic else f"dataset {job.dataset.name}"))
        self.time_split = TimeSplit()
        """Where the steps' time went, per board and for the coordinator (medians of recent steps)."""
        self.train_size = train_size
        self.start_step = 0
        self.train_seconds = 0.0
        self.samples_done = 0
        self.steps_applied = 0
        """Steps whose update was applied (including those of a run resumed from)."""
        self.steps_attempted = 0
        self._coordinator_s: collections.deque[float] = collections.deque(maxlen=10)
        """The coordinator's own part (publish + configure + aggregate) of the last steps, seconds."""
        """Steps begun: the applied ones, and the one the job stopped in, if it stopped."""
        self.stop_reason: str | None = None
        """Why training ended: "steps" (all of them), "target_accuracy", "time_limit"; None
        while it runs or when it was aborted."""
        self.applied_steps = [0] * job.training.steps
        """The ledger: how often each step's update was applied to the model (saved with it)."""
        self.checkpoints: list[CheckpointSet] = []
        """This run's checkpoint sets, oldest first: the one resumed from, then those written."""
        self._checkpointed_at: float | None = None
        """time.monotonic() of the last checkpoint (or of the first step's start): when the next
        time-based one is due."""
        self.ctx = RoundContext(job=job, registry=registry, board=board, store=store, model=model,
                                aggregator=aggregator, metrics=self.metrics, stop=self.stop, train_size=train_size,
                                board_security=board_security)
        self.policy = make_round_policy(self.ctx)

    @property
    def plans(self) -> list[dict]:
        """Hybrid mode: every plan put in force (step, kind, predicted step seconds)."""
        return self.policy.plans

    @property
    def step_seconds(self) -> list[tuple[int, float]]:
        """(step, seconds) of every step trained."""
        return self.ctx.step_seconds

    def resume_if_possible(self) -> Restored:
        """Continue from the run directory's newest complete checkpoint, if there is one.

        Newer sets that fail their checks are skipped (each logged with why) and so is a set
        that does not fit the job. With a set found, training continues at its step with its
        model, momentum, ledger and progress, and a `resume` record in metrics.jsonl says so;
        without one nothing changes (`checkpoint` None; checkpoint.describe_missing says why).
        """
        restored = load_newest(self.run_dir, self.model, self.aggregator.optimizer)
        if restored.checkpoint is None:
            return restored
        state = restored.state
        self.start_step = self.steps_applied = self.steps_attempted = state["next_step"]
        self.train_seconds, self.samples_done = state["train_seconds"], state["samples_done"]
        ledger = list(state["applied_steps"])
        self.applied_steps = ledger + [0] * (self.job.training.steps - len(ledger))  # the job may have grown
        self.policy.load_state_dict(state)
        self.checkpoints = [restored.checkpoint]
        self.metrics.resume(self.start_step, restored.checkpoint.name, restored.skipped)
        logger.info("[Coordinator.Trainer] resumed from %s: continuing at step %d%s", restored.checkpoint.name,
                    self.start_step, f" (skipped {len(restored.skipped)} damaged newer set(s))" if restored.skipped
                    else "")
        return restored

    def start_from_scratch(self) -> None:
        """Train from step 0: an earlier run's checkpoints (if any) move to checkpoints.previous/,
        so nothing resumes this run from them, and its metrics to metrics.previous.jsonl."""
        moved = set_aside(self.run_dir)
        if moved:
            logger.warning("[Coordinator.Trainer] starting from step 0: the earlier checkpoints in %s were moved to %s",
                           self.run_dir, moved)
        records = self.metrics.start_over()
        if records:
            logger.warning("[Coordinator.Trainer] starting from step 0: the earlier run's metrics were moved to %s",
                           records)

    def run(self) -> dict:
        """Train to the configured number of steps; returns the final evaluation."""
        cfg = self.job.training
        try:
            self.ctx.wait_for_boards(cfg.min_clients, cfg.start_grace_s)
            logger.info("[Coordinator.Trainer] devices ready: training starts")
            for step in range(self.start_step, cfg.steps):
                self._log_step(self._run_step(step))
                reason = self._after_step(step)
                if reason == "target_accuracy":
                    self.stop_reason = reason
                    self.board.finish(f"job {self.job.name} reached test accuracy {cfg.target_accuracy} "
                                      f"after {step + 1} steps")
                    return self.metrics.last_eval
                if reason == "time_limit":
                    self.stop_reason = reason
                    self.board.finish(f"job {self.job.name} reached its time limit of {cfg.time_limit_s:g} s "
                                      f"of training after {step + 1} steps")
                    return self.metrics.last_eval
            self.stop_reason = "steps"
            self.board.finish(f"job {self.job.name} completed {cfg.steps} steps")
            return self.metrics.last_eval
        except BaseException as e:
            self.board.finish(f"job {self.job.name} stopped: {e}")
            raise
        finally:
            self.policy.close()

    def _run_step(self, step: int) -> StepRecord:
        cfg = self.job.training
        self.steps_attempted = step + 1
        self.registry.release_quarantine(step)  # boards whose term is over work again, in every mode
        started = time.monotonic()  # publishing is on the step's critical path: no board can start before it
        self.store.publish(step, state_tensors(self.model))
        coordinator = {"publish_s": time.monotonic() - started, "configure_s": 0.0, "aggregate_s": 0.0}
        indices = batch_indices(step, cfg.global_batch, self.train_size, self.job.seed)
        refused: dict[str, str] = {}  # updates refused in attempts that brought no usable one: in the record too
        quarantined: list[str] = []
        attempt_log: list[dict] = []
        for attempt in range(cfg.max_attempts):
            last_void = ""
            configuring = time.monotonic()
            round_ = self.policy.configure(step, attempt, indices)
            coordinator["configure_s"] += time.monotonic() - configuring
            if round_ is None:
                continue
            self.board.open_attempt({**round_.assignments, **round_.beside})
            opened = time.monotonic()
            entry = {"attempt": attempt, "opened": round(time.time(), 3), "boards": sorted(round_.assignments)}
            if round_.beside:
                entry["beside"] = sorted(round_.beside)
            attempt_log.append(entry)
            outcome = self.board.wait_attempt(step, attempt, opened + round_.timeout_s, self.registry.is_alive,
                                              keep_late=round_.keep_late, all_or_nothing=round_.all_or_nothing,
                                              ends_on_loss=round_.ends_on_loss, beside=set(round_.beside))
            wall = time.time() - time.monotonic()  # the step board's clock is monotonic: to wall-clock time
            entry.update(ended=round(time.time(), 3), lost=sorted(outcome.missing), outcome="redone",
                         taken={d: round(t + wall, 3) for d, t in sorted(outcome.taken.items())})
            if self.stop.is_set():
                raise JobAborted(f"stopped during step {step}")
            if self.policy.complete(round_, outcome, time.monotonic() - opened):
                aggregating = time.monotonic()
                collected = self.policy.collect(round_, outcome)
                result = self.aggregator.apply(step, self.board, collected.contributions, outcome.rejected,
                                               collected.factors)
                coordinator["aggregate_s"] += time.monotonic() - aggregating
                quarantined += result.quarantined
                if result.used:
                    entry["outcome"] = "applied"
                    break
                entry["outcome"] = "void"
                last_void = self._void(step, attempt, result.rejected, redo=attempt + 1 < cfg.max_attempts)
                refused.update(result.rejected)
            if round_.keep_late:  # the redo covers these samples: late answers for them must not count too
                self.board.cancel_step(step, keep=set(round_.beside))
        else:
            reason = f"; the last brought no usable update ({last_void})" if last_void else ""
            raise JobAborted(f"step {step} failed on all {cfg.max_attempts} attempts{reason}")
        self.policy.committed(round_)
        failures, self.policy.failures = self.policy.failures, []
        predicted = None if round_.predicted_s is None else round_.predicted_s + (
            statistics.median(self._coordinator_s) if self._coordinator_s else 0.0)
        self._coordinator_s.append(sum(coordinator.values()))
        return StepRecord(step, attempt + 1, time.monotonic() - started, outcome,
                          shares={d: len(a.indices) for d, a in round_.assignments.items()},
                          beside={d: len(a.indices) for d, a in round_.beside.items()},
                          used=result.used, rejected={**refused, **result.rejected}, clipped=result.clipped,
                          noise_scale=result.noise_scale,
                          codecs={d: a.codec for d, a in round_.assignments.items()},
                          quarantined=quarantined, stages=collected.stages, failures=failures,
                          attempt_log=attempt_log, coordinator=coordinator, predicted_s=predicted)

    def _void(self, step: int, attempt: int, rejected: dict[str, str], *, redo: bool) -> str:
        """An attempt counted but none of its updates was usable: nothing was applied; say so, and
        keep it for the step's record. Returns the refusals in one line."""
        why = "; ".join(f"{d}: {r[:200]}" for d, r in rejected.items()) or "no update arrived"
        logger.warning("[Coordinator.Trainer] step %d attempt %d brought no usable update (%s); nothing was applied%s",
                       step, attempt, why, ", redoing the step" if redo else "")
        self.policy.failures.append({"attempt": attempt, "time": round(time.time(), 3), "no_usable_update": rejected})
        return why

    def _after_step(self, step: int) -> str | None:
        """Evaluate and checkpoint on schedule; why the job stops early after this step
        ("target_accuracy", "time_limit"), or None. Out of time, the step is the job's last:
        evaluated and checkpointed like the last of its steps."""
        cfg = self.job.training
        last = step == cfg.steps - 1
        out_of_time = bool(cfg.time_limit_s) and not last and self.train_seconds >= cfg.time_limit_s
        evaluating = last or out_of_time or bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0)
        checkpointing = last or out_of_time or bool(
            cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or bool(
            cfg.checkpoint_every_s and time.monotonic() - self._checkpointed_at >= cfg.checkpoint_every_s)
        self.policy.after_step(step, evaluating or checkpointing)
        reached = False
        if evaluating:
            self._evaluate(step)
            reached = bool(cfg.target_accuracy) and not last and \
                self.metrics.last_eval["test_accuracy"] >= cfg.target_accuracy
        if checkpointing or reached:
            self._checkpoint(step + 1)
        if reached:
            logger.info("[Coordinator.Trainer] test accuracy %.4f reached the target %.4f after step %d: done",
                        self.metrics.last_eval["test_accuracy"], cfg.target_accuracy, step)
            return "target_accuracy"
        if out_of_time:
            logger.info("[Coordinator.Trainer] %.1f s of training reached the time limit of %g s after step %d: done",
                        self.train_seconds, cfg.time_limit_s, step)
            return "time_limit"
        return None

    def _log_step(self, record: StepRecord) -> None:
        """Count the step's update as applied (the aggregator just applied it) and record it."""
        if self._checkpointed_at is None:  # the time-based checkpoint clock starts with training
            self._checkpointed_at = time.monotonic() - record.seconds
        self.steps_applied += 1
        self.applied_steps[record.step] += 1
        self.ctx.step_seconds.append((record.step, record.seconds))
        local = [u for u in record.used if u.extra]
        if record.beside or local:
            self.ctx.local_work[record.step] = sum(u.contribution.samples * u.factor for u in local)
        self.samples_done += sum(w.contribution.samples for w in record.used)
        self.train_seconds += record.seconds
        logged = self.metrics.train_step(record, lr=self.aggregator.lr,
                                         epoch=epoch_of(record.step, self.job.training.global_batch, self.train_size),
                                         total_steps=self.job.training.steps, log_every=self.job.training.log_every)
        self.time_split.add(logged)

    def _evaluate(self, step: int) -> None:
        started = time.monotonic()
        loss, accuracy, seen = evaluate_dataset(self.model, self.test_set)
        self.metrics.evaluation(step, loss, accuracy, seen, time.monotonic() - started)

    def _checkpoint(self, next_step: int) -> None:
        """Write the set for `next_step` (model, momentum, progress, ledger), then delete every set
        but the last KEEP of this run (older ones, and damaged ones a resume skipped)."""
        started = time.monotonic()
        saved = save_checkpoint(self.run_dir, self.model, self.aggregator.optimizer, {
            "next_step": next_step, "train_seconds": self.train_seconds, "samples_done": self.samples_done,
            "job": self.job.name, "applied_steps": self.applied_steps, **self.policy.state_dict()})
        seconds = time.monotonic() - started
        self.checkpoints = [c for c in self.checkpoints if c.path != saved.path] + [saved]
        self.checkpoints = self.checkpoints[-KEEP:]
        prune(self.run_dir, self.checkpoints)
        size = sum(f.stat().st_size for f in saved.path.iterdir())
        self.metrics.checkpoint(next_step, saved.name, size, seconds)
        logger.info("[Coordinator.Trainer] checkpoint after step %d: %s (%.1f MB in %.2f s)", next_step, saved.name,
                    size / 1e6, seconds)
        self._checkpointed_at = time.monotonic()
