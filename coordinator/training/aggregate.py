"""Combining devices' contributions into one update, and applying it to the master model.

Three stages, each a plain function of the step's contributions:
1. `screen`: clip an update whose L2 norm exceeds `clip_norm`, reject one whose norm exceeds
   `outlier_factor` x the median norm of the step's updates (NaN/Inf and wrong shapes never get
   this far: the upload itself is refused). Every rejection carries its reason.
2. `staleness_weight`: s(tau) = (1 + tau)^-p for an update computed tau versions ago (FedBuff).
3. `combine`: sum_i samples_i * s(tau_i) * g_i / sum_i samples_i for gradients, which for fresh
   updates is exactly the gradient of the mean loss over all accepted samples; float buffers
   (BatchNorm running statistics) are a proper weighted average, sum_i w_i * b_i / sum_i w_i.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from coordinator.training.steps import Contribution
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX


@dataclass(frozen=True)
class Weighted:
    """A contribution and the staleness factor it enters the average with."""

    contribution: Contribution
    staleness: int = 0
    factor: float = 1.0


def staleness_weight(tau: int, exponent: float) -> float:
    """s(tau) = (1 + tau)^-exponent; 1 for a fresh update."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    return (1.0 + tau) ** -exponent


def update_norm(contribution: Contribution) -> float:
    """L2 norm of a contribution's gradients (buffers excluded)."""
    total = 0.0
    for name, tensor in contribution.tensors.items():
        if name.startswith(GRAD_PREFIX):
            total += float(torch.linalg.vector_norm(tensor.float())) ** 2
    return math.sqrt(total)


@dataclass(frozen=True)
class Screening:
    """What `screen` decided for one step's updates."""

    kept: list[Contribution]
    rejected: dict[str, str]
    """device id -> reason."""
    clipped: dict[str, float]
    """device id -> norm before clipping."""
    norms: dict[str, float]


def screen(contributions: Sequence[Contribution], *, clip_norm: float = 0.0,
           outlier_factor: float = 0.0) -> Screening:
    """Clip and reject updates by norm (see the module docstring). Clipping scales in place."""
    norms = {c.device_id: update_norm(c) for c in contributions}
    rejected: dict[str, str] = {}
    if outlier_factor and len(contributions) >= 3:
        median = statistics.median(norms.values())
        for c in contributions:
            if median > 0 and norms[c.device_id] > outlier_factor * median:
                rejected[c.device_id] = (f"outlier: update norm {norms[c.device_id]:.4g} is "
                                         f"{norms[c.device_id] / median:.1f}x the step's median {median:.4g} "
                                         f"(limit {outlier_factor:g}x)")
    kept, clipped = [], {}
    for c in contributions:
        if c.device_id in rejected:
            continue
        if clip_norm and norms[c.device_id] > clip_norm:
            scale = clip_norm / norms[c.device_id]
            for name, tensor in c.tensors.items():
                if name.startswith(GRAD_PREFIX):
                    c.tensors[name] = tensor * scale
            clipped[c.device_id] = norms[c.device_id]
        kept.append(c)
    return Screening(kept, rejected, clipped, norms)


def combine(contributions: Sequence[Contribution | Weighted]) -> dict[str, torch.Tensor]:
    """Sample- and staleness-weighted average of every uploaded tensor (see the module docstring)."""
    if not contributions:
        raise ValueError("nothing to combine")
    items = [c if isinstance(c, Weighted) else Weighted(c) for c in contributions]
    total = sum(w.contribution.samples for w in items)
    buffer_total = sum(w.contribution.samples * w.factor for w in items)
    out: dict[str, torch.Tensor] = {}
    for item in items:
        c = item.contribution
        grad_weight = c.samples * item.factor / total
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
