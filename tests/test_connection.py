"""The board's CoordinatorConnection against an in-process coordinator (tests/inprocess.py):
typed calls, transfers that resume from the last good byte, and the retry budget."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from conftest import small_job, wait_for
from inprocess import InProcessCoordinator, assignment, serve_coordinator
from rawboard import refused, wire_order

from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edgetrain import transport
from edgetrain.data import load_dataset, make_batch
from edgetrain.emulator.shaping import LinkShaper
from edgetrain.errors import Refusal
from edgetrain.fleet_file import LinkSpec
from edgetrain.models import build_model
from edgetrain.tensors import pack, unpack
from edgetrain.training import compute_shard, load_state_tensors
from edgetrain.work import Assignment, BoardProfile, Finished, StepReport

pytestmark = pytest.mark.timeout(60)

CHUNK = 4096
"""Transfer chunks: the small CNN's ~95 KiB of parameters or gradients travel in 24 of them."""
PROFILE = BoardProfile(((3, 0.02), (12, 0.05)), memory_total_bytes=2**31, memory_available_bytes=2**30,
                       peak_rss_bytes=2**28)
QUICK_TRANSFERS = transport.RetryPolicy(budget_s=20.0, initial_s=0.005, max_s=0.05,
                                        retry_on=transport.TRANSFER_RETRY_CODES)
"""Resume at once: a lossy link breaks the transfers of these tests dozens of times."""


@pytest.fixture
def coordinator() -> Iterator[InProcessCoordinator]:
    running = serve_coordinator(small_job(training={"chunk_bytes": CHUNK}))
    yield running
    running.close()


@pytest.fixture
def connect() -> Iterator:
    """Open CoordinatorConnections for a test; they are closed afterwards."""
    opened: list[CoordinatorConnection] = []

    def open_connection(address: str, **options) -> CoordinatorConnection:
        opened.append(CoordinatorConnection(address, **options))
        return opened[-1]

    yield open_connection
    for conn in opened:
        conn.close()


def _resumes(caplog, direction: str) -> int:
    """Transfers in `direction` (download or upload) the transport resumed after a break."""
    return sum(r.name == "edgetrain.transport" and r.getMessage().startswith(f"[Transport] {direction}")
               and "interrupted" in r.getMessage() for r in caplog.records)


def _gradient(coordinator: InProcessCoordinator, params: dict[str, torch.Tensor], work: Assignment):
    """What a board uploads for `work` on `params`: packed gradients and their report."""
    model = build_model(coordinator.job.model, num_classes=10)
    load_state_tensors(model, params)
    x, y = make_batch(load_dataset(coordinator.job.dataset, train=True), list(work.indices), augment=work.augment,
                      seed=work.data_seed, step=work.step)
    result = compute_shard(model, x, y)
    metas, payload = pack(wire_order(result.tensors))
    report = StepReport(samples=result.samples, loss=result.loss, correct=result.correct, compute_s=0.01)
    return result.tensors, metas, payload, report


def test_a_board_joins_works_one_step_and_hears_the_job_end(coordinator, connect):
    # Prepare
    conn = connect(coordinator.address)
    mine = assignment()

    # Execute
    device_id, job = conn.register("board-a", 0.5, "127.0.0.1:7001")
    conn.report_profile(device_id, PROFILE)
    idle = conn.get_work(device_id, 0.05)
    quiet = conn.heartbeat(device_id)
    coordinator.open({device_id: mine})
    newest = conn.heartbeat(device_id)
    work = conn.get_work(device_id, 5.0)
    metas, payload = conn.download_parameters(device_id, work.param_version)
    tensors, grad_metas, grad_payload, report = _gradient(coordinator, unpack(metas, payload), work)
    conn.upload(device_id, work, grad_metas, grad_payload, report, CHUNK)
    outcome = coordinator.wait(0)
    coordinator.board.finish("all 6 steps done")
    end = conn.get_work(device_id, 5.0)

    # Assert: the coordinator knows the board as it described itself
    record = coordinator.registry.get(device_id)
    assert job == coordinator.board_job
    assert (record.name, record.stage_address, record.info["emulated_speed"]) == ("board-a", "127.0.0.1:7001", 0.5)
    assert record.profile == PROFILE and record.state == "ready"
    # ... handed it its work and the parameters it published, and took its update exactly once
    assert (idle, quiet, newest) == (None, None, (0, 0))
    assert work == mine
    served = unpack(metas, payload)
    assert all(torch.equal(served[n], t) for n, t in coordinator.model.state_dict().items())
    assert list(outcome.accepted) == [device_id]
    accepted = outcome.accepted[device_id]
    assert (accepted.samples, accepted.loss, accepted.correct) == (report.samples, report.loss, report.correct)
    assert all(torch.equal(accepted.tensors[n], t) for n, t in tensors.items())
    assert end == Finished("all 6 steps done")


def test_transfers_over_a_lossy_link_resume_from_the_last_good_byte(coordinator, connect, caplog):
    # Prepare: half the chunks are lost, in both directions
    shaper = LinkShaper(LinkSpec(mbit_per_s=10_000, loss=0.5))
    conn = connect(coordinator.address, shaper=shaper, transfers=QUICK_TRANSFERS)
    device_id, _ = conn.register("lossy", None, "")
    conn.report_profile(device_id, PROFILE)
    coordinator.open({device_id: assignment()})
    work = conn.get_work(device_id, 5.0)
    caplog.set_level(logging.INFO, logger="edgetrain.transport")

    # Execute
    metas, payload = conn.download_parameters(device_id, work.param_version)
    tensors, grad_metas, grad_payload, report = _gradient(coordinator, unpack(metas, payload), work)
    conn.upload(device_id, work, grad_metas, grad_payload, report, CHUNK)
    outcome = coordinator.wait(0)
    again = refused(lambda: conn.upload(device_id, work, grad_metas, grad_payload, report, CHUNK))

    # Assert: the bytes arrived whole, and the coordinator received each uploaded byte once
    served_metas, served_payload = coordinator.store.full(0)
    assert metas == served_metas and bytes(payload) == bytes(served_payload)
    assert _resumes(caplog, "download") >= 2 and _resumes(caplog, "upload") >= 2, "the link never broke a transfer"
    assert list(outcome.accepted) == [device_id]
    assert all(torch.equal(outcome.accepted[device_id].tensors[n], t) for n, t in tensors.items())
    assert coordinator.registry.get(device_id).stats["upload_bytes"] == len(grad_payload)
    assert transport.error_reason(again) == Refusal.STEP_CLOSED


def test_a_refusal_is_an_answer_raised_at_once_not_retried(coordinator, connect):
    # Prepare: a patient retry budget that a retried refusal would sit out
    conn = connect(coordinator.address, retry=transport.RetryPolicy(budget_s=30.0))

    # Execute
    error = refused(lambda: conn.get_work("ghost-404", 0.1))

    # Assert: the refusal itself came back (a retried one would end as Unreachable once the budget
    # is spent, not as NOT_FOUND)
    assert (error.code(), transport.error_reason(error)) == (grpc.StatusCode.NOT_FOUND, Refusal.UNKNOWN_DEVICE)


def test_a_coordinator_nobody_serves_is_unreachable_once_the_retry_budget_is_spent(connect):
    # Prepare: a port that was just free
    server, port = transport.create_server("127.0.0.1:0", [])
    server.stop(0).wait()
    budget = transport.RetryPolicy(budget_s=0.5, initial_s=0.05)
    conn = connect(f"127.0.0.1:{port}", retry=budget,
                   transfers=transport.RetryPolicy(budget_s=0.5, initial_s=0.05, retry_on=transport.TRANSFER_RETRY_CODES))

    # Execute
    started = time.monotonic()
    with pytest.raises(CoordinatorUnreachable) as register_error:
        conn.register("board-a", None, "")
    with pytest.raises(CoordinatorUnreachable) as download_error:
        conn.download_parameters("board-a-1", 0)
    elapsed = time.monotonic() - started

    # Assert
    assert f"Register at 127.0.0.1:{port}: gave up after" in str(register_error.value)
    assert "download of version 0: gave up after" in str(download_error.value)
    assert elapsed < 10.0


def test_a_call_rides_out_a_coordinator_restart_on_the_same_port(connect, caplog):
    # Prepare: the coordinator goes away; a board starts to register while it is down
    first = serve_coordinator(small_job())
    port = first.port
    first.close()
    conn = connect(f"127.0.0.1:{port}", retry=transport.RetryPolicy(budget_s=30.0, initial_s=0.05, max_s=0.2))
    caplog.set_level(logging.DEBUG, logger="edgetrain.transport")
    result: dict = {}

    def join() -> None:
        try:
            result["device_id"] = conn.register("board-a", None, "")[0]
        except Exception as e:  # surfaced by the assertion below  # noqa: BLE001
            result["error"] = e

    joining = threading.Thread(target=join)
    joining.start()
    wait_for(lambda: any("retrying" in r.getMessage() for r in caplog.records), 20, "a retried Register")

    # Execute
    second = serve_coordinator(small_job(), port=port)
    try:
        joining.join(30)

        # Assert
        assert not joining.is_alive()
        assert "error" not in result, result
        assert second.registry.get(result["device_id"]).name == "board-a"
    finally:
        second.close()


def test_a_link_probe_lost_in_jitter_reports_a_lower_bound_and_a_measurable_one_its_rate(monkeypatch):
    import edge_client.telemetry as telemetry
    from edge_client.telemetry import LinkMeter, probe_link

    clock = [0.0]
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(telemetry.time, "sleep", lambda s: None)

    def link(seconds_for):  # a transfer that takes seconds_for(size) on the fake clock
        def send(payload: bytes) -> None:
            clock[0] += seconds_for(len(payload))
        return send

    # a loopback-fast link: every call takes its 2 ms of latency, whatever its size
    meter = LinkMeter()
    mbit = probe_link(link(lambda n: 0.002), meter)
    assert mbit == pytest.approx((576 << 10) * 8 / 0.002 / 1e6) and meter.mbit_per_s() == mbit
    # a 20 Mbit/s link behind 5 ms of latency: the difference of the two sizes gives its rate
    meter = LinkMeter()
    assert probe_link(link(lambda n: 0.005 + n * 8 / 20e6), meter) == pytest.approx(20.0)
    assert meter.rtt_ms() == pytest.approx((0.005 + (64 << 10) * 8 / 20e6) * 1000)
