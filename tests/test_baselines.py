"""The baselines (edgetrain/experiment/baselines.py): real rank processes, real gloo on loopback."""

from __future__ import annotations

import json
import os
import signal
import threading

import psutil
import pytest
import torch
from conftest import read_metrics, small_job, wait_for
from reference import max_abs_difference, reference_state

from edgetrain.config import job_to_dict
from edgetrain.experiment.baselines import CIFAR_SAMPLE_BYTES, DDP_LABEL, data_ship, run_baseline
from edgetrain.experiment.ddp_worker import _first_cause
from edgetrain.fleet_file import BoardSpec, FleetSpec, GatewaySpec, LinkSpec
from edgetrain.power import board_power

TOLERANCE = 2e-5
"""As in test_dp_integration: shard sums differ from the batched gradient only in float rounding
over these few steps; a lost shard or a wrong learning rate moves parameters by 5e-5 or more."""


def _fleet(job, *boards: BoardSpec, gateway: GatewaySpec | None = None) -> FleetSpec:
    return FleetSpec(name="bl", cluster="bl", job=job, network="loopback", boards=boards,
                     gateway=gateway or GatewaySpec())


def _model(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_data_ship_is_the_slowest_boards_part_at_its_link_rate():
    # Prepare: 1000 samples over three boards (334/333/333), links of 100 and 10 Mbit/s and none
    job = small_job(dataset={"train_size": 1000})
    fleet = _fleet(job, BoardSpec(name="fast", speed=0.5, link=LinkSpec(mbit_per_s=100)),
                   BoardSpec(name="slow", speed=0.2, link=LinkSpec(mbit_per_s=10)), BoardSpec(name="wired", speed=0.1))

    # Execute
    record = data_ship(fleet, 1000)

    # Assert: the 10 Mbit/s board's 333 samples set the time; it counts towards time to target
    assert record["what"] == "data_ship" and record["counted"] is True
    assert record["seconds"] == pytest.approx(333 * CIFAR_SAMPLE_BYTES / (10e6 / 8), abs=1e-4)
    assert record["boards"]["fast"]["bytes"] == 334 * CIFAR_SAMPLE_BYTES
    assert record["boards"]["wired"]["seconds"] == 0.0
    sent = sum(b["bytes"] for b in record["boards"].values())
    assert sent == 1000 * CIFAR_SAMPLE_BYTES
    assert record["energy_j"] == pytest.approx(sum(board_power(b).energy_j(busy_s=0, idle_s=0, radio_bytes=(
        record["boards"][b.name]["bytes"])) for b in fleet.boards))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_on_two_ranks_equals_single_process_sgd(tmp_path):
    # Prepare: 24 samples a step in chunks of at most 8, augmented; a link DDP cannot emulate here
    job = small_job(training={"steps": 4, "global_batch": 24, "max_forward_batch": 8, "eval_every": 2},
                    dataset={"augment": True})
    fleet = _fleet(job, BoardSpec(name="a", speed=1.0, link=LinkSpec(mbit_per_s=20)), BoardSpec(name="b", speed=1.0))
    calls: list[tuple[int, int]] = []

    # Execute
    code = run_baseline("ddp", job_to_dict(job), fleet, tmp_path / "ddp", network="loopback",
                        progress=lambda step, total: calls.append((step, total)))

    # Assert: the same parameters as one process on the same global batches
    run = tmp_path / "ddp"
    assert code == 0, (run / "summary.json").read_text()
    assert max_abs_difference(_model(run), reference_state(job)) < TOLERANCE
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    # Assert: each step's record has both ranks' equal shares, timings, energy and ring traffic
    train = read_metrics(run)
    gradient_bytes = sum(p.numel() * 4 for p in reference_state(job, 0).values())
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    for record in train:
        assert record["shares"] == {"a": 12, "b": 12} and record["samples"] == 24
        for device in record["devices"].values():
            assert device["compute_s"] > 0 and device["energy_j"] > 0
            assert device["compute_s"] + device["comm_s"] == pytest.approx(record["step_s"], abs=2e-4)
            assert device["upload_bytes"] == gradient_bytes  # a ring all-reduce over 2 ranks: 2(N-1)/N = 1
    assert [r["step"] for r in read_metrics(run, "eval")] == [1, 3]
    assert {r["what"] for r in read_metrics(run, "setup")} >= {"process_group", "data_load"}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["label"] == DDP_LABEL and summary["insecure"] is True
    assert summary["links_emulated"] is False and summary["network"] == "loopback"
    assert summary["steps"] == 4 and summary["energy_j"] > 0 and summary["stop_reason"] == "steps"
    assert json.loads((run / "job.json").read_text())["training"]["global_batch"] == 24


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_single_and_centralized_train_the_same_steps_and_write_run_dirs(tmp_path):
    # Prepare: the fastest board is "fast"; the gateway at one core; links for the data shipping
    job = small_job(training={"steps": 3, "global_batch": 24, "max_forward_batch": 16, "eval_every": 0})
    fleet = _fleet(job, BoardSpec(name="slow", speed=0.3, link=LinkSpec(mbit_per_s=5)),
                   BoardSpec(name="fast", speed=0.6, link=LinkSpec(mbit_per_s=50)),
                   gateway=GatewaySpec(speed=1.0, idle_w=5.0, busy_w=20.0))
    codes: dict[str, int] = {}

    def arm(kind: str) -> None:
        codes[kind] = run_baseline(kind, job_to_dict(job), fleet, tmp_path / kind)

    # Execute: both arms at once
    threads = [threading.Thread(target=arm, args=(kind,)) for kind in ("single", "centralized")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Assert: each trained the reference's steps on one machine, with energy, no traffic
    assert codes == {"single": 0, "centralized": 0}
    reference = reference_state(job)
    for kind, machine in (("single", "fast"), ("centralized", "gateway")):
        run = tmp_path / kind
        assert max_abs_difference(_model(run), reference) < TOLERANCE
        train = read_metrics(run)
        assert [r["shares"] for r in train] == [{machine: 24}] * 3
        assert all(r["devices"][machine]["energy_j"] > 0 and r["devices"][machine]["upload_bytes"] == 0
                   for r in train)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["baseline"] == kind and summary["insecure"] is False and summary["energy_j"] > 0
        assert read_metrics(run, "eval")[-1]["step"] == 2
    # Assert: the gateway's power figures were used, and the data shipping was counted
    step = read_metrics(tmp_path / "centralized")[0]
    device = step["devices"]["gateway"]
    # compute_s, comm_s and energy_j are written to 4 decimals: 20 x 5e-5 + 5 x 5e-5 + 5e-5 at most apart
    assert device["energy_j"] == pytest.approx(20.0 * device["compute_s"] + 5.0 * device["comm_s"], abs=1.4e-3)
    ship = [r for r in read_metrics(tmp_path / "centralized", "setup") if r["what"] == "data_ship"]
    assert ship == [{**data_ship(fleet, 512), "time": ship[0]["time"]}]
    assert ship[0]["seconds"] == pytest.approx(256 * CIFAR_SAMPLE_BYTES / (5e6 / 8), abs=1e-4)
    assert not [r for r in read_metrics(tmp_path / "single", "setup") if r["what"] == "data_ship"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_dies_ends_the_arm_with_an_error(tmp_path):
    # Prepare: a run far longer than the test
    job = small_job(training={"steps": 100_000, "global_batch": 8, "eval_every": 0},
                    optimizer={"schedule": "constant"})
    fleet = _fleet(job, BoardSpec(name="a", speed=0.5), BoardSpec(name="b", speed=0.5))
    run = tmp_path / "ddp"
    result: list[int] = []
    arm = threading.Thread(target=lambda: result.append(run_baseline("ddp", job_to_dict(job), fleet, run)))
    arm.start()
    wait_for(lambda: read_metrics(run), 120, "the first DDP step", interval_s=0.2)

    # Execute: rank 1 is killed mid-run
    pid = json.loads((run / "ranks.json").read_text())[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    arm.join(timeout=60)

    # Assert: the arm ended with a one-line error naming the rank; no rank is left running
    assert not arm.is_alive() and result == [1]
    summary = json.loads((run / "summary.json").read_text())
    assert "rank 1 (b)" in summary["stopped"] and "signal 9" in summary["stopped"]
    assert "\n" not in summary["stopped"] and DDP_LABEL in summary["stopped"]
    rank0 = json.loads((run / "ranks.json").read_text())[0]["pid"]
    assert not psutil.pid_exists(rank0)


def test_the_rank_killed_by_a_signal_is_blamed_not_the_peers_it_disconnected():
    # Ranks reaped together: rank 0 failed with a connection reset because rank 2 was killed
    assert _first_cause({0: 1, 2: -9, 1: 0}) == (2, -9)
    assert _first_cause({3: 1, 1: 1, 0: 0}) == (1, 1)
