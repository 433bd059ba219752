"""Single-process SGD on the same global batches as a distributed run: the ground truth."""

from __future__ import annotations

import torch

from coordinator.training.checkpoint import model_state
from edgetrain.config import JobConfig
from edgetrain.training import single_process_sgd


def reference_state(job: JobConfig, steps: int | None = None) -> dict[str, torch.Tensor]:
    """Model state after `steps` (default: all) single-process steps of `job`."""
    return single_process_sgd(job, steps)


def checkpoint_state(run_dir) -> dict[str, torch.Tensor]:
    """The model state of the newest complete checkpoint a coordinator wrote."""
    return model_state(run_dir)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element-wise difference over all tensors (the key sets must match)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())
