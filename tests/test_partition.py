"""Federated partitions: iid, Dirichlet non-IID and a few classes each (edgetrain.partition)."""

from __future__ import annotations

import pytest
import torch

from edgetrain.partition import class_counts, partition_members, round_indices

LABELS = [i % 10 for i in range(2000)]


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_partitions_are_disjoint_cover_every_sample_and_repeat_for_a_seed(scheme: str) -> None:
    parts = partition_members(LABELS, 5, scheme=scheme, seed=3)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(LABELS)))  # disjoint and complete
    assert partition_members(LABELS, 5, scheme=scheme, seed=3) == parts
    assert partition_members(LABELS, 5, scheme=scheme, seed=4) != parts


def test_iid_is_the_seeded_permutation_dealt_round_robin() -> None:
    # the split federated runs used before non-IID schemes existed: same seed, same partitions
    order = torch.randperm(len(LABELS), generator=torch.Generator().manual_seed(7 + 7919))
    assert partition_members(LABELS, 4, seed=7) == [order[p::4].tolist() for p in range(4)]


def _skew(parts: list[list[int]]) -> float:
    """Mean over partitions of the largest class's fraction (iid over 10 classes: about 0.1)."""
    fractions = [max(c.values()) / sum(c.values()) for c in (class_counts(LABELS, p) for p in parts)]
    return sum(fractions) / len(fractions)


def test_a_small_dirichlet_alpha_skews_the_classes_and_a_large_one_does_not() -> None:
    skews = {alpha: sum(_skew(partition_members(LABELS, 5, scheme="dirichlet", alpha=alpha, seed=s))
                        for s in range(5)) / 5 for alpha in (0.1, 1.0, 100.0)}
    iid = _skew(partition_members(LABELS, 5, seed=0))
    assert skews[0.1] > 0.4 > skews[1.0] > skews[100.0]
    assert skews[100.0] < 0.15 and iid < 0.15
    for p in partition_members(LABELS, 5, scheme="dirichlet", alpha=0.1, seed=0):
        assert len(p) >= 10


def test_class_partitions_hold_exactly_their_classes_evenly() -> None:
    parts = partition_members(LABELS, 5, scheme="classes", classes_per_partition=2, seed=0)
    counts = [class_counts(LABELS, p) for p in parts]
    assert all(len(c) == 2 for c in counts)
    assert sorted(k for c in counts for k in c) == list(range(10))  # each class in one partition here
    assert all(v == 200 for c in counts for v in c.values())
    # more partitions than classes / k: a class is shared evenly among its holders
    shared = [class_counts(LABELS, p) for p in partition_members(LABELS, 10, scheme="classes",
                                                                  classes_per_partition=3, seed=1)]
    assert all(len(c) == 3 for c in shared)
    assert sum(sum(c.values()) for c in shared) == len(LABELS)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"partitions": 0}, "partitions must be >= 1"),
    ({"partitions": 3000}, "some would be empty"),
    ({"partitions": 3, "scheme": "zipf"}, "unknown partitioning 'zipf'"),
    ({"partitions": 3, "scheme": "dirichlet", "alpha": 0.0}, "alpha must be > 0"),
    ({"partitions": 3, "scheme": "classes", "classes_per_partition": 11}, "classes_per_partition must be in"),
    ({"partitions": 2, "scheme": "classes", "classes_per_partition": 3}, "leave classes without a partition"),
])
def test_impossible_partitionings_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    partitions = kwargs.pop("partitions")
    with pytest.raises(ValueError, match=message):
        partition_members(LABELS, partitions, **kwargs)


def test_rounds_read_a_partition_cyclically() -> None:
    members = [5, 9, 12, 30, 41]
    assert round_indices(members, 0, 3) == [5, 9, 12]
    assert round_indices(members, 1, 3) == [30, 41, 5]
    assert round_indices(members, 2, 3) == [9, 12, 30]
