"""Data parallelism end to end: a real coordinator and client processes over gRPC."""

from __future__ import annotations

import json
import os
import signal
import statistics

import pytest
from conftest import read_metrics, small_job, wait_for
from reference import checkpoint_state, max_abs_difference, reference_state

from coordinator.training.checkpoint import read_ledger
from protos import coordinator_pb2 as pb

pytestmark = pytest.mark.slow

TOLERANCE = 2e-5
"""float32: the distributed sum of shard gradients differs from the batched one only in rounding.

Rounding differences grow with the steps (momentum carries them, and the small CNN amplifies
them): simulated in one process with the shard sums of these tests, they stay near 1e-7 up to
16 steps of 96 but reach 2e-5 after 40. A lost 16-sample shard or a step applied twice moves the
parameters by 5e-5 (in the last, smallest-lr step of the cosine schedule) to 7e-3 (early on), so
runs of at most 12 steps are checked with this tolerance."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("split", "augment", "stream"), [("proportional", False, True), ("equal", True, False)])
def test_three_client_dp_equals_single_process_sgd(coordinator_factory, client_factory, split, augment, stream):
    # Prepare: BN-free model, 3 boards of different speeds; updates streamed during backward or sent
    # after it, parameters downloaded during the forward pass or before it
    job = small_job(training={"steps": 6, "min_clients": 3, "split": split, "global_batch": 96,
                              "stream_upload": stream, "stream_download": stream}, dataset={"augment": augment})
    coordinator = coordinator_factory(job)
    for name, speed in (("fast", 0.6), ("mid", 0.3), ("slow", 0.15)):
        client_factory(coordinator.address, name, speed, extra=("--power-watts", "2", "6") if name == "fast" else ())

    # Execute
    coordinator.wait(timeout=200)

    # Assert: every step used the whole global batch, and parameters equal the reference
    steps = read_metrics(coordinator.run_dir)
    assert [s["samples"] for s in steps] == [job.training.global_batch] * job.training.steps
    # the proportional split may leave out a board too slow to help in a step; equal never does
    assert all(len(s["devices"]) == (3 if split == "equal" else len(s["shares"])) for s in steps)
    assert all(len(s["devices"]) >= 2 for s in steps)
    assert {d["upload_streamed"] for s in steps for d in s["devices"].values()} == {stream}
    # every step brings a new version: downloaded while the board computed (the compute did not
    # wait for all of it), or all before it
    assert {d["download_streamed"] for s in steps for d in s["devices"].values()} == {stream}
    overlaps = [d["download_overlap_s"] for s in steps for d in s["devices"].values()]
    assert (max(overlaps) > 0) if stream else (max(overlaps) == 0)
    # energy per step for every board: from its --power-watts figures, or (emulated boards without
    # figures) from the default power model of its speed
    for s in steps:
        for stats in s["devices"].values():
            assert stats["energy_j"] > 0
    diff = max_abs_difference(checkpoint_state(coordinator.run_dir), reference_state(job))
    assert diff < TOLERANCE, f"distributed and single-process parameters differ by {diff}"
    # where the time went: each board's compute, communication and waiting fit inside the step
    # (the rest is idle), and so does the coordinator's own part
    for s in steps:
        assert sum(s["coordinator"].values()) <= s["step_s"]
        for stats in s["devices"].values():
            parts = [stats["compute_s"], stats["comm_s"], stats["waiting_s"], stats["idle_s"]]
            assert min(parts) >= 0 and sum(parts) == pytest.approx(s["step_s"], abs=2e-3)
    split_ = json.loads((coordinator.run_dir / "summary.json").read_text())["time_split"]
    by_name = {device.split("-")[0]: t for device, t in split_["boards"].items()}
    assert set(by_name) == {"fast", "mid", "slow"} and split_["coordinator"]["aggregate_s"] > 0
    # the split's predicted step time is recorded beside the measured one
    assert all(s["predicted_step_s"] > 0 for s in steps)
    assert split_["prediction_error"] == pytest.approx(split_["predicted_step_s"] / statistics.median(
        s["step_s"] for s in steps) - 1, abs=1e-3)
    if split == "equal":  # equal shares: the fastest board waits for the slowest
        assert by_name["fast"]["waiting_s"] > by_name["slow"]["waiting_s"]


@pytest.mark.timeout(240)
def test_auto_streams_once_a_transfer_shows_the_link_is_the_bottleneck(coordinator_factory, client_factory, tmp_path):
    # Prepare: one board on a 2 Mbit/s emulated link, stream_upload and stream_download left at
    # their default (auto)
    board_file = tmp_path / "board.yaml"
    board_file.write_text("name: shaped\nspeed: 0.5\nmemory_mb: 3072\nlink: {mbit_per_s: 2}\n")
    job = small_job(training={"steps": 5, "min_clients": 1, "global_batch": 32})
    assert job.training.stream_upload_mode == job.training.stream_download_mode == "auto"
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "shaped", extra=("--emulate", str(board_file)))

    # Execute
    coordinator.wait(timeout=200)

    # Assert: the first update goes whole and is timed (~0.4 s on the link for milliseconds of
    # CPU: the link is the bottleneck), every later one streams during backward; so do the
    # downloads, whose later ones run under the compute (how much of each the compute did not wait
    # for depends on the machine's load: the decision is asserted, not the overlap); same parameters
    steps = read_metrics(coordinator.run_dir)
    streamed = [device["upload_streamed"] for s in steps for device in s["devices"].values()]
    assert streamed == [False] + [True] * (job.training.steps - 1)
    downloads = [device["download_streamed"] for s in steps for device in s["devices"].values()]
    assert downloads == [False] + [True] * (job.training.steps - 1)
    assert steps[0]["devices"][next(iter(steps[0]["devices"]))]["download_overlap_s"] == 0
    diff = max_abs_difference(checkpoint_state(coordinator.run_dir), reference_state(job))
    assert diff < TOLERANCE, f"distributed and single-process parameters differ by {diff}"


@pytest.mark.timeout(240)
def test_killed_client_step_is_redone_without_loss_or_double_update(coordinator_factory, client_factory):
    # Prepare: the slowest board will be killed while it holds a step's work. The equal split
    # gives every live board a share of every step (the proportional one may leave a slow board
    # out, and a board killed between its steps owes nothing). The victim is held still first,
    # right after the first step it took part in, until the coordinator has not heard from it
    # for two heartbeats: by then a step holding its work is waiting for it (it cannot upload)
    job = small_job(training={"steps": 12, "min_clients": 3, "step_timeout_s": 20.0, "global_batch": 96,
                              "split": "equal", "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "a", 0.6)
    client_factory(coordinator.address, "b", 0.4)
    victim = client_factory(coordinator.address, "victim", 0.2)
    wait_for(lambda: any(any(d.startswith("victim") for d in s["devices"]) for s in read_metrics(coordinator.run_dir)),
             150, "the victim to take part in a step", interval_s=0.02)
    os.kill(victim.pid, signal.SIGSTOP)
    stub = coordinator.stub()
    wait_for(lambda: any(d.info.name == "victim" and d.seconds_since_seen >= 1.0
                         for d in stub.ListDevices(pb.ListDevicesRequest(), timeout=10).devices),
             30, "the coordinator to miss the held victim's heartbeats", interval_s=0.1)
    steps_before = len(read_metrics(coordinator.run_dir))

    # Execute
    victim.kill()
    coordinator.wait(timeout=200)

    # Assert: a step was redone, no samples lost, and the parameters match the reference exactly
    steps = read_metrics(coordinator.run_dir)
    assert [s["step"] for s in steps] == list(range(job.training.steps))
    assert [s["samples"] for s in steps] == [job.training.global_batch] * job.training.steps
    redone = [s for s in steps if s["attempts"] > 1]
    assert steps_before in [s["step"] for s in redone], f"the held step {steps_before} was not redone: {redone}"
    assert not any(d.startswith("victim") for d in steps[-1]["devices"])
    diff = max_abs_difference(checkpoint_state(coordinator.run_dir), reference_state(job))
    assert diff < TOLERANCE, f"parameters differ from the reference by {diff}"


@pytest.mark.timeout(240)
def test_resume_from_checkpoint_continues_exactly(tmp_path, client_factory):
    from conftest import start_coordinator

    # Prepare: 4 steps, checkpointed; then the same job extended to 8 steps, resumed
    short = small_job(training={"steps": 4, "min_clients": 2}, optimizer={"schedule": "constant", "warmup_steps": 0})
    first = start_coordinator(short, tmp_path)
    client_factory(first.address, "a", 0.5)
    client_factory(first.address, "b", 0.3)
    first.wait(timeout=200)
    long = small_job(training={"steps": 8, "min_clients": 1}, optimizer={"schedule": "constant", "warmup_steps": 0})

    # Execute
    second = start_coordinator(long, tmp_path, resume=True)
    client_factory(second.address, "c", 0.5)
    second.wait(timeout=200)

    # Assert: steps 4..7 were run once more, and the result equals 8 uninterrupted steps
    steps = [s["step"] for s in read_metrics(second.run_dir)]
    assert steps == list(range(8))
    diff = max_abs_difference(checkpoint_state(second.run_dir), reference_state(long))
    assert diff < TOLERANCE, f"resumed run differs from the reference by {diff}"


@pytest.mark.timeout(180)
def test_a_reached_target_accuracy_ends_the_job_early_with_a_checkpoint(coordinator_factory, client_factory):
    # Prepare: a target any model reaches at its first evaluation, after 2 of 20 steps
    job = small_job(training={"steps": 20, "eval_every": 2, "target_accuracy": 0.001})
    coordinator = coordinator_factory(job)
    client = client_factory(coordinator.address, "only", 0.5)
    # Execute
    coordinator.wait(timeout=150)
    # Assert: 2 steps trained, evaluated, checkpointed; the board was told the job ended
    assert [s["step"] for s in read_metrics(coordinator.run_dir)] == [0, 1]
    assert read_ledger(coordinator.run_dir) == [1, 1] + [0] * 18
    summary = json.loads((coordinator.run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["target_accuracy"]) == (2, 0.001)
    assert client.wait(timeout=30) == 0
