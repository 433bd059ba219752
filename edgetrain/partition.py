"""How federated rounds split the training set among boards: each partition is a fixed list of
sample indices, a pure function of the labels, the scheme and the seed (the coordinator computes
it; boards are only ever sent indices of their own partition).

Schemes:

- ``iid``: a seeded permutation dealt round-robin, so every partition has the same size and, in
  expectation, the same class mix (needs no labels).
- ``dirichlet`` (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data Distribution"):
  for each class, the fractions of its samples that go to each partition are drawn from
  Dirichlet(alpha, ..., alpha). Small alpha (0.1) gives partitions dominated by one or two
  classes; large alpha (100) approaches iid. Draws are repeated (seeded) until every partition
  has at least `MIN_PARTITION_SAMPLES` samples.
- ``classes``: per-class skew as in McMahan et al. 2017's pathological split: partition p holds
  `classes_per_partition` classes (p·k, p·k + 1, ... modulo the class count, after a seeded
  shuffle of the classes), and each class's samples are dealt evenly among the partitions that
  hold it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

PARTITIONINGS = ("iid", "dirichlet", "classes")
MIN_PARTITION_SAMPLES = 10
"""A Dirichlet draw that leaves a partition with fewer samples is drawn again."""
_MAX_DRAWS = 1000


def partition_members(labels: Sequence[int], partitions: int, *, scheme: str = "iid", alpha: float = 0.5,
                      classes_per_partition: int = 2, seed: int = 0) -> list[list[int]]:
    """The sample indices of each of `partitions` partitions (disjoint; their union is every
    index of `labels`), by `scheme` (see the module docstring). Raises ValueError when the
    scheme cannot give every partition samples."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if partitions > len(labels):
        raise ValueError(f"{partitions} partitions of {len(labels)} samples: some would be empty")
    if scheme == "iid":
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed + 7919))
        return [order[p::partitions].tolist() for p in range(partitions)]
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(int(label), []).append(index)
    rng = random.Random(f"{scheme}:{seed}")
    for members in by_class.values():
        rng.shuffle(members)
    classes = sorted(by_class)
    if scheme == "dirichlet":
        return _dirichlet(by_class, classes, partitions, alpha, rng)
    if scheme == "classes":
        return _by_classes(by_class, classes, partitions, classes_per_partition, rng)
    raise ValueError(f"unknown partitioning {scheme!r}; valid: {', '.join(PARTITIONINGS)}")


def _dirichlet(by_class: dict[int, list[int]], classes: list[int], partitions: int, alpha: float,
               rng: random.Random) -> list[list[int]]:
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    need = min(MIN_PARTITION_SAMPLES, sum(map(len, by_class.values())) // partitions)
    for _ in range(_MAX_DRAWS):
        out: list[list[int]] = [[] for _ in range(partitions)]
        for c in classes:
            members = by_class[c]
            gammas = [rng.gammavariate(alpha, 1.0) for _ in range(partitions)]
            total = sum(gammas) or 1.0
            cuts, acc = [], 0.0
            for g in gammas[:-1]:
                acc += g / total
                cuts.append(round(acc * len(members)))
            for p, (lo, hi) in enumerate(zip([0] + cuts, cuts + [len(members)])):
                out[p].extend(members[lo:hi])
        if min(map(len, out)) >= need:
            return [sorted(p) for p in out]
    raise ValueError(f"dirichlet alpha={alpha}: no draw in {_MAX_DRAWS} gave each of {partitions} partitions "
                     f"{need} samples; use a larger alpha or fewer partitions")


def _by_classes(by_class: dict[int, list[int]], classes: list[int], partitions: int, per_partition: int,
                rng: random.Random) -> list[list[int]]:
    if not 1 <= per_partition <= len(classes):
        raise ValueError(f"classes_per_partition must be in [1, {len(classes)}], got {per_partition}")
    if partitions * per_partition < len(classes):
        raise ValueError(f"{partitions} partitions x {per_partition} classes leave classes without a partition")
    order = list(classes)
    rng.shuffle(order)
    held = [[order[(p * per_partition + j) % len(order)] for j in range(per_partition)] for p in range(partitions)]
    holders: dict[int, list[int]] = {c: [p for p in range(partitions) if c in held[p]] for c in classes}
    out: list[list[int]] = [[] for _ in range(partitions)]
    for c in classes:
        for i, index in enumerate(by_class[c]):
            out[holders[c][i % len(holders[c])]].append(index)
    return [sorted(p) for p in out]


def round_indices(members: Sequence[int], round_: int, count: int) -> list[int]:
    """A board's `count` samples for round `round_`: its partition read cyclically, so its data
    never leaves its partition and successive rounds move through all of it."""
    start = (round_ * count) % len(members)
    return [members[(start + i) % len(members)] for i in range(count)]


def class_counts(labels: Sequence[int], members: Sequence[int]) -> dict[int, int]:
    """How many samples of each class a partition holds (for logs and reports)."""
    counts: dict[int, int] = {}
    for index in members:
        counts[int(labels[index])] = counts.get(int(labels[index]), 0) + 1
    return dict(sorted(counts.items()))
