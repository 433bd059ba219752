"""Which sample indices make up each step's global batch.

Every epoch is a fresh seeded permutation of the training set; steps take consecutive slices of
the concatenated epochs, so every sample of an epoch is used exactly once (a batch may straddle
two epochs). Any process computes the same indices for the same (seed, size, batch, step).
A board with its own data walks through its own permutations the same way, seeded by the job's
seed and its name (`board_seed`).
"""

from __future__ import annotations

import zlib

import torch


def epoch_permutation(epoch: int, dataset_size: int, seed: int) -> torch.Tensor:
    """The sample order of one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


def batch_indices(step: int, batch_size: int, dataset_size: int, seed: int) -> list[int]:
    """Global sample indices of `step` (0-based)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    return indices_from(step * batch_size, batch_size, dataset_size, seed)


def indices_from(start: int, count: int, dataset_size: int, seed: int) -> list[int]:
    """`count` indices from position `start` of the concatenated epoch permutations."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if dataset_size <= 0:
        raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
    out: list[int] = []
    while len(out) < count:
        epoch, offset = divmod(start + len(out), dataset_size)
        take = min(count - len(out), dataset_size - offset)
        out += epoch_permutation(epoch, dataset_size, seed)[offset : offset + take].tolist()
    return out


def board_seed(seed: int, name: str) -> int:
    """The seed of a board's own sample order (its own data, edgetrain client --local-data)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 40)  # epoch_permutation multiplies it again


def epoch_of(step: int, batch_size: int, dataset_size: int) -> float:
    """Fractional epoch reached after `step` + 1 steps."""
    return (step + 1) * batch_size / dataset_size
