"""Single-process SGD on the same global batches as a distributed run: the ground truth."""

from __future__ import annotations

import torch

from coordinator.training.checkpoint import model_state
from edgetrain.config import JobConfig
from edgetrain.data import load_dataset, make_batch
from edgetrain.models import build_model
from edgetrain.sampling import batch_indices
from edgetrain.training import make_optimizer, set_learning_rate


def reference_state(job: JobConfig, steps: int | None = None) -> dict[str, torch.Tensor]:
    """Model state after `steps` (default: all) single-process steps of `job`."""
    model = build_model(job.model, seed=job.seed)
    optimizer = make_optimizer(model, job.optimizer)
    dataset = load_dataset(job.dataset, train=True)
    model.train()
    for step in range(job.training.steps if steps is None else steps):
        indices = batch_indices(step, job.training.global_batch, len(dataset), job.seed)
        x, y = make_batch(dataset, indices, augment=job.dataset.augment, seed=job.seed, step=step)
        set_learning_rate(optimizer, step, job.training.steps, job.optimizer)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def checkpoint_state(run_dir) -> dict[str, torch.Tensor]:
    """The model state of the newest complete checkpoint a coordinator wrote."""
    return model_state(run_dir)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element-wise difference over all tensors (the key sets must match)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())
