"""Which sample indices make up each step's global batch.

Every epoch is a fresh seeded permutation of the training set; steps take consecutive slices of
the concatenated epochs, so every sample of an epoch is used exactly once (a batch may straddle
two epochs). Any process computes the same indices for the same (seed, size, batch, step).
"""

from __future__ import annotations

import torch


def epoch_permutation(epoch: int, dataset_size: int, seed: int) -> torch.Tensor:
    """The sample order of one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


def batch_indices(step: int, batch_size: int, dataset_size: int, seed: int) -> list[int]:
    """Global sample indices of `step` (0-based)."""
    if batch_size <= 0 or dataset_size <= 0:
        raise ValueError(f"batch_size and dataset_size must be > 0, got {batch_size}, {dataset_size}")
    start = step * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), dataset_size)
        take = min(batch_size - len(out), dataset_size - offset)
        out += epoch_permutation(epoch, dataset_size, seed)[offset : offset + take].tolist()
    return out


def epoch_of(step: int, batch_size: int, dataset_size: int) -> float:
    """Fractional epoch reached after `step` + 1 steps."""
    return (step + 1) * batch_size / dataset_size
