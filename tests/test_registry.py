"""The device registry: liveness, telemetry window, bounded memory for departed devices, and a
board's claimed speed checked against its measured steps."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from coordinator.registry import (
    CLAIM_CHECK_STEPS,
    GONE_KEPT,
    TELEMETRY_WINDOW,
    DeviceRegistry,
    UnknownDevice,
)
from edgetrain.split import split_proportional
from edgetrain.telemetry import TelemetrySample
from edgetrain.work import BoardProfile


def test_departed_devices_are_forgotten_beyond_a_bound() -> None:
    # Prepare
    registry = DeviceRegistry()
    ids = [registry.register(f"b{i}", {}, {}).device_id for i in range(GONE_KEPT + 10)]

    # Execute
    for device_id in ids:
        registry.drop(device_id, "left")

    # Assert: the newest departures are kept for reports, the oldest forgotten
    kept = [r.device_id for r in registry.snapshot()]
    assert kept == ids[-GONE_KEPT:]
    registry.observe_step(ids[0], 4, 0.1, 0.1)  # a late report about a forgotten device is ignored
    with pytest.raises(UnknownDevice):
        registry.telemetry_window(ids[0])


def test_expiry_and_telemetry_window() -> None:
    # Prepare: a controllable clock
    now = [0.0]
    registry = DeviceRegistry(clock=lambda: now[0])
    device_id = registry.register("b", {}, {}).device_id

    # Execute
    for t in range(TELEMETRY_WINDOW + 5):
        now[0] = float(t)
        registry.heartbeat(device_id, TelemetrySample(timestamp=float(t), battery_percent=50.0))
    now[0] += 11
    expired = registry.expire(timeout_s=10)

    # Assert
    window = registry.telemetry_window(device_id)
    assert len(window) == TELEMETRY_WINDOW and window[-1][1].timestamp == TELEMETRY_WINDOW + 4
    assert expired == [device_id] and not registry.is_alive(device_id)


def _claiming(registry: DeviceRegistry, name: str, samples_per_s: float) -> str:
    """A registered board whose profile claims `samples_per_s` (no fixed cost)."""
    device_id = registry.register(name, {}, {}).device_id
    registry.set_profile(device_id, BoardProfile(((4, 4 / samples_per_s), (16, 16 / samples_per_s)), 2**30, 2**29, 2**28))
    return device_id


@pytest.mark.parametrize(("claimed", "real"), [(1000.0, 10.0), (5.0, 100.0)], ids=["boasts", "sandbags"])
def test_a_board_whose_steps_are_far_off_its_claim_is_flagged_and_planned_by_the_measurement(caplog, claimed, real):
    # Prepare: a board whose steps take what `real` samples/s would (on the coordinator's clock,
    # whatever it reports), and an honest one claiming and training at 50 samples/s
    registry = DeviceRegistry()
    board, honest = _claiming(registry, "board", claimed), _claiming(registry, "honest", 50.0)

    def step(samples: int = 24) -> None:
        registry.observe_step(board, samples, samples / claimed, 0.0, turnaround_s=samples / real)
        registry.observe_step(honest, samples, samples / 50.0, 0.0, turnaround_s=samples / 50.0)

    # Execute: a first step (the warm-up, not judged), then CLAIM_CHECK_STEPS measured ones
    for _ in range(CLAIM_CHECK_STEPS):
        step()
    before = registry.get(board).claim_note
    step()

    # Assert
    record = registry.get(board)
    assert before == ""
    assert record.claim_note == f"claimed {claimed:.1f} samples/s, measured {real:.1f} over 3 steps"
    assert record.speed.samples_per_s == pytest.approx(real, rel=1e-6)
    assert registry.get(honest).claim_note == "" and registry.get(honest).speed.samples_per_s == pytest.approx(50.0)
    shares = split_proportional(100, {d: registry.get(d).speed for d in (board, honest)})
    assert shares[board] / shares[honest] == pytest.approx(real / 50.0, rel=0.1)
    assert f"device {record.device_id}: claimed" in caplog.text and "planning it by the measurement" in caplog.text


def test_a_tiny_step_slowed_by_fixed_costs_is_not_a_false_claim() -> None:
    # Prepare: 1000 samples/s claimed; 24-sample steps take 0.2 s (8x the claim, all fixed costs)
    registry = DeviceRegistry()
    board = _claiming(registry, "board", 1000.0)

    # Execute
    for _ in range(2 * CLAIM_CHECK_STEPS):
        registry.observe_step(board, 24, 0.024, 0.0, turnaround_s=0.2)

    # Assert: under the slack, not flagged; the speed still follows the measured steps
    assert registry.get(board).claim_note == ""
    assert registry.get(board).speed.samples_per_s < 1000 / 3


def test_communication_counts_from_a_boards_second_step_and_that_one_as_it_is() -> None:
    # Prepare: a board's first step carries its warm-up (its transfers 2x the later ones)
    registry = DeviceRegistry()
    board = _claiming(registry, "board", 50.0)

    # Execute / Assert
    registry.observe_step(board, 24, 0.5, 2.0)
    assert registry.get(board).speed.comm_s == 0.0  # not measured yet: the warm-up is not taken
    registry.observe_step(board, 24, 0.5, 1.0)
    assert registry.get(board).speed.comm_s == 1.0  # the first real measurement, as it is
    registry.observe_step(board, 24, 0.5, 0.5)
    assert registry.get(board).speed.comm_s == pytest.approx(0.7 * 1.0 + 0.3 * 0.5)


def _profiled(registry: DeviceRegistry, name: str, overhead_s: float, samples_per_s: float) -> str:
    """A registered board whose profile fits `overhead_s + samples / samples_per_s` exactly."""
    device_id = registry.register(name, {}, {}).device_id
    registry.set_profile(device_id, BoardProfile(((4, overhead_s + 4 / samples_per_s),
                                                  (16, overhead_s + 16 / samples_per_s)), 2**30, 2**29, 2**28))
    return device_id


def test_a_stage_hosts_speed_follows_its_stage_compute_as_a_whole_model_speed() -> None:
    # Prepare: profiled at 20 samples/s + 0.1 s a call, the board really trains 2.5x as fast; it
    # hosts a stage of 40% of the model's work, 32 rows in 4 micro-batches: the cost model's
    # 4 x o x 0.4 s of calls plus 32 x 0.4 / r s of samples
    registry = DeviceRegistry()
    board = _profiled(registry, "board", 0.1, 20.0)
    compute_s = (4 * 0.1 * 0.4 + 32 * 0.4 / 20.0) / 2.5

    # Execute: the first step (the warm-up) does not refine; later ones scale the estimate
    registry.observe_stage(board, 32, compute_s, 0.05, work_fraction=0.4, calls=4)
    after_first = registry.get(board).speed
    for _ in range(16):
        registry.observe_stage(board, 32, compute_s, 0.05, work_fraction=0.4, calls=4)

    # Assert: the whole-model speed is 2.5x the profile's, its per-call and per-sample costs alike
    speed = registry.get(board).speed
    assert after_first.samples_per_s == pytest.approx(20.0)
    assert speed.samples_per_s == pytest.approx(50.0, rel=0.01) and speed.overhead_s == pytest.approx(0.04, rel=0.01)
    assert speed.comm_s == 0.0  # a stage's transfers (activations, its own upload) are not a DP step's
    assert registry.get(board).stats["steps"] == 17 and registry.get(board).stats["samples"] == 17 * 32


def test_a_stage_step_without_its_share_of_the_work_only_counts() -> None:
    # Prepare: a channel group member (its share is of channels, not rows: no fraction given),
    # and steps that carry nothing to learn from
    registry = DeviceRegistry()
    board = _profiled(registry, "board", 0.1, 20.0)

    # Execute
    registry.observe_stage(board, 32, 0.5, 0.0, work_fraction=0.4, calls=4)  # warm-up
    registry.observe_stage(board, 32, 0.2, 0.0)
    registry.observe_stage(board, 0, 0.2, 0.0, work_fraction=0.4, calls=4)
    registry.observe_stage(board, 32, float("nan"), 0.0, work_fraction=0.4, calls=4)

    # Assert
    assert registry.get(board).speed.samples_per_s == pytest.approx(20.0)
    assert registry.get(board).stats["steps"] == 4


def test_rate_noise_is_how_boards_step_times_scatter_against_each_others() -> None:
    # Prepare: four boards profiled at 0.1 s + 20 samples/s; every step the whole machine runs
    # at a different speed (a common factor); b1 and b2 also scatter by +-10% on their own
    registry = DeviceRegistry()
    boards = {_profiled(registry, f"b{i}", 0.1, 20.0): e for i, e in enumerate((0.0, 0.1, 0.1, 0.3))}
    unstepped = _profiled(registry, "unstepped", 0.1, 20.0)  # steps without a step number: not counted

    # Execute: a warm-up step (not measured), then six measured ones each
    for board in boards:
        registry.observe_step(board, 20, 5.0, 0.1, step=0)
    for k in range(1, 7):
        machine = (1.0, 1.6, 0.7, 2.0, 1.0, 1.3)[k - 1]
        for board, e in boards.items():
            registry.observe_step(board, 20, machine * (0.1 + 1.0) * (1 + e * (-1) ** k), 0.1, step=k)
        registry.observe_step(unstepped, 20, 9.0 * k, 0.1)
    speeds = {b: registry.get(b).speed for b in boards}

    # Assert: each time over its own estimate's prediction, over the step's median of that: the
    # common factor is gone, what is left of each board's +-e is its scatter; the median board's
    expected = []
    for board, e in boards.items():
        ratios = {k: (1 + e * (-1) ** k) / speeds[board].seconds(20) for k in range(1, 7)}
        expected.append(ratios)
    spreads = []
    for ratios in expected:
        relative = [r / statistics.median(other[k] for other in expected) for k, r in ratios.items()]
        spreads.append(statistics.stdev(relative) / statistics.fmean(relative))
    assert registry.rate_noise([*boards, unstepped, "unknown"]) == pytest.approx(statistics.median(spreads))
    assert 0.05 < registry.rate_noise(boards) < 0.2  # the +-10% boards; the common factor (0.7-2x) is not noise
    assert registry.rate_noise([unstepped]) == 0.0
    assert registry.rate_noise(list(boards)[:1]) == 0.0  # one board: nothing to compare it with


def test_the_planner_counts_a_gpu_boards_own_memory_its_copies_and_a_cap_after_it_ran_out():
    from coordinator.planning.inputs import board_from_record
    from edgetrain.plan import BlockCost, ModelCost

    model = ModelCost((BlockCost(name="b0", param_bytes=1e6, activation_bytes=1e4, forward_flops=1e8),))
    registry = DeviceRegistry()
    gpu = registry.register("orin", {}, {}).device_id
    registry.set_profile(gpu, BoardProfile(((4, 0.01), (16, 0.02)), 2**33, 2**32, 2**28, device="cuda:0 X",
                                           device_memory_bytes=2**30, copy_s_per_byte=1e-9))
    board = board_from_record(registry.get(gpu), model)
    # its GPU's own memory, not the board's; every byte also crosses to the device and back (1 ns):
    # at the assumed link rate that is less than the link alone
    assert board.memory_bytes == 2**30 and board.device == "cuda:0 X"
    plain = board_from_record(replace(registry.get(gpu), profile=replace(registry.get(gpu).profile,
                                                                         copy_s_per_byte=0.0)), model)
    assert board.mbit_per_s < plain.mbit_per_s
    registry.note_out_of_memory(gpu)
    registry.cap_memory(gpu, 2**28)
    assert board_from_record(registry.get(gpu), model).memory_bytes == 2**28
