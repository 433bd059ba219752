"""Combining devices' contributions into one update, and applying it to the master model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from coordinator.steps import Contribution
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX


def combine(contributions: Sequence[Contribution]) -> dict[str, torch.Tensor]:
    """Sample-weighted average of every uploaded tensor (gradients and BN running statistics).

    Each device sends the gradient of its mean loss; weighting by samples / total gives the
    gradient of the mean loss over all accepted samples.
    """
    if not contributions:
        raise ValueError("nothing to combine")
    total = sum(c.samples for c in contributions)
    out: dict[str, torch.Tensor] = {}
    for contribution in contributions:
        weight = contribution.samples / total
        for name, tensor in contribution.tensors.items():
            if name in out:
                out[name].add_(tensor, alpha=weight)
            else:
                out[name] = tensor.mul(weight)
    return out


@torch.no_grad()
def apply_update(model: nn.Module, optimizer: torch.optim.Optimizer, combined: dict[str, torch.Tensor]) -> None:
    """Set the combined gradients, take one optimizer step, adopt the averaged buffers."""
    for name, param in model.named_parameters():
        param.grad = combined[GRAD_PREFIX + name]
    optimizer.step()
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            buffer.copy_(combined[BUFFER_PREFIX + name])
        elif name.endswith("num_batches_tracked"):
            buffer.add_(1)
    optimizer.zero_grad(set_to_none=True)
