"""The aggregation rule: combining a step's updates into one, and applying it to the master model.

`Aggregator` is built once from the job's `aggregation:` section and owns the rule: which updates
count (late ones within the staleness bound, none past it), how they are weighted, which are
refused (and when a board is quarantined for it), and the server optimizer that applies the
result (the job's SGD, plain SGD when boards keep the momentum, or FedAvg's server step).
The arithmetic is three plain functions of the step's contributions:
1. `screen`: clip an update whose L2 norm exceeds `clip_norm`, reject one whose norm exceeds
   `outlier_factor` x the median norm of the step's updates (NaN/Inf and wrong shapes never get
   this far: the upload itself is refused). Every rejection carries its reason.
2. `staleness_weight`: s(tau) = (1 + tau)^-p for an update computed tau versions ago (FedBuff).
3. `combine`: sum_i samples_i * s(tau_i) * g_i / sum_i samples_i for gradients, which for fresh
   updates is exactly the gradient of the mean loss over all accepted samples; float buffers
   (BatchNorm running statistics) are a proper weighted average, sum_i w_i * b_i / sum_i w_i.
   A local update from a board beside the steps is not part of the step's batch: it adds
   min(n_j, N) * s(tau_j) / N * g_j on top (N the step's own samples, n_j its samples), as if its
   samples were taken in a step of their own at the same learning rate per sample, at most one.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from coordinator.registry import DeviceRegistry
from coordinator.training.noise_scale import NoiseScale
from coordinator.training.steps import Contribution, StepBoard
from edgetrain.config import JobConfig, OptimizerConfig
from edgetrain.training import (
    BUFFER_PREFIX,
    GRAD_PREFIX,
    lr_factor,
    make_optimizer,
    set_learning_rate,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Weighted:
    """A contribution and the staleness factor it enters the average with."""

    contribution: Contribution
    staleness: int = 0
    factor: float = 1.0
    extra: bool = False
    """Samples beside the step's batch (a local update from a board beside the steps): they add
    to the step's update instead of sharing its average (see `combine`)."""


def staleness_weight(tau: int, exponent: float) -> float:
    """s(tau) = (1 + tau)^-exponent; 1 for a fresh update."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    return (1.0 + tau) ** -exponent


def gradient_sq(tensors: Mapping[str, torch.Tensor]) -> float:
    """Squared L2 norm of the gradients among `tensors` (buffers excluded)."""
    return sum(float(torch.linalg.vector_norm(t.float())) ** 2 for n, t in tensors.items() if n.startswith(GRAD_PREFIX))


def update_norm(contribution: Contribution) -> float:
    """L2 norm of a contribution's gradients (buffers excluded)."""
    return math.sqrt(gradient_sq(contribution.tensors))


@dataclass(frozen=True)
class Screening:
    """What `screen` decided for one step's updates."""

    kept: list[Contribution]
    rejected: dict[str, str]
    """device id -> reason."""
    clipped: dict[str, float]
    """device id -> norm before clipping."""


def screen(contributions: Sequence[Contribution], *, clip_norm: float = 0.0,
           outlier_factor: float = 0.0) -> Screening:
    """Clip and reject updates by norm (see the module docstring). Clipping scales in place.

    Each update is judged on its own norm, even when one board sent two in a step (a late one
    and a fresh one under the staleness rule). Without a rule to apply, no norm is computed: they
    are on the step's critical path and a sizeable part of the aggregation's own time."""
    if not clip_norm and not (outlier_factor and len(contributions) >= 3):
        return Screening(list(contributions), {}, {})
    each = [update_norm(c) for c in contributions]
    refused: set[int] = set()
    rejected: dict[str, str] = {}
    if outlier_factor and len(contributions) >= 3:
        median = statistics.median(each)
        for i, c in enumerate(contributions):
            if median > 0 and each[i] > outlier_factor * median:
                refused.add(i)
                rejected[c.device_id] = (f"outlier: update norm {each[i]:.4g} is {each[i] / median:.1f}x the "
                                         f"step's median {median:.4g} (limit {outlier_factor:g}x)")
    kept, clipped = [], {}
    for i, c in enumerate(contributions):
        if i in refused:
            continue
        if clip_norm and each[i] > clip_norm:
            scale = clip_norm / each[i]
            for name, tensor in c.tensors.items():
                if name.startswith(GRAD_PREFIX):
                    c.tensors[name] = tensor * scale
            clipped[c.device_id] = each[i]
        kept.append(c)
    return Screening(kept, rejected, clipped)


def normalized_factors(steps: Mapping[str, int], data: Mapping[str, float],
                       samples: Mapping[str, int]) -> dict[str, float]:
    """FedNova's weights as `combine` factors (Wang et al. 2020): board i took `steps[i]` local
    steps over `samples[i]` samples and holds `data[i]` samples of data; its change d_i enters as
    p_i * tau_eff / tau_i * d_i, with p_i = data_i / sum(data) and tau_eff = sum_i p_i tau_i, instead
    of samples_i / sum(samples) * d_i. The average then moves towards the minimum of
    sum_i p_i f_i whatever the steps each board took; plain averaging over-weights the boards
    that took more."""
    total_data, total_samples = sum(data.values()), sum(samples.values())
    p = {d: data[d] / total_data for d in steps}
    tau_eff = sum(p[d] * steps[d] for d in steps)
    return {d: p[d] * tau_eff / steps[d] * total_samples / samples[d] for d in steps}


def as_gradient(contribution: Contribution) -> None:
    """A local update outside federated rounds (a board beside the steps) in gradient units, in
    place: its change lr x (sum of its local SGD steps' gradients), divided by lr x steps, is the
    mean gradient over its samples, weighted by their count like a shard's."""
    local = contribution.local
    if local is None or not local.lr:
        return
    scale = 1.0 / (local.lr * local.steps)
    for name, tensor in contribution.tensors.items():
        if name.startswith(GRAD_PREFIX):
            contribution.tensors[name] = tensor * scale


def combine(contributions: Sequence[Contribution | Weighted]) -> dict[str, torch.Tensor]:
    """Sample- and staleness-weighted average of every uploaded tensor (see the module docstring)."""
    if not contributions:
        raise ValueError("nothing to combine")
    items = [c if isinstance(c, Weighted) else Weighted(c) for c in contributions]
    total = sum(w.contribution.samples for w in items if not w.extra) or sum(w.contribution.samples for w in items)
    buffer_total = sum(w.contribution.samples * w.factor for w in items)
    out: dict[str, torch.Tensor] = {}
    for item in items:
        c = item.contribution
        grad_weight = (min(c.samples, total) if item.extra else c.samples) * item.factor / total
        buffer_weight = c.samples * item.factor / buffer_total
        for name, tensor in c.tensors.items():
            weight = grad_weight if name.startswith(GRAD_PREFIX) else buffer_weight
            if name in out:
                out[name].add_(tensor, alpha=weight)
            else:
                out[name] = tensor.mul(weight)
    return out


@torch.no_grad()
def apply_update(model: nn.Module, optimizer: torch.optim.Optimizer, combined: dict[str, torch.Tensor]) -> None:
    """Set the combined gradients, take one optimizer step, adopt the averaged buffers.

    Parameters without a gradient in `combined` (a pipeline stage whose host owns it) are left
    alone, and so are their module's buffers."""
    for name, param in model.named_parameters():
        param.grad = combined.get(GRAD_PREFIX + name)
    optimizer.step()
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            if BUFFER_PREFIX + name in combined:
                buffer.copy_(combined[BUFFER_PREFIX + name])
        elif name.endswith("num_batches_tracked"):
            if BUFFER_PREFIX + name.rsplit(".", 1)[0] + ".running_mean" in combined:
                buffer.add_(1)
    optimizer.zero_grad(set_to_none=True)


@dataclass
class Aggregate:
    """What the aggregator did with one step's updates."""

    used: list[Weighted]
    """The updates that went into the step, with their staleness and weight factor."""
    rejected: dict[str, str]
    """Every update refused this step (upload checks, screening, too stale), by device."""
    clipped: dict[str, float]
    """Device -> update norm before clipping."""
    quarantined: list[str]
    """Boards quarantined because of this step's refusals."""
    noise_scale: float | None = None
    """The run's gradient noise scale after this step (coordinator.training.noise_scale; None
    while it cannot be estimated)."""


class Aggregator:
    """The job's aggregation rule and the server optimizer (see the module docstring)."""

    def __init__(self, job: JobConfig, model: nn.Module, registry: DeviceRegistry) -> None:
        self.cfg = job.aggregation
        self.job = job
        self.model = model
        self.registry = registry
        self.keeps_late = self.cfg.rule == "staleness"
        """Late updates stay open and count in a later step, down-weighted (FedBuff)."""
        self.takes_beside = job.planner.enabled and job.planner.local_updates
        """Boards may train beside the steps (coordinator.planning.local_members): their updates
        arrive late by design and count under the same staleness rule."""
        self.federated = self.cfg.federated
        pipelined = job.pipeline.enabled or job.planner.enabled
        self.boards_keep_momentum = job.compression.boards_keep_momentum and not self.federated and not pipelined
        """Momentum correction: boards accumulate the momentum and send it; the server applies plain
        SGD (pipeline stages send plain gradients, so pipelined jobs keep the momentum here)."""
        if self.federated:  # the outer step on the averaged update (with momentum: DiLoCo's outer Nesterov)
            fed = job.federated
            server = OptimizerConfig(lr=fed.server_lr, momentum=fed.server_momentum, nesterov=fed.server_momentum > 0,
                                     weight_decay=0.0, schedule="constant")
        elif self.boards_keep_momentum:
            server = replace(job.optimizer, momentum=0.0, nesterov=False)
        else:
            server = job.optimizer
        self.optimizer = make_optimizer(model, server)
        self.lr = 0.0
        """The learning rate of the last step (a federated round's: the boards' local one)."""
        self._late: list[Contribution] = []
        self._late_rejected: dict[str, str] = {}
        self.noise = NoiseScale()
        """The gradient noise scale, from the data-parallel steps whose shard gradients arrive as
        the boards computed them."""

    @property
    def board_momentum(self) -> float:
        """The momentum boards accumulate themselves (0: the server's optimizer has it)."""
        return self.job.optimizer.momentum if self.boards_keep_momentum else 0.0

    @property
    def versions_kept(self) -> int:
        """Parameter versions to keep serving: late boards may still fetch the ones they started on."""
        if self.keeps_late:
            return self.cfg.staleness_bound + 1
        return 2 if self.takes_beside else 1  # a board beside the steps may take its work a step late

    def step_lr(self, step: int) -> float:
        """The learning rate of `step` under the job's schedule (what boards use locally)."""
        opt = self.job.optimizer
        return opt.lr * lr_factor(step, self.job.training.steps, opt)

    def collect_late(self, board: StepBoard, step: int) -> None:
        """Keep late answers that arrived (they enter the next update); close tickets too stale to count."""
        if self.keeps_late or self.takes_beside:
            late, rejected = board.take_late(oldest_step=step - self.cfg.staleness_bound)
            self._late += late
            self._late_rejected.update(rejected)
            for device_id, samples, seconds, local in board.take_expired():  # it is slower than its estimate
                if local:  # beside the steps: its next local work is smaller
                    self.registry.pace_local(device_id, landed=False)
                else:
                    self.registry.observe_late(device_id, samples, seconds)

    def apply(self, step: int, board: StepBoard, fresh: Sequence[Contribution], refused: Mapping[str, str],
              factors: Mapping[str, float] | None = None) -> Aggregate:
        """Combine this step's updates (and late ones) and take one optimizer step. When none is
        usable, nothing is applied (`used` is empty, the parameters and optimizer state stay as
        they were) and the step loop redoes the step; refusals still count towards quarantine.
        `factors` (device -> multiplier of its weight) is the round's own weighting: FedNova's."""
        self.collect_late(board, step)
        late, self._late = self._late, []
        rejected = {**refused, **self._late_rejected}
        self._late_rejected = {}
        usable, stale = list(fresh), {}
        beside = set()
        if not self.federated:
            for c in (*fresh, *late):
                if c.local is not None:
                    beside.add(id(c))
                as_gradient(c)
        for c in late:
            tau = step - c.param_version
            if tau > self.cfg.staleness_bound:
                stale[c.device_id] = rejected[c.device_id] = f"stale: computed on version {c.param_version}, " \
                                                             f"{tau} steps old (bound {self.cfg.staleness_bound})"
            else:
                usable.append(c)
            if id(c) in beside:
                self.registry.pace_local(c.device_id, landed=tau <= self.cfg.staleness_bound)
        screening = screen(usable, clip_norm=self.cfg.clip_norm, outlier_factor=self.cfg.outlier_factor) if usable \
            else Screening([], {}, {})
        rejected.update(screening.rejected)
        used = [Weighted(c, step - c.param_version, staleness_weight(step - c.param_version, self.cfg.staleness_exponent)
                         * (factors or {}).get(c.device_id, 1.0), extra=id(c) in beside) for c in screening.kept]
        if self.federated:
            self.lr = self.step_lr(step)
        else:
            self.lr = set_learning_rate(self.optimizer, step, self.job.training.steps, self.job.optimizer)
        if used:
            combined = combine(used)
            self._observe_noise(used, combined)
            apply_update(self.model, self.optimizer, combined)
        else:
            logger.warning("[Coordinator.Aggregator] step %d: no usable update; nothing applied", step)
        for item in used:
            c = item.contribution
            self.registry.observe_step(c.device_id, c.samples, c.compute_s, c.comm_s, c.energy_j,
                                       turnaround_s=c.turnaround_s, step=c.step)
        misbehaved = {d: r for d, r in rejected.items() if r is not stale.get(d)}  # slowness is not misbehaviour
        return Aggregate(used, rejected, screening.clipped, self._quarantine(step, misbehaved), self.noise.value)

    def _observe_noise(self, used: Sequence[Weighted], combined: Mapping[str, torch.Tensor]) -> None:
        """Feed the noise-scale estimate with a step of fresh, uncompressed shard gradients."""
        if self.federated or self.boards_keep_momentum or len(used) < 2 or any(
                w.staleness or w.contribution.stage is not None or w.contribution.codec != "none"
                or w.contribution.local is not None for w in used):
            return
        self.noise.observe([(w.contribution.samples, gradient_sq(w.contribution.tensors)) for w in used],
                           (sum(w.contribution.samples for w in used), gradient_sq(combined)))

    def _quarantine(self, step: int, rejected: Mapping[str, str]) -> list[str]:
        quarantined = []
        for device_id, reason in rejected.items():
            if self.registry.note_rejection(device_id, step, reason, limit=self.cfg.quarantine_after,
                                            window=self.cfg.quarantine_window,
                                            quarantine_steps=self.cfg.quarantine_steps):
                quarantined.append(device_id)
        return quarantined
