"""Synchronous data-parallel training driven by the coordinator.

Each step: publish the parameters, split the step's global batch across the ready devices
(proportional to measured speed, or equally), wait for their gradients, redo the step with the
remaining devices if one failed or missed the deadline, then combine the accepted gradients
weighted by samples and take one optimizer step. The master copy of the model and the optimizer
live here; devices only ever compute gradients.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.aggregate import apply_update, combine
from coordinator.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from coordinator.metrics import MetricsLog
from coordinator.registry import DeviceRegistry
from coordinator.steps import Assignment, AttemptOutcome, StepBoard
from edgetrain.config import JobConfig
from edgetrain.data import make_batch
from edgetrain.sampling import batch_indices, epoch_of
from edgetrain.split import SpeedEstimate, predicted_step_seconds, split_equal, split_proportional
from edgetrain.tensors import pack
from edgetrain.training import evaluate, make_optimizer, set_learning_rate, state_tensors

logger = logging.getLogger(__name__)


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


class DataParallelTrainer:
    """Runs one job's steps over the devices in `registry`, through `board`."""

    def __init__(self, job: JobConfig, registry: DeviceRegistry, board: StepBoard, model: torch.nn.Module,
                 train_size: int, test_set, run_dir: Path, stop: threading.Event | None = None) -> None:
        self.job = job
        self.registry = registry
        self.board = board
        self.model = model
        self.train_size = train_size
        self.test_set = test_set
        self.run_dir = run_dir
        self.stop = stop or threading.Event()
        self.optimizer = make_optimizer(model, job.optimizer)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.start_step = 0
        self.train_seconds = 0.0
        self.samples_done = 0
        self.lr = 0.0

    def resume_if_possible(self) -> None:
        """Continue from the run directory's checkpoint, if there is one."""
        if not has_checkpoint(self.run_dir):
            return
        state = load_checkpoint(self.run_dir, self.model, self.optimizer)
        self.start_step = state["next_step"]
        self.train_seconds, self.samples_done = state["train_seconds"], state["samples_done"]
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
                if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                    self._evaluate(step)
                if last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
                    self._checkpoint(step + 1)
            self.board.finish(f"job {self.job.name} completed {cfg.steps} steps")
            return self.metrics.last_eval
        except BaseException as e:
            self.board.finish(f"job {self.job.name} stopped: {e}")
            raise

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

    def _run_step(self, step: int) -> StepRecord:
        cfg = self.job.training
        metas, payload = pack(state_tensors(self.model))
        self.board.publish_parameters(step, metas, payload)
        indices = batch_indices(step, cfg.global_batch, self.train_size, self.job.seed)
        started = time.monotonic()
        for attempt in range(cfg.max_attempts):
            speeds = self._wait_for_devices(1)
            shares = self._split(len(indices), speeds)
            assignments = self._assign(step, attempt, indices, shares)
            self.board.open_attempt(assignments)
            deadline = time.monotonic() + self._timeout(shares, speeds)
            outcome = self.board.wait_attempt(deadline, self.registry.is_alive)
            if self.stop.is_set():
                raise JobAborted(f"stopped during step {step}")
            for device_id in outcome.missing:
                self.registry.drop(device_id, f"no result for step {step} attempt {attempt}")
            if not outcome.missing:
                break
            logger.warning("[Coordinator.Trainer] step %d attempt %d: %s failed; redoing the step with "
                           "the remaining devices", step, attempt, ", ".join(outcome.missing))
        else:
            raise JobAborted(f"step {step} failed on all {cfg.max_attempts} attempts")
        self._apply(step, outcome)
        seconds = time.monotonic() - started
        return StepRecord(step, attempt + 1, seconds, outcome, {d: len(a.indices) for d, a in assignments.items()})

    def _split(self, total: int, speeds: dict[str, SpeedEstimate]) -> dict[str, int]:
        if self.job.training.split == "equal":
            return split_equal(total, list(speeds))
        return split_proportional(total, speeds)

    def _assign(self, step: int, attempt: int, indices: list[int], shares: dict[str, int]) -> dict[str, Assignment]:
        out, start = {}, 0
        for device_id, count in shares.items():
            if count:
                out[device_id] = Assignment(step, attempt, step, tuple(indices[start : start + count]),
                                            self.job.dataset.augment, self.job.seed)
                start += count
        return out

    def _timeout(self, shares: dict[str, int], speeds: dict[str, SpeedEstimate]) -> float:
        configured = self.job.training.step_timeout_s
        return configured if configured > 0 else 3 * predicted_step_seconds(shares, speeds) + 10.0

    def _apply(self, step: int, outcome: AttemptOutcome) -> None:
        accepted = list(outcome.accepted.values())
        self.lr = set_learning_rate(self.optimizer, step, self.job.training.steps, self.job.optimizer)
        if accepted:
            apply_update(self.model, self.optimizer, combine(accepted))
        else:
            logger.error("[Coordinator.Trainer] every contribution was rejected: no update this step")
        for c in accepted:
            self.registry.observe_step(c.device_id, c.samples, c.compute_s, c.comm_s, c.energy_j)

    def _log_step(self, record: StepRecord) -> None:
        samples = sum(c.samples for c in record.outcome.accepted.values())
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
            "job": self.job.name})
