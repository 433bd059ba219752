"""Tests for edgetrain.pipeline: schedules, their simulation, row and block splits, stage blocks."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.models import BlockModel, build_model
from edgetrain.pipeline import (
    SCHEDULES,
    Op,
    bubble_fraction,
    overlaps,
    peak_in_flight,
    run_blocks,
    schedule,
    simulate,
    split_microbatches,
    split_rows,
    stage_blocks,
    stage_parameter_prefixes,
)

pytestmark = pytest.mark.timeout(60)


@st.composite
def _pipelines(draw: st.DrawFn) -> tuple[int, int, int]:
    """(stages, microbatches, stage) with stage in range."""
    stages = draw(st.integers(1, 8))
    microbatches = draw(st.integers(1, 12))
    return stages, microbatches, draw(st.integers(0, stages - 1))


def _ops(text: str) -> list[Op]:
    """``"F0 F1 B0"`` -> [Op("F", 0), Op("F", 1), Op("B", 0)]."""
    return [Op(token[0], int(token[1:])) for token in text.split()]


def _all_stages(name: str, stages: int, microbatches: int) -> list[list[Op]]:
    return [schedule(name, stages, microbatches, s) for s in range(stages)]


# --- schedule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
@settings(max_examples=100, deadline=None)
@given(pipeline=_pipelines())
def test_schedule_runs_every_op_once_and_backward_after_forward(
    name: str, pipeline: tuple[int, int, int]
) -> None:
    # Prepare
    stages, microbatches, stage = pipeline

    # Execute
    ops = schedule(name, stages, microbatches, stage)

    # Assert
    expected = {Op(kind, m) for kind in "FB" for m in range(microbatches)}
    assert len(ops) == len(expected) and set(ops) == expected
    for m in range(microbatches):
        assert ops.index(Op("F", m)) < ops.index(Op("B", m))
    backwards = [op.microbatch for op in ops if op.kind == "B"]
    assert backwards == sorted(backwards)


def test_schedule_examples() -> None:
    assert schedule("gpipe", 3, 3, 1) == _ops("F0 F1 F2 B0 B1 B2")
    assert schedule("1f1b", 4, 6, 0) == _ops("F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5")
    assert schedule("1f1b", 4, 6, 2) == _ops("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5")
    assert schedule("1f1b", 4, 6, 3) == _ops("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")
    assert schedule("1f1b", 4, 2, 0) == _ops("F0 F1 B0 B1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zero_bubble", 2, 2, 0), "unknown schedule 'zero_bubble'"),
        (("gpipe", 0, 2, 0), "stages must be >= 1, got 0"),
        (("1f1b", 2, 0, 0), "microbatches must be >= 1, got 0"),
        (("1f1b", 2, 2, 2), r"stage must be in \[0, 2\) for 2 stages, got 2"),
        (("gpipe", 2, 2, -1), r"stage must be in \[0, 2\) for 2 stages, got -1"),
    ],
)
def test_schedule_rejects_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        schedule(*args)


def test_op_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="kind"):
        Op("X", 0)
    with pytest.raises(ValueError, match="microbatch"):
        Op("F", -1)


# --- peak_in_flight ----------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(pipeline=_pipelines())
def test_peak_in_flight_is_m_for_gpipe_and_bounded_for_1f1b(
    pipeline: tuple[int, int, int],
) -> None:
    stages, microbatches, stage = pipeline

    assert peak_in_flight(schedule("gpipe", stages, microbatches, stage)) == microbatches
    assert peak_in_flight(schedule("1f1b", stages, microbatches, stage)) == min(
        stages - stage, microbatches)


def test_peak_in_flight_rejects_backward_before_forward() -> None:
    with pytest.raises(ValueError, match="B0 runs before its forward"):
        peak_in_flight(_ops("B0 F0"))


# --- bubble_fraction and simulate --------------------------------------------------------------

def test_bubble_fraction_values() -> None:
    assert bubble_fraction(1, 5) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="stages"):
        bubble_fraction(0, 4)
    with pytest.raises(ValueError, match="microbatches"):
        bubble_fraction(2, 0)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7])
def test_simulate_equal_stages_matches_theory(name: str, stages: int, microbatches: int) -> None:
    # Prepare
    f, b = 1.0, 2.5
    ops = _all_stages(name, stages, microbatches)

    # Execute
    makespan, busy = simulate(ops, [f] * stages, [b] * stages)

    # Assert
    assert makespan == pytest.approx((microbatches + stages - 1) * (f + b))
    for fraction in busy:
        assert 1 - fraction == pytest.approx(bubble_fraction(stages, microbatches))


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_simulate_gpipe_pays_link_delay_twice_per_cut(stages: int) -> None:
    f, b, comm, microbatches = 1.0, 2.0, 0.25, 5

    makespan, _ = simulate(_all_stages("gpipe", stages, microbatches),
                           [f] * stages, [b] * stages, comm_s=comm)

    assert makespan == pytest.approx((microbatches + stages - 1) * (f + b) + 2 * (stages - 1) * comm)


_stage_times = st.lists(st.floats(0.1, 5.0, allow_nan=False), min_size=1, max_size=5)


@settings(max_examples=100, deadline=None)
@given(forward=_stage_times, data=st.data(), microbatches=st.integers(1, 8),
       comm=st.floats(0.0, 1.0, allow_nan=False))
def test_simulate_respects_lower_bounds_for_unequal_stages(
    forward: list[float], data: st.DataObject, microbatches: int, comm: float
) -> None:
    # Prepare
    stages = len(forward)
    backward = data.draw(st.lists(st.floats(0.1, 5.0, allow_nan=False),
                                  min_size=stages, max_size=stages))
    bottleneck = max(microbatches * (f + b) for f, b in zip(forward, backward))
    one_microbatch = sum(forward) + sum(backward) + 2 * (stages - 1) * comm

    for name in SCHEDULES:
        # Execute
        makespan, busy = simulate(_all_stages(name, stages, microbatches), forward, backward, comm)

        # Assert
        assert makespan >= max(bottleneck, one_microbatch) * (1 - 1e-12)
        assert all(0 < fraction <= 1 + 1e-12 for fraction in busy)


def test_simulate_busy_fraction_of_unequal_stages() -> None:
    # One stage three times slower: it is the bottleneck and almost always busy.
    makespan, busy = simulate(_all_stages("1f1b", 2, 10), [1.0, 3.0], [1.0, 3.0])

    assert makespan == pytest.approx(1.0 + 10 * 6.0 + 1.0)
    assert busy == pytest.approx([20 / 62, 60 / 62])


@pytest.mark.parametrize(
    "ops",
    [
        # The last stage runs B0 before F0.
        [_ops("F0 B0"), _ops("B0 F0")],
        # Stage 0 waits for B0 before sending F1; stage 1 waits for F1 before running B0.
        [_ops("F0 B0 F1 B1"), _ops("F0 F1 B0 B1")],
    ],
)
def test_simulate_detects_deadlock(ops: list[list[Op]]) -> None:
    with pytest.raises(ValueError, match="deadlock"):
        simulate(ops, [1.0, 1.0], [1.0, 1.0])


def test_simulate_rejects_inconsistent_input() -> None:
    good = _all_stages("gpipe", 2, 2)
    with pytest.raises(ValueError, match="other ops than stage 0"):
        simulate([good[0], _ops("F0 B0")], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="more than once"):
        simulate([_ops("F0 F0 B0")], [1.0], [1.0])
    with pytest.raises(ValueError, match="no matching B1"):
        simulate([_ops("F0 F1 B0")], [1.0], [1.0])
    with pytest.raises(ValueError, match="one forward and one backward time per stage"):
        simulate(good, [1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        simulate(good, [1.0, 1.0], [1.0, 1.0], comm_s=-1.0)
    with pytest.raises(ValueError, match="at least one stage"):
        simulate([], [], [])


# --- split_rows --------------------------------------------------------------------------------

_weights = st.lists(
    st.one_of(st.just(0.0), st.floats(0.01, 100.0, allow_nan=False)), min_size=1, max_size=6
).filter(lambda ws: any(w > 0 for w in ws))


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 200), weights=_weights)
def test_split_rows_tiles_and_is_proportional(total: int, weights: list[float]) -> None:
    # Execute
    ranges = split_rows(total, weights)

    # Assert
    assert len(ranges) == len(weights)
    assert [b for b, _ in ranges] == [0] + [e for _, e in ranges[:-1]]
    assert ranges[-1][1] == total
    rows = [e - b for b, e in ranges]
    assert all(n >= 0 for n in rows)
    positive = [i for i, w in enumerate(weights) if w > 0]
    assert all(rows[i] == 0 for i, w in enumerate(weights) if w == 0)
    if total >= len(positive):
        assert all(rows[i] >= 1 for i in positive)
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] > weights[j]:
                assert rows[i] >= rows[j]
    quotas = [total * Fraction(w) / sum(map(Fraction, weights)) for w in weights]
    if all(quotas[i] >= 1 for i in positive):
        assert all(abs(n - q) < 1 for n, q in zip(rows, quotas))


def test_split_rows_examples() -> None:
    assert split_rows(10, [1, 1]) == [(0, 5), (5, 10)]
    assert split_rows(10, [1, 2, 2]) == [(0, 2), (2, 6), (6, 10)]
    assert split_rows(4, [1, 0, 1]) == [(0, 2), (2, 2), (2, 4)]
    assert split_rows(0, [1, 1]) == [(0, 0), (0, 0)]
    # Largest remainder: quotas 3.33 / 3.33 / 3.33 -> the first member takes the extra row.
    assert split_rows(10, [1, 1, 1]) == [(0, 4), (4, 7), (7, 10)]


def test_split_rows_gives_every_positive_member_a_row_when_possible() -> None:
    # Prepare: quotas 2.94 / 0.03 / 0.03 would round to 3 / 0 / 0.
    weights = [100.0, 1.0, 1.0]

    # Execute / Assert
    assert split_rows(3, weights) == [(0, 1), (1, 2), (2, 3)]
    assert split_rows(5, weights) == [(0, 3), (3, 4), (4, 5)]
    assert split_rows(2, weights) == [(0, 2), (2, 2), (2, 2)]  # too few rows for everyone


@pytest.mark.parametrize(
    ("total", "weights", "message"),
    [
        (4, [], "at least one weight"),
        (4, [1.0, -1.0], "finite and >= 0"),
        (4, [1.0, math.inf], "finite and >= 0"),
        (4, [math.nan], "finite and >= 0"),
        (4, [0.0, 0.0], "at least one weight must be > 0"),
        (-1, [1.0], "total must be >= 0"),
    ],
)
def test_split_rows_rejects_bad_arguments(total: int, weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_rows(total, weights)


# --- overlaps ----------------------------------------------------------------------------------

def test_overlaps_example() -> None:
    assert overlaps([(0, 3), (3, 8)], [(0, 5), (5, 8)]) == [
        (0, 0, 0, 3), (1, 0, 3, 5), (1, 1, 5, 8)]


def test_overlaps_of_single_hosts_and_empty_members() -> None:
    assert overlaps([(0, 8)], [(0, 8)]) == [(0, 0, 0, 8)]
    assert overlaps([(0, 8)], [(0, 2), (2, 2), (2, 8)]) == [(0, 0, 0, 2), (0, 2, 2, 8)]
    assert overlaps([(0, 4), (4, 8)], [(0, 8)]) == [(0, 0, 0, 4), (1, 0, 4, 8)]


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 100), senders=_weights, receivers=_weights)
def test_overlaps_cover_every_row_once(
    total: int, senders: list[float], receivers: list[float]
) -> None:
    # Prepare
    sent, received = split_rows(total, senders), split_rows(total, receivers)

    # Execute
    transfers = overlaps(sent, received)

    # Assert
    assert [(b, e) for *_, b, e in transfers] == list(
        zip([0] + [e for *_, e in transfers[:-1]], [e for *_, e in transfers]))
    assert transfers[-1][3] == total
    for i, j, begin, end in transfers:
        assert sent[i][0] <= begin < end <= sent[i][1]
        assert received[j][0] <= begin < end <= received[j][1]


def test_overlaps_rejects_ranges_that_do_not_tile_the_same_rows() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        overlaps([(0, 3), (4, 8)], [(0, 8)])
    with pytest.raises(ValueError, match="same rows"):
        overlaps([(0, 8)], [(0, 6)])
    with pytest.raises(ValueError, match="at least one range"):
        overlaps([], [(0, 6)])


# --- split_microbatches and stage_blocks -------------------------------------------------------

def test_split_microbatches() -> None:
    assert split_microbatches(10, 3) == [4, 3, 3]
    assert split_microbatches(3, 3) == [1, 1, 1]
    assert split_microbatches(8, 1) == [8]
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        split_microbatches(8, 0)
    with pytest.raises(ValueError, match="cannot cut 2 samples into 3 micro-batches"):
        split_microbatches(2, 3)


def test_stage_blocks() -> None:
    assert stage_blocks([1, 2, 1], 4) == [(0, 1), (1, 3), (3, 4)]
    assert stage_blocks([4], 4) == [(0, 4)]
    with pytest.raises(ValueError, match="sum to 3, but the model has 4 blocks"):
        stage_blocks([1, 1, 1], 4)
    with pytest.raises(ValueError, match=">= 1 block"):
        stage_blocks([0, 4], 4)
    with pytest.raises(ValueError, match="at least one stage"):
        stage_blocks([], 4)


# --- stage_parameter_prefixes and run_blocks ---------------------------------------------------

@pytest.fixture(scope="module")
def models() -> dict[str, BlockModel]:
    return {name: build_model(name, seed=0).eval() for name in ("small_cnn", "mobilenet_v2")}


@pytest.mark.parametrize(
    ("name", "block_counts"),
    [
        ("small_cnn", [1, 2, 1]),
        ("small_cnn", [4]),
        # features.1 and features.10 .. features.18 land on different stages.
        ("mobilenet_v2", [2, 8, 10]),
        ("mobilenet_v2", [1] * 20),
    ],
)
def test_stage_parameter_prefixes_partition_the_state(
    models: dict[str, BlockModel], name: str, block_counts: list[int]
) -> None:
    # Prepare
    model = models[name]
    stages = stage_blocks(block_counts, len(model.block_names))
    state_names = list(model.state_dict())  # parameters and buffers (BatchNorm statistics)

    # Execute
    prefixes = [stage_parameter_prefixes(model.block_names, b, e) for b, e in stages]

    # Assert: every parameter and buffer belongs to exactly one stage ...
    for state_name in state_names:
        owners = [s for s, p in enumerate(prefixes) if state_name.startswith(p)]
        assert len(owners) == 1, (state_name, owners)
    # ... and each stage's prefixes select exactly its blocks' parameters.
    for (b, e), stage_prefixes in zip(stages, prefixes):
        expected = {id(p) for block in model.block_modules(b, e) for p in block.parameters()}
        selected = {id(p) for n, p in model.named_parameters() if n.startswith(stage_prefixes)}
        assert selected == expected


def test_stage_parameter_prefixes_rejects_bad_range() -> None:
    with pytest.raises(ValueError, match="begin < end"):
        stage_parameter_prefixes(["a", "b"], 1, 1)
    with pytest.raises(ValueError, match="begin < end"):
        stage_parameter_prefixes(["a", "b"], 0, 3)


@pytest.mark.parametrize("name", ["small_cnn", "mobilenet_v2"])
def test_run_blocks_equals_model_forward(models: dict[str, BlockModel], name: str) -> None:
    # Prepare
    model = models[name]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    stages = stage_blocks([1, len(model.block_names) - 2, 1], len(model.block_names))

    # Execute
    with torch.no_grad():
        expected = model(x)
        whole = run_blocks(model.block_modules(), x)
        staged = x
        for begin, end in stages:
            staged = run_blocks(model.block_modules(begin, end), staged)

    # Assert
    assert torch.allclose(whole, expected)
    assert torch.allclose(staged, expected)
