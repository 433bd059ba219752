"""Tests for edgetrain.split: batch division across devices and the affine speed model."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.split import (
    SHARE_CHANGE_GAIN,
    SpeedEstimate,
    fit_speed,
    predicted_step_seconds,
    refine_speed,
    share_change_gain,
    split_equal,
    split_proportional,
    split_sticky,
)

pytestmark = pytest.mark.timeout(60)

_speeds = st.builds(
    SpeedEstimate,
    overhead_s=st.floats(0.0, 2.0, allow_nan=False),
    samples_per_s=st.floats(0.5, 50.0, allow_nan=False),
)


def _brute_force_best(total: int, speeds: dict[str, SpeedEstimate]) -> float:
    """The smallest slowest-device time over every integer split of `total`."""
    devices = list(speeds)
    best = float("inf")
    for head in itertools.product(range(total + 1), repeat=len(devices) - 1):
        if sum(head) <= total:
            shares = dict(zip(devices, (*head, total - sum(head))))
            best = min(best, predicted_step_seconds(shares, speeds))
    return best


# --- split_proportional ------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(total=st.integers(0, 14), speeds=st.lists(_speeds, min_size=1, max_size=3))
def test_split_proportional_is_min_max_optimal(total: int, speeds: list[SpeedEstimate]) -> None:
    # Prepare
    by_device = {f"dev-{i}": s for i, s in enumerate(speeds)}

    # Execute
    shares = split_proportional(total, by_device)

    # Assert
    assert sum(shares.values()) == total
    assert set(shares) == set(by_device)
    assert all(n >= 0 for n in shares.values())
    assert predicted_step_seconds(shares, by_device) == pytest.approx(
        _brute_force_best(total, by_device), rel=1e-9, abs=1e-12)


def test_split_proportional_matches_speed_ratios_without_overhead() -> None:
    # Prepare
    speeds = {name: SpeedEstimate(overhead_s=0.0, samples_per_s=v)
              for name, v in (("a", 5.0), ("b", 3.0), ("c", 2.0), ("d", 1.0))}

    # Execute
    shares = split_proportional(110, speeds)

    # Assert
    for name, want in (("a", 50), ("b", 30), ("c", 20), ("d", 10)):
        assert abs(shares[name] - want) <= 1, shares
    assert sum(shares.values()) == 110


def test_split_proportional_gives_zero_to_a_device_too_slow_to_help() -> None:
    # Prepare: the fast device does the whole batch in 0.16 s; the slow one needs 5 s for one sample
    speeds = {"fast": SpeedEstimate(overhead_s=0.0, samples_per_s=100.0),
              "slow": SpeedEstimate(overhead_s=5.0, samples_per_s=100.0)}

    # Execute
    shares = split_proportional(16, speeds)

    # Assert
    assert shares == {"fast": 16, "slow": 0}
    assert predicted_step_seconds(shares, speeds) == pytest.approx(0.16)


def test_split_proportional_of_zero_samples_gives_nothing() -> None:
    speeds = {"a": SpeedEstimate(overhead_s=0.0, samples_per_s=1.0)}
    assert split_proportional(0, speeds) == {"a": 0}


def test_split_proportional_needs_a_device() -> None:
    with pytest.raises(ValueError, match="zero devices"):
        split_proportional(8, {})


# --- split_equal -------------------------------------------------------------------------------

@pytest.mark.parametrize(("total", "devices", "want"), [
    (12, ["a", "b", "c"], {"a": 4, "b": 4, "c": 4}),
    (14, ["a", "b", "c"], {"a": 5, "b": 5, "c": 4}),
    (2, ["a", "b", "c"], {"a": 1, "b": 1, "c": 0}),
    (7, ["solo"], {"solo": 7}),
])
def test_split_equal(total: int, devices: list[str], want: dict[str, int]) -> None:
    assert split_equal(total, devices) == want


def test_split_equal_needs_a_device() -> None:
    with pytest.raises(ValueError, match="zero devices"):
        split_equal(8, [])


# --- fit_speed / refine_speed ------------------------------------------------------------------

@pytest.mark.parametrize(("overhead", "rate"), [(0.0, 40.0), (0.05, 120.0), (0.3, 3.0)])
def test_fit_speed_recovers_affine_model(overhead: float, rate: float) -> None:
    # Prepare
    timings = [(b, overhead + b / rate) for b in (3, 12, 24, 12)]

    # Execute
    speed = fit_speed(timings)

    # Assert
    assert speed.overhead_s == pytest.approx(overhead, abs=1e-9)
    assert speed.samples_per_s == pytest.approx(rate, rel=1e-9)


@pytest.mark.parametrize(("timings", "rate"), [
    pytest.param([(8, 0.4)], 20.0, id="single-size"),
    pytest.param([(8, 0.4), (8, 0.6)], 16 / 1.0, id="repeated-size"),
    pytest.param([(2, 1.0), (12, 0.5)], 14 / 1.5, id="time-falls-with-batch"),
    pytest.param([(2, 0.01), (12, 0.5)], 14 / 0.51, id="negative-overhead"),
    pytest.param([(0, 1.0), (4, 0.0), (8, 0.4)], 20.0, id="unusable-points-dropped"),
])
def test_fit_speed_falls_back_to_proportional(timings, rate: float) -> None:
    # Execute
    speed = fit_speed(timings)

    # Assert
    assert speed.overhead_s == 0.0
    assert speed.samples_per_s == pytest.approx(rate)


def test_fit_speed_without_usable_timings_raises() -> None:
    with pytest.raises(ValueError, match="no usable timings"):
        fit_speed([(0, 1.0), (4, 0.0)])


@pytest.mark.parametrize("observed_rate", [60.0, 400.0])
def test_refine_speed_moves_towards_observation(observed_rate: float) -> None:
    # Prepare
    estimate = SpeedEstimate(overhead_s=0.1, samples_per_s=100.0)
    observed_s = 0.1 + 40 / observed_rate

    # Execute
    refined = refine_speed(estimate, samples=40, compute_s=observed_s, comm_s=0.2)

    # Assert: the predicted time for 40 samples moved 30% of the way to the observed one, its
    # fixed and per-sample parts alike (the profile's shape is kept)
    assert refined.seconds(40) - refined.comm_s == pytest.approx(0.7 * estimate.seconds(40) + 0.3 * observed_s)
    assert refined.overhead_s * refined.samples_per_s == pytest.approx(estimate.overhead_s * estimate.samples_per_s)
    low, high = sorted((estimate.samples_per_s, observed_rate))
    assert low < refined.samples_per_s < high
    assert refined.comm_s == 0.2  # the first observation: nothing to blend it with


def test_refined_speed_extrapolates_to_other_shares_when_the_run_is_faster_than_the_profile() -> None:
    # Prepare: a 0.2-core board's profile (0.32 s fixed, 12 samples/s) and a run in which it is
    # twice as fast throughout; its steps all have 7 samples
    profile = SpeedEstimate(overhead_s=0.32, samples_per_s=12.0)

    def truth(n: int) -> float:
        return 0.5 * (0.32 + n / 12.0)

    # Execute
    speed = profile
    for _ in range(20):
        speed = refine_speed(speed, samples=7, compute_s=truth(7), comm_s=0.0)

    # Assert: right at 7 samples, and at the 10 a new split would give it (keeping the profile's
    # fixed seconds and fitting only the rate would predict 0.52 s where it takes 0.58)
    assert speed.seconds(7) == pytest.approx(truth(7), rel=0.01)
    assert speed.seconds(10) == pytest.approx(truth(10), rel=0.02)


def test_one_stalled_step_moves_the_estimate_by_at_most_the_clip_and_a_lasting_change_fully() -> None:
    # Prepare: a board predicted at 0.5 s for 40 samples (0.2 s of transfers)
    estimate = SpeedEstimate(overhead_s=0.1, samples_per_s=100.0, comm_s=0.2)

    # Execute: one step stalls 8x (compute and transfers); then the board really runs 3x slower
    stalled = refine_speed(estimate, samples=40, compute_s=4.0, comm_s=1.6)
    slower = estimate
    for _ in range(12):
        slower = refine_speed(slower, samples=40, compute_s=1.5, comm_s=0.2)

    # Assert: the stall counts as 2x its prediction (1.3x the estimate, not 3.1x); the lasting
    # change is followed all the way
    assert stalled.seconds(40) - stalled.comm_s == pytest.approx(1.3 * 0.5)
    assert stalled.comm_s == pytest.approx(1.3 * 0.2)
    assert slower.seconds(40) - slower.comm_s == pytest.approx(1.5, rel=0.02)


def test_refine_speed_blends_later_communication_times() -> None:
    estimate = SpeedEstimate(overhead_s=0.1, samples_per_s=100.0, comm_s=0.5)
    refined = refine_speed(estimate, samples=40, compute_s=0.5, comm_s=1.0)
    assert refined.comm_s == pytest.approx(0.7 * 0.5 + 0.3 * 1.0)
    assert refine_speed(refined, samples=40, compute_s=0.5, comm_s=0.0).comm_s == refined.comm_s


@pytest.mark.parametrize(("samples", "seconds"), [(0, 1.0), (10, 0.0), (10, float("nan")), (10, float("inf"))])
def test_refine_speed_ignores_unusable_observations(samples: int, seconds: float) -> None:
    estimate = SpeedEstimate(overhead_s=0.1, samples_per_s=100.0)
    assert refine_speed(estimate, samples=samples, compute_s=seconds, comm_s=0.0) == estimate


# --- predicted_step_seconds --------------------------------------------------------------------

def test_predicted_step_seconds_is_the_slowest_busy_device() -> None:
    # Prepare
    speeds = {"a": SpeedEstimate(overhead_s=0.5, samples_per_s=10.0),
              "b": SpeedEstimate(overhead_s=0.0, samples_per_s=4.0),
              "idle": SpeedEstimate(overhead_s=100.0, samples_per_s=1.0)}

    # Execute
    seconds = predicted_step_seconds({"a": 20, "b": 10, "idle": 0}, speeds)

    # Assert
    assert seconds == pytest.approx(2.5)
    assert predicted_step_seconds({}, speeds) == 0.0
    assert predicted_step_seconds({"idle": 0}, speeds) == 0.0
    assert speeds["a"].seconds(0) == 0.0



# --- split_sticky ------------------------------------------------------------------------------


def test_split_sticky_keeps_shares_that_are_nearly_as_fast() -> None:
    speeds = {"a": SpeedEstimate(0.0, 10.0), "b": SpeedEstimate(0.0, 10.4)}
    fresh = split_proportional(100, speeds)
    assert fresh == {"a": 49, "b": 51}
    assert split_sticky(100, speeds, {"a": 50, "b": 50}) == {"a": 50, "b": 50}  # 2% slower: kept


def test_split_sticky_moves_when_the_fresh_split_is_clearly_faster() -> None:
    speeds = {"a": SpeedEstimate(0.0, 10.0), "b": SpeedEstimate(0.0, 30.0)}
    assert split_sticky(100, speeds, {"a": 50, "b": 50}) == split_proportional(100, speeds) == {"a": 25, "b": 75}


@pytest.mark.parametrize("previous", [None, {}, {"a": 50}, {"a": 50, "c": 50}, {"a": 40, "b": 40}])
def test_split_sticky_splits_afresh_when_previous_does_not_fit(previous) -> None:
    speeds = {"a": SpeedEstimate(0.0, 10.0), "b": SpeedEstimate(0.0, 10.4)}
    assert split_sticky(100, speeds, previous) == split_proportional(100, speeds)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.lists(_speeds, min_size=2, max_size=3), st.data())
def test_split_sticky_is_never_worse_than_its_tolerance(total: int, speeds: list[SpeedEstimate], data) -> None:
    by_device = {f"d{i}": s for i, s in enumerate(speeds)}
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=len(speeds) - 1, max_size=len(speeds) - 1)))
    bounds = [0, *cuts, total]
    previous = {d: bounds[i + 1] - bounds[i] for i, d in enumerate(by_device)}
    shares = split_sticky(total, by_device, previous, min_gain=0.05)
    assert sum(shares.values()) == total
    best = predicted_step_seconds(split_proportional(total, by_device), by_device)
    assert predicted_step_seconds(shares, by_device) <= 1.05 * best + 1e-9


# --- share_change_gain ---------------------------------------------------------------------------


@pytest.mark.parametrize(("noise", "devices"), [(0.0, 16), (-0.1, 16), (float("nan"), 16), (0.01, 16), (0.3, 1)])
def test_share_change_gain_is_the_fixed_floor_when_steps_barely_scatter(noise: float, devices: int) -> None:
    assert share_change_gain(noise, devices) == SHARE_CHANGE_GAIN


def test_share_change_gain_is_the_noise_the_slowest_of_n_estimates_shows() -> None:
    # an EMA at weight w of measurements scattering by s scatters by e = s sqrt(w / (2 - w)); two
    # of them some steps apart by sqrt(2) e; the largest of n by about sqrt(2 ln n) times that
    assert share_change_gain(0.12, 16) == pytest.approx(2 * math.sqrt(math.log(16)) * 0.12 * (0.3 / 1.7) ** 0.5)
    assert share_change_gain(0.12, 4, weight=0.5) == pytest.approx(2 * math.sqrt(math.log(4)) * 0.12 * (1 / 3) ** 0.5)
    assert share_change_gain(0.12, 16) > share_change_gain(0.12, 4) > share_change_gain(0.06, 4)


def _share_changes(min_gain_for, steps: int = 60, boards: int = 16, noise: float = 0.12) -> int:
    """Steps whose shares changed, for identical boards (10 samples/s) whose measured throughput
    scatters by `noise` a step, refined and split as the coordinator does."""
    rng = random.Random(7)
    speeds = {f"b{i}": SpeedEstimate(0.0, 10.0) for i in range(boards)}
    shares, changes, seen = None, 0, {d: [] for d in speeds}
    for _ in range(steps):
        recent = [statistics.stdev(r[-6:]) / statistics.fmean(r[-6:]) for r in seen.values() if len(r) >= 3]
        fresh = split_sticky(32 * boards, speeds, shares, min_gain=min_gain_for(
            statistics.median(recent) if recent else 0.0))
        changes += shares is not None and fresh != shares
        shares = fresh
        for d, n in shares.items():
            rate = 10.0 * (1 + rng.gauss(0.0, noise))
            seen[d].append(rate)
            speeds[d] = refine_speed(speeds[d], n, n / rate, 0.0)
    return changes


def test_identical_noisy_boards_keep_their_shares_under_the_noise_margin() -> None:
    fixed = _share_changes(lambda noise: SHARE_CHANGE_GAIN)
    margin = _share_changes(lambda noise: share_change_gain(noise, 16))
    assert fixed >= 40  # the fixed 2% re-splits nearly every step
    assert margin <= 12, (fixed, margin)  # at most a fifth of the steps (5-11 over seeds 0-11)


def test_a_board_that_really_slows_loses_samples_despite_the_noise_margin() -> None:
    # Prepare: 16 identical noisy boards (12% a step) on equal shares; then b0 runs at half speed
    rng = random.Random(3)
    speeds = {f"b{i}": SpeedEstimate(0.0, 10.0) for i in range(16)}
    seen = {d: [10.0] * 6 for d in speeds}
    shares = split_equal(512, list(speeds))

    # Execute: ten steps at b0's new speed, split under the noise margin as the coordinator does
    for _ in range(10):
        for d, n in shares.items():
            rate = (5.0 if d == "b0" else 10.0) * (1 + rng.gauss(0.0, 0.12))
            seen[d].append(rate)
            speeds[d] = refine_speed(speeds[d], n, n / rate, 0.0)
        noise = statistics.median(statistics.stdev(r[-6:]) / statistics.fmean(r[-6:]) for r in seen.values())
        shares = split_sticky(512, speeds, shares, min_gain=share_change_gain(noise, 16))

    # Assert: b0 was re-split to well under an equal share
    assert shares["b0"] < 0.7 * 32, shares


# --- boards the split leaves out before they are measured -------------------------------------

def test_a_board_left_out_on_its_warm_up_gets_one_sample_until_it_is_measured() -> None:
    from coordinator.training.data_parallel import MIN_MEASURED_STEPS, with_unmeasured

    shares = {"b50": 40, "b30": 18, "b20": 6, "b10": 0}
    # b10 ran one measured step (its first carried its warm-up): it gets a sample from b50
    assert with_unmeasured(shares, {"b50": 9, "b30": 9, "b20": 9, "b10": 1}) == {
        "b50": 39, "b30": 18, "b20": 6, "b10": 1}
    # measured enough: the split's verdict stands
    assert with_unmeasured(shares, {"b50": 9, "b30": 9, "b20": 9, "b10": MIN_MEASURED_STEPS}) == shares
    # nothing to spare: a one-sample batch stays where it is
    assert with_unmeasured({"a": 1, "b": 0}, {"a": 5, "b": 0}) == {"a": 1, "b": 0}
    assert shares["b10"] == 0  # the split in use is not changed
