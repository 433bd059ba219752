"""Tests for edgetrain.sampling: which samples make up each step's global batch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.sampling import batch_indices, epoch_of, epoch_permutation

pytestmark = pytest.mark.timeout(60)


def _concatenated(steps: int, batch: int, size: int, seed: int) -> list[int]:
    return [i for step in range(steps) for i in batch_indices(step, batch, size, seed)]


def test_every_sample_used_once_per_epoch_with_a_straddling_batch() -> None:
    # Prepare: 10 samples, batches of 4: step 2 takes the last 2 of epoch 0 and the first 2 of epoch 1
    size, batch, seed = 10, 4, 7

    # Execute
    batches = [batch_indices(step, batch, size, seed) for step in range(5)]
    flat = [i for b in batches for i in b]

    # Assert
    assert all(len(b) == batch for b in batches)
    assert sorted(flat[:size]) == list(range(size))
    assert sorted(flat[size:]) == list(range(size))
    assert flat[:size] == epoch_permutation(0, size, seed).tolist()
    assert flat[size:] == epoch_permutation(1, size, seed).tolist()
    assert batches[2] == flat[8:12]


@settings(max_examples=50, deadline=None)
@given(size=st.integers(1, 40), batch=st.integers(1, 50), seed=st.integers(0, 1000))
def test_steps_tile_whole_epochs_property(size: int, batch: int, seed: int) -> None:
    # Prepare: enough steps for at least two whole epochs, even when a batch spans several
    epochs = 2 + batch // size
    steps = -(-epochs * size // batch)

    # Execute
    flat = _concatenated(steps, batch, size, seed)

    # Assert
    for epoch in range(epochs):
        used = flat[epoch * size : (epoch + 1) * size]
        assert sorted(used) == list(range(size)), f"epoch {epoch}"


def test_batch_indices_are_deterministic() -> None:
    assert batch_indices(3, 16, 100, seed=5) == batch_indices(3, 16, 100, seed=5)
    assert epoch_permutation(2, 100, 5).tolist() == epoch_permutation(2, 100, 5).tolist()


def test_different_seeds_and_epochs_differ() -> None:
    assert batch_indices(0, 32, 1000, seed=0) != batch_indices(0, 32, 1000, seed=1)
    assert epoch_permutation(0, 1000, 0).tolist() != epoch_permutation(1, 1000, 0).tolist()


@pytest.mark.parametrize(("batch", "size"), [(0, 10), (4, 0), (-1, 10)])
def test_batch_indices_rejects_nonpositive_sizes(batch: int, size: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        batch_indices(0, batch, size, seed=0)


def test_epoch_of() -> None:
    assert epoch_of(0, 10, 100) == pytest.approx(0.1)
    assert epoch_of(9, 10, 100) == pytest.approx(1.0)
    assert epoch_of(14, 10, 100) == pytest.approx(1.5)
