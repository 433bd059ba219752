"""Adaptive aggregation end to end: real coordinator, client processes and raw-gRPC boards.

Compressed links (codec up, deltas down), the adaptive codec switching when a board's emulated
link changes rate, FedAvg against a hand-computed reference, bounded staleness with a slow board,
and bad updates (NaN, outlier, wrong shape) refused with their reason and then quarantined.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, small_job, wait_for
from rawboard import (
    compute_gradient,
    gradient_of,
    header,
    join,
    next_step,
    refused,
    upload,
    upload_good,
)
from reference import checkpoint_state, max_abs_difference

from edgetrain.data import dataset_labels, load_dataset, make_batch
from edgetrain.models import build_model
from edgetrain.partition import class_counts, partition_members, round_indices
from edgetrain.streaming import iter_chunks
from edgetrain.training import shard_tensor_names
from edgetrain.updates import UpdateFormats
from protos import coordinator_pb2 as pb

pytestmark = pytest.mark.slow


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    return read_metrics(run_dir, kind)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("uplink", "downlink", "up_fraction", "down_fraction"), [
    ("topk:0.05", "int8", 0.2, 0.35),
    ("powersgd:2", "powersgd:2", 0.15, 0.35),
])
def test_compressed_links_shrink_bytes_and_training_still_learns(coordinator_factory, client_factory, uplink: str,
                                                                 downlink: str, up_fraction: float,
                                                                 down_fraction: float):
    # Prepare: a lossy codec up with error feedback on the boards, lossy deltas down; an equal split,
    # so both boards work every step (a board the proportional split leaves out for more versions than
    # the deltas kept downloads in full again, which the byte bound below does not allow for)
    job = small_job(training={"steps": 60, "min_clients": 2, "global_batch": 32, "eval_every": 0, "split": "equal"},
                    compression={"uplink": uplink, "downlink": downlink},
                    optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "schedule": "constant",
                               "warmup_steps": 0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "a", 0.5)
    client_factory(coordinator.address, "b", 0.3)

    # Execute
    summary = coordinator.wait(timeout=200)

    # Assert: every update travelled compressed; bytes per step far below dense; the loss fell
    steps = records(coordinator.run_dir)
    formats = UpdateFormats(shard_tensor_names(build_model("small_cnn")))
    dense, compressed = formats("none").wire_bytes(), formats(uplink).wire_bytes()
    assert compressed < up_fraction * dense
    for s in steps:
        for stats in s["devices"].values():
            assert stats["codec"] == uplink and stats["upload_bytes"] == compressed
    assert sum(s["samples"] for s in steps) == 60 * 32
    # uncompressed single-process SGD on the same batches: 2.37 -> 1.18 (mean of the last 5 steps)
    first, last = steps[0]["loss"], sum(s["loss"] for s in steps[-5:]) / 5
    assert last < 0.75 * first, f"loss {first:.3f} -> {last:.3f}"
    full = sum(t.numel() * 4 for t in build_model("small_cnn").state_dict().values())
    for row in summary["devices"]:  # after the first full download, compressed deltas come down
        assert row["download_bytes"] < full + row["steps"] * down_fraction * full
        assert row["upload_bytes"] == row["steps"] * compressed


@pytest.mark.timeout(240)
def test_adaptive_codec_switches_when_a_link_rate_drops(coordinator_factory, client_factory, tmp_path):
    # Prepare: one board on a fast emulated link that will drop to 2 Mbit/s (with 3 GiB of memory)
    board_file = tmp_path / "board.yaml"
    board_file.write_text("name: shaped\nspeed: 0.5\nmemory_mb: 3072\nlink: {mbit_per_s: 400}\n")
    job = small_job(training={"steps": 400, "min_clients": 1, "global_batch": 16, "eval_every": 0,
                              "log_every": 50},
                    compression={"uplink": "adaptive", "downlink": "int8", "adaptive_budget": 2.0,
                                 "adaptive_limit": 2.0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "shaped", extra=("--emulate", str(board_file), "--probe-interval", "1"))
    stub = coordinator.stub()

    def codec_now() -> str:
        devices = stub.ListDevices(pb.ListDevicesRequest(), timeout=10).devices
        return next((d.codec for d in devices if d.state == "ready"), "")

    def wait_for(want, timeout_s: float) -> str:
        deadline, seen = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            seen = codec_now()
            if want(seen):
                return seen
            time.sleep(0.3)
        return seen

    # Execute
    fast = wait_for(lambda c: c == "none", 60)
    deadline = time.monotonic() + 60  # its telemetry arrives with its heartbeats
    while time.monotonic() < deadline:
        telemetry = next(d.telemetry for d in stub.ListDevices(pb.ListDevicesRequest(), timeout=10).devices)
        if telemetry.memory_total_bytes:
            break
        time.sleep(0.3)
    board_file.write_text("name: shaped\nspeed: 0.5\nmemory_mb: 3072\nlink: {mbit_per_s: 2}\n")
    slow = wait_for(lambda c: c not in ("", "none"), 90)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            c != "none" for s in records(coordinator.run_dir) for c in s["codecs"].values()):
        time.sleep(0.3)
    coordinator.stop.set()

    # Assert
    assert fast == "none"
    assert slow.startswith("topk") or slow == "int8", slow
    # the board reports its emulated memory, not the host's (a cgroup enforces it as root)
    assert telemetry.memory_total_bytes == 3072 * 2**20
    assert 0 < telemetry.memory_used_bytes < telemetry.memory_total_bytes
    steps = records(coordinator.run_dir)
    assert {"none"} < {c for s in steps for c in s["codecs"].values()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("federated", "per_round"), [
    ({}, 3),
    ({"partitioning": "dirichlet", "dirichlet_alpha": 0.3, "clients_per_round": 2}, 2),
], ids=["iid-all", "dirichlet-two-of-three"])
def test_fedavg_over_three_boards_matches_the_reference_computation(coordinator_factory, client_factory,
                                                                    federated: dict, per_round: int):
    # Prepare: 3 rounds of 3 local steps of 8 samples, each board on its own partition (iid, or
    # non-IID by Dirichlet(0.3) with 2 of the 3 boards drawn each round)
    job = small_job(aggregation={"rule": "fedavg"},
                    federated={"local_steps": 3, "local_batch": 8, "partitions": 3, **federated},
                    training={"steps": 3, "min_clients": 3, "global_batch": 24, "eval_every": 0},
                    optimizer={"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0, "schedule": "constant",
                               "warmup_steps": 0})
    coordinator = coordinator_factory(job)
    for name in ("a", "b", "c"):  # at full speed: a board's first local round imports torch._dynamo
        client_factory(coordinator.address, name)  # (torch.optim, ~3 s of CPU), 13 s at 0.2 of a core

    # Execute
    coordinator.wait(timeout=200)

    # Assert: each round, the drawn boards' independent local SGD runs on their own partitions,
    # averaged, computed here by hand
    dataset = load_dataset(job.dataset, train=True)
    fed = job.federated
    members = partition_members(dataset_labels(dataset), 3, scheme=fed.partitioning, alpha=fed.dirichlet_alpha,
                                seed=job.seed)
    state = json.loads(max((coordinator.run_dir / "checkpoints").glob("step-*/state.json")).read_text())
    holder = state["partitions"]  # board name -> partition, as the boards arrived
    steps = records(coordinator.run_dir)
    model = build_model(job.model, seed=job.seed)
    for round_, record in enumerate(steps):
        names = sorted(d.rsplit("-", 1)[0] for d in record["devices"])
        if per_round < 3:
            assert names == sorted(random.Random(f"{job.seed}:{round_}").sample(["a", "b", "c"], per_round))
        locals_ = []
        for name in names:
            local = build_model(job.model, seed=job.seed)
            local.load_state_dict(model.state_dict())
            idx = round_indices(members[holder[name]], round_, 24)
            x, y = make_batch(dataset, idx, augment=False, seed=job.seed, step=round_)
            for i in range(3):
                local.zero_grad()
                torch.nn.functional.cross_entropy(local(x[8 * i: 8 * i + 8]), y[8 * i: 8 * i + 8]).backward()
                with torch.no_grad():
                    for p in local.parameters():
                        p.sub_(0.05 * p.grad)
            locals_.append(local.state_dict())
        model.load_state_dict({k: sum(s[k] for s in locals_) / len(locals_) for k in locals_[0]})
    assert [len(s["devices"]) for s in steps] == [per_round] * 3
    assert all(s["samples"] == 24 * per_round for s in steps)
    diff = max_abs_difference(checkpoint_state(coordinator.run_dir), model.state_dict())
    assert diff < 2e-5, f"FedAvg and the reference differ by {diff}"
    if fed.partitioning == "dirichlet":  # non-IID: some partition is dominated by a class (iid: ~0.1 each)
        counts = [class_counts(dataset_labels(dataset), m) for m in members]
        assert max(max(c.values()) / sum(c.values()) for c in counts) > 0.3, counts


@pytest.mark.timeout(240)
def test_a_slow_board_is_not_waited_for_and_its_late_updates_count_down_weighted(coordinator_factory,
                                                                                 client_factory):
    # Prepare: bounded staleness; "slow" at 0.04 of a core misses every predicted deadline. Its
    # updates arrive 13-15 steps late here; the bound is the job's length, so how late they are on
    # a loaded machine never decides whether one counts
    job = small_job(aggregation={"rule": "staleness", "staleness_bound": 40, "deadline_factor": 1.2,
                                 "deadline_slack_s": 0.1, "min_fraction": 0.3},
                    training={"steps": 40, "min_clients": 2, "global_batch": 32, "split": "equal",
                              "eval_every": 0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "fast", 0.6)
    client_factory(coordinator.address, "slow", 0.04)

    # Execute
    coordinator.wait(timeout=200)

    # Assert: steps went on without the slow board; its updates came in late with s(tau) < 1
    steps = records(coordinator.run_dir)
    late_steps = [s for s in steps if any(d.startswith("slow") for d in s["late"])]
    stale = [st for s in steps for d, st in s["devices"].items() if d.startswith("slow") and st["staleness"] > 0]
    assert late_steps, "the slow board never missed a deadline"
    assert stale, "no late update from the slow board was used"
    for st in stale:
        assert st["weight"] == pytest.approx((1 + st["staleness"]) ** -0.5, abs=1e-3)
        assert st["staleness"] <= 40
    assert all(s["samples"] > 0 for s in steps)


@pytest.mark.timeout(180)
def test_nan_outlier_and_wrong_shape_updates_are_refused_then_the_board_is_quarantined(
        coordinator_factory, client_factory, tmp_path):
    # Prepare: two honest client processes and a raw board that sends bad updates; the job is
    # longer than the test, which stops it once training went on without the quarantined board
    job = small_job(aggregation={"outlier_factor": 5.0, "quarantine_after": 3, "quarantine_window": 20,
                                 "quarantine_steps": 1000},
                    training={"steps": 10000, "min_clients": 3, "global_batch": 24, "split": "equal",
                              "step_timeout_s": 60, "heartbeat_timeout_s": 30.0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "honest-a", 0.5)
    client_factory(coordinator.address, "honest-b", 0.5)
    rogue = join(coordinator.stub("rogue"), "rogue")

    # Execute: NaN, then 1000x, then a truncated tensor
    work = next_step(rogue, timeout_s=60)
    grad = compute_gradient(rogue, work, tmp_path)
    poisoned = {n: t.clone() for n, t in grad.tensors.items()}
    next(iter(poisoned.values())).view(-1)[0] = float("nan")
    nan_error = refused(lambda: upload_good(rogue, gradient_of(work, poisoned, grad.report)))

    work = next_step(rogue, timeout_s=60)
    grad = compute_gradient(rogue, work, tmp_path)
    upload_good(rogue, gradient_of(work, {n: t * 1000 for n, t in grad.tensors.items()}, grad.report))

    work = next_step(rogue, timeout_s=60)
    grad = compute_gradient(rogue, work, tmp_path)
    name, first = next(iter(grad.tensors.items()))
    wrong = gradient_of(work, {**grad.tensors, name: first.reshape(-1)[1:]}, grad.report)
    shape_error = refused(lambda: upload(rogue, header(rogue, wrong),
                                         iter_chunks(wrong.payload, chunk_bytes=4096)))
    stub = coordinator.stub()
    view = wait_for(lambda: next((d for d in stub.ListDevices(pb.ListDevicesRequest(), timeout=10).devices
                                  if d.device_id == rogue.device_id and d.state == "quarantined"), None),
                    30, "the rogue to be quarantined", interval_s=0.2)
    quarantined_at = wait_for(lambda: [s["step"] for s in records(coordinator.run_dir)
                                       if rogue.device_id in s["quarantined"]], 30, "a step to log the quarantine",
                              interval_s=0.2)[0]
    wait_for(lambda: len(records(coordinator.run_dir)) > quarantined_at + 5, 60,
             "five more steps after the quarantine", interval_s=0.2)
    coordinator.stop.set()
    coordinator.thread.join(60)

    # Assert: each refusal says why; the rogue got no more work; training went on without it
    assert nan_error.code().name == "INVALID_ARGUMENT" and "non-finite (NaN/Inf)" in nan_error.details()
    assert shape_error.code().name == "INVALID_ARGUMENT" and f"tensor {name!r} shape" in shape_error.details()
    steps = records(coordinator.run_dir)
    reasons = [s["rejected"][rogue.device_id] for s in steps if rogue.device_id in s["rejected"]]
    assert len(reasons) == 3
    assert "non-finite" in reasons[0] and reasons[1].startswith("outlier: update norm") and "shape" in reasons[2]
    after = [s for s in steps if s["step"] > quarantined_at]
    assert len(after) >= 5 and all(rogue.device_id not in s["shares"] for s in after)
    assert [s["step"] for s in steps] == list(range(len(steps))) and all(s["samples"] > 0 for s in steps)
    assert view.state == "quarantined" and view.rejected_updates == 3
