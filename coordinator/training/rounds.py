"""Round policies: what each board does in one attempt of a step, and when the attempt counts.

The step loop (trainer.py) is the same for every mode: publish the parameters, ask the job's
`RoundPolicy` for an attempt (`configure`), open it on the step board, wait for it, ask the policy
whether it counts (`complete`, else the step is redone), and hand the policy's contributions
(`collect`) to the aggregator. One policy per mode, picked once from the job by
`make_round_policy` — adding a mode means adding a policy, and a line there:

- `DataParallelRound` (data_parallel.py): shards of the global batch split by measured speed;
  without a deadline it waits for every board and redoes the step if one died, with one
  (`Deadline`) the step closes at a multiple of its predicted time (deadline / staleness rules).
- `FederatedRound` (data_parallel.py): every board trains locally on its own data partition.
- `PipelineRound` (pipeline_round.py): the plan in force (a hand plan, a plan file, or the live
  planner's) as pipeline stages and DP shards, all or nothing.

A policy builds each attempt from one snapshot of the fleet (`Fleet.snapshot`), so an attempt's
assignments come from one consistent view of the boards.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from coordinator.registry import DeviceRecord, DeviceRegistry
from coordinator.training.metrics import MetricsLog
from coordinator.training.parameters import ParameterStore
from coordinator.training.steps import AttemptOutcome, Contribution, StepBoard
from edgetrain import transport
from edgetrain.config import JobConfig
from edgetrain.split import SpeedEstimate
from edgetrain.work import Assignment

if TYPE_CHECKING:
    from coordinator.training.aggregator import Aggregator

logger = logging.getLogger(__name__)


class JobAborted(RuntimeError):
    """The job cannot go on (a step failed or brought no usable update on every attempt, or it
    was stopped)."""


@dataclass(frozen=True)
class Round:
    """One attempt of a step: each board's work, and how to wait for it."""

    step: int
    attempt: int
    assignments: dict[str, Assignment]
    timeout_s: float
    """How long after it opens the attempt ends, answered or not."""
    keep_late: bool = False
    """Unanswered tickets stay open past the deadline (their updates count later, down-weighted)."""
    all_or_nothing: bool = False
    """The attempt fails as soon as one board fails or leaves (a pipeline)."""
    ends_on_loss: bool = False
    """The attempt ends as soon as one board leaves: it cannot count without it (synchronous data
    parallelism), so the redo starts now instead of after the others' useless uploads."""
    predicted_s: float | None = None
    """The step time the split predicts from the boards' measured speeds and links (None: no
    prediction, e.g. a pipeline round: its plan carries one)."""
    beside: dict[str, Assignment] = field(default_factory=dict)
    """Work of boards training beside the step (local updates): handed out with the attempt, never
    waited for; their updates count when they arrive, under the staleness rule."""


@dataclass
class Collected:
    """What an attempt that counted contributes to the step."""

    contributions: list[Contribution]
    """The updates to aggregate (a pipeline's hosts merged into one)."""
    stages: dict[str, dict] = field(default_factory=dict)
    """Pipeline hosts: stage, compute and wait seconds, peak activation bytes."""
    factors: dict[str, float] = field(default_factory=dict)
    """Device -> multiplier of its update's weight (federated rounds normalised by work: FedNova)."""


@dataclass(frozen=True)
class Fleet:
    """The boards as the registry saw them at one moment (one snapshot per attempt)."""

    records: dict[str, DeviceRecord]

    @classmethod
    def snapshot(cls, registry: DeviceRegistry) -> Fleet:
        """The registry's records now."""
        return cls({r.device_id: r for r in registry.snapshot()})

    def ready(self) -> dict[str, SpeedEstimate]:
        """Boards that may get work: alive, profiled, not quarantined; device id -> speed."""
        return {d: r.speed for d, r in self.records.items() if r.ready and not r.quarantined}

    def link_mbit(self, device_id: str) -> float | None:
        """The board's newest measured link rate (None: not measured)."""
        record = self.records.get(device_id)
        sample = record.latest_telemetry if record else None
        return sample.link_mbit_per_s if sample else None

    def name(self, device_id: str) -> str:
        """The board name of a device id."""
        return self.records[device_id].name


@dataclass
class RoundContext:
    """What every round policy works with."""

    job: JobConfig
    registry: DeviceRegistry
    board: StepBoard
    store: ParameterStore
    model: torch.nn.Module
    aggregator: Aggregator
    metrics: MetricsLog
    stop: threading.Event
    train_size: int
    step_seconds: list[tuple[int, float]] = field(default_factory=list)
    """(step, seconds) of every step trained so far (the live planner judges its plan by them)."""
    local_work: dict[int, float] = field(default_factory=dict)
    """Steps that handed out or applied local work of boards beside the steps -> the local samples
    they applied, times their aggregation weight (the live planner judges local updates by them)."""
    board_security: transport.Security = transport.INSECURE
    """How the coordinator dials boards (their StagePeer endpoints): as the gateway, under mutual
    TLS, unless the coordinator serves --insecure."""

    def wait_for_boards(self, count: int, grace_s: float = 0.0) -> dict[str, SpeedEstimate]:
        """Block until `count` boards are ready, or (`grace_s` > 0) until `grace_s` seconds passed
        with at least one ready; JobAborted when stopped first."""
        logged = False
        give_up_at = time.monotonic() + grace_s if grace_s else None
        while not self.stop.is_set():
            left = math.inf if give_up_at is None else give_up_at - time.monotonic()
            # past the grace, the first ready board is enough: wake for it
            speeds = self.registry.wait_ready(count if left > 0 else 1, timeout_s=min(1.0, left) if left > 0 else 1.0)
            if len(speeds) >= count:
                return speeds
            if speeds and give_up_at is not None and time.monotonic() >= give_up_at:
                logger.warning("[Coordinator.Trainer] start grace of %.0f s over: starting with %d of %d device(s) "
                               "(%s); the others join when they come", grace_s, len(speeds), count,
                               ", ".join(sorted(speeds)))
                return speeds
            if not logged:
                logger.info("[Coordinator.Trainer] waiting for %d ready device(s), have %d%s", count, len(speeds),
                            f" (or {grace_s:.0f} s, then with those there)" if grace_s else "")
                logged = True
        raise JobAborted("stopped while waiting for devices")


class RoundPolicy:
    """A training mode: what each board does in an attempt, and when the attempt counts."""

    plans: list[dict]
    """Plans put in force (hybrid mode: step, kind, predicted step seconds); empty otherwise."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.plans = []
        self.failures: list[dict] = []
        """Failed attempts and lost state since the last committed step (for the step's record)."""

    def configure(self, step: int, attempt: int, indices: list[int]) -> Round | None:
        """Each board's work in this attempt of `step` on the global batch `indices`; None when
        the attempt cannot run (it counts as failed and the step is tried again)."""
        raise NotImplementedError

    def complete(self, round_: Round, outcome: AttemptOutcome, elapsed_s: float) -> bool:
        """Whether the attempt's results are used (else the step is redone); `elapsed_s`: how long
        it was open."""
        raise NotImplementedError

    def collect(self, round_: Round, outcome: AttemptOutcome) -> Collected:
        """The contributions of an attempt that counted."""
        return Collected(list(outcome.accepted.values()))

    def committed(self, round_: Round) -> None:
        """The step of `round_` was applied (owned stages apply it on their hosts next time)."""

    def after_step(self, step: int, saving: bool) -> None:
        """`step` was applied; `saving`: an evaluation or checkpoint follows, so the master copy
        must hold everything (stages whose hosts own their state are pulled back)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the policy (e.g. federated data partitions)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict`."""

    def close(self) -> None:
        """Release channels and threads."""


def make_round_policy(ctx: RoundContext) -> RoundPolicy:
    """The job's round policy (see the module docstring)."""
    from coordinator.training.data_parallel import DataParallelRound, Deadline, FederatedRound
    from coordinator.training.pipeline_round import PipelineRound
    from coordinator.training.plan_sources import plan_source

    job = ctx.job
    agg = job.aggregation
    deadline = Deadline(agg, keep_late=ctx.aggregator.keeps_late) \
        if agg.deadline == "predicted" or ctx.aggregator.keeps_late else None
    if job.pipeline.enabled or job.planner.enabled:
        return PipelineRound(ctx, plan_source(ctx), DataParallelRound(ctx, deadline))
    if agg.federated:
        return FederatedRound(ctx, deadline)
    return DataParallelRound(ctx, deadline)
