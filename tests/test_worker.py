"""A real EdgeWorker in a thread of the test process against an in-process coordinator
(tests/inprocess.py): what it uploads is what the shared training arithmetic computes, it
stops with the coordinator's reason, and it joins again when the coordinator forgets it."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import small_job
from inprocess import SAMPLES, InProcessCoordinator, assignment, serve_coordinator

from edge_client.connection import CoordinatorConnection
from edge_client.worker import ClientOptions, EdgeWorker
from edgetrain.board_hardware import BoardHardware
from edgetrain.data import load_dataset, make_batch
from edgetrain.models import build_model
from edgetrain.training import (
    ShardResult,
    compute_shard,
    load_state_tensors,
    local_train,
    state_tensors,
)
from edgetrain.work import Assignment, LocalWork

pytestmark = pytest.mark.timeout(60)

NAME = "board-a"


@dataclass
class RunningWorker:
    """An EdgeWorker running `run()` in a thread; `result` holds its return value or error."""

    worker: EdgeWorker
    thread: threading.Thread
    result: dict

    def wait(self, timeout_s: float) -> str:
        """The reason `run()` returned (re-raises what it raised)."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the worker did not stop within {timeout_s} s"
        if "error" in self.result:
            raise self.result["error"]
        return self.result["reason"]


@pytest.fixture
def coordinator() -> Iterator[InProcessCoordinator]:
    running = serve_coordinator(small_job())
    yield running
    running.close()


@pytest.fixture
def worker(coordinator, tmp_path: Path) -> Iterator[RunningWorker]:
    """A real board's worker (no CPU limit, no emulation) for `coordinator`, started; plaintext,
    as the in-process coordinator serves (the fleet's credentials: tests/test_client_trust.py)."""
    conn = CoordinatorConnection(coordinator.address)
    options = ClientOptions(name=NAME, data_dir=str(tmp_path / "data"), poll_s=0.5, stage_bind="127.0.0.1:0",
                            probe_interval_s=math.inf, insecure=True)  # no link probes: not what these tests are about
    board = EdgeWorker(conn, options, BoardHardware.real())
    result: dict = {}

    def run() -> None:
        try:
            result["reason"] = board.run()
        except BaseException as e:  # surfaced by RunningWorker.wait
            result["error"] = e

    running = RunningWorker(board, threading.Thread(target=run, daemon=True, name="edge-worker"), result)
    running.thread.start()
    yield running
    coordinator.board.finish("test over")
    running.thread.join(30)
    if board.endpoint is not None:
        board.endpoint.close()
    conn.close()


def _ready_device(coordinator: InProcessCoordinator, timeout_s: float = 30.0) -> str:
    """The one device that has registered and profiled (waits for it)."""
    ready = coordinator.registry.wait_ready(1, timeout_s)
    assert len(ready) == 1, f"expected one ready device within {timeout_s} s, got {sorted(ready)}"
    return next(iter(ready))


def _reference(coordinator: InProcessCoordinator, work: Assignment, train) -> ShardResult:
    """What `train(model, x, y)` computes from the served parameters on the samples of `work`."""
    model = build_model(coordinator.job.model, num_classes=10)
    load_state_tensors(model, state_tensors(coordinator.model))
    x, y = make_batch(load_dataset(coordinator.job.dataset, train=True), list(work.indices), augment=work.augment,
                      seed=work.data_seed, step=work.step)
    return train(model, x, y)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-6), (
            f"{name}: max difference {float((got[name] - tensor).abs().max()):.3g}")


def test_a_worker_uploads_the_shard_gradient_and_stops_with_the_coordinators_reason(coordinator, worker):
    # Prepare: augmented samples, so the step and seed must reach the board's batch too
    device_id = _ready_device(coordinator)
    work = Assignment(step=0, attempt=0, param_version=0, indices=SAMPLES, augment=True, data_seed=7)

    # Execute
    coordinator.open({device_id: work})
    outcome = coordinator.wait(0)
    coordinator.board.finish("all 6 steps done")
    reason = worker.wait(30)

    # Assert
    reference = _reference(coordinator, work, compute_shard)
    assert list(outcome.accepted) == [device_id], outcome
    contribution = outcome.accepted[device_id]
    _assert_close(contribution.tensors, reference.tensors)
    assert (contribution.samples, contribution.correct) == (reference.samples, reference.correct)
    assert contribution.loss == pytest.approx(reference.loss, abs=1e-6)
    assert reason == "all 6 steps done"


def test_a_worker_the_coordinator_dropped_registers_again_and_works_on(coordinator, worker):
    # Prepare
    first = _ready_device(coordinator)

    # Execute: the registry drops the board; its next call is refused and it joins again
    coordinator.registry.drop(first, "no heartbeat for 9.9 s")
    second = _ready_device(coordinator)
    coordinator.open({second: assignment()})
    outcome = coordinator.wait(0)

    # Assert
    records = {r.device_id: r for r in coordinator.registry.snapshot()}
    assert second != first
    assert (records[first].state, records[first].left_reason) == ("gone", "no heartbeat for 9.9 s")
    assert (records[second].name, records[second].state) == (NAME, "ready")
    assert list(outcome.accepted) == [second], outcome


def test_a_federated_round_uploads_the_parameter_change_of_local_training(coordinator, worker):
    # Prepare
    device_id = _ready_device(coordinator)
    local = LocalWork(steps=3, batch_size=8, lr=0.1, momentum=0.9, weight_decay=5e-4, prox_mu=0.01)
    work = assignment(local=local)

    # Execute
    coordinator.open({device_id: work})
    outcome = coordinator.wait(0)

    # Assert
    reference = _reference(coordinator, work, lambda model, x, y: local_train(
        model, x, y, steps=local.steps, batch_size=local.batch_size, lr=local.lr, momentum=local.momentum,
        weight_decay=local.weight_decay, prox_mu=local.prox_mu))
    assert list(outcome.accepted) == [device_id], outcome
    contribution = outcome.accepted[device_id]
    _assert_close(contribution.tensors, reference.tensors)
    assert contribution.samples == len(SAMPLES)
    assert any(float(t.abs().max()) > 0 for t in reference.tensors.values()), "local training changed nothing"
