"""The Coordinator servicer in-process: precise refusals with typed reasons, and it keeps serving.

A real gRPC server on 127.0.0.1:0 (coordinator.servicer.create_server) around a real
CoordinatorServicer, DeviceRegistry, StepBoard and ParameterStore, wired as coordinator.main
wires them. There is no Trainer: each test opens step attempts on the StepBoard itself and
waits for their answers, and speaks raw gRPC through the generated stubs (tests/rawboard.py) so
it can send what a well-behaved client never would.

The in-process coordinator (tests/inprocess.py) is also what test_connection.py and
test_worker.py run their clients against.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from conftest import small_job
from inprocess import SAMPLES, InProcessCoordinator, assignment, serve_coordinator
from rawboard import (
    RPC_TIMEOUT_S,
    Board,
    chunks,
    compute_gradient,
    download,
    header,
    join,
    next_step,
    refused,
    register,
    upload,
    upload_good,
)

import edgetrain
from edgetrain import serde, transport
from edgetrain.errors import FailureKind, Refusal
from edgetrain.telemetry import TelemetrySample
from edgetrain.training import state_tensors
from edgetrain.work import Finished
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coordinator() -> Iterator[InProcessCoordinator]:
    running = serve_coordinator(small_job())
    yield running
    running.close()


@pytest.fixture
def board(coordinator) -> Iterator[Board]:
    """A registered and profiled device speaking raw gRPC."""
    channel = transport.open_channel(coordinator.address)
    yield join(pb_grpc.CoordinatorStub(channel))
    channel.close()


def _assert_refused(error: grpc.RpcError, code: grpc.StatusCode, reason: Refusal, fragment: str = "") -> None:
    assert (error.code(), transport.error_reason(error)) == (code, reason), error.details()
    assert fragment in error.details()


def _heartbeat(board: Board) -> pb.HeartbeatReply:
    return board.stub.Heartbeat(pb.HeartbeatRequest(device_id=board.device_id), timeout=RPC_TIMEOUT_S)


# --- registration --------------------------------------------------------------------------------

def test_register_refuses_another_protocol_version_then_admits_a_current_board(coordinator, board):
    # Execute
    error = refused(lambda: register(board.stub, "from-the-future", protocol_version=edgetrain.PROTOCOL_VERSION + 1))
    reply = register(board.stub, "from-today")

    # Assert
    _assert_refused(error, grpc.StatusCode.FAILED_PRECONDITION, Refusal.PROTOCOL_MISMATCH,
                    f"this coordinator speaks {edgetrain.PROTOCOL_VERSION}")
    assert serde.board_job_from_proto(reply.job) == coordinator.board_job
    assert sorted(r.name for r in coordinator.registry.snapshot()) == ["from-today", "raw-board"]


@pytest.mark.parametrize("how", ["never-registered", "dropped"])
def test_an_unknown_device_is_refused_on_every_rpc_with_unknown_device(coordinator, board, tmp_path, how):
    # Prepare: a ghost id the registry never saw, or a board it dropped (both must register again)
    coordinator.open({board.device_id: assignment()})
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    ghost = "ghost-404"
    if how == "dropped":
        ghost = join(board.stub, "doomed").device_id
        coordinator.registry.drop(ghost, "missed its heartbeats")
    stub, step = board.stub, (work.step, work.attempt)
    calls = {
        "ReportProfile": lambda: stub.ReportProfile(pb.ProfileReport(
            device_id=ghost, timings=[pb.BatchTiming(batch_size=4, seconds=0.1)]), timeout=RPC_TIMEOUT_S),
        "Heartbeat": lambda: stub.Heartbeat(pb.HeartbeatRequest(device_id=ghost), timeout=RPC_TIMEOUT_S),
        "Probe": lambda: stub.Probe(pb.ProbeRequest(device_id=ghost, payload=b"x" * 64), timeout=RPC_TIMEOUT_S),
        "GetWork": lambda: stub.GetWork(pb.WorkRequest(device_id=ghost, max_wait_s=0.1), timeout=RPC_TIMEOUT_S),
        "ReportFailure": lambda: stub.ReportFailure(pb.FailureReport(
            device_id=ghost, step=step[0], attempt=step[1], reason="lost", kind=FailureKind.INTERNAL),
            timeout=RPC_TIMEOUT_S),
        "DownloadParameters": lambda: list(stub.DownloadParameters(
            pb.ParameterRequest(device_id=ghost, version=0), timeout=RPC_TIMEOUT_S)),
        "UploadGradient": lambda: upload(board, header(board, grad, device_id=ghost), chunks(grad)),
        "GetUploadStatus": lambda: stub.GetUploadStatus(pb.UploadStatusRequest(
            device_id=ghost, step=step[0], attempt=step[1]), timeout=RPC_TIMEOUT_S),
    }

    # Execute
    errors = {rpc: refused(call) for rpc, call in calls.items()}
    reply = upload_good(board, grad)

    # Assert: each refusal names the device and says to register again; the live board is served
    for rpc, error in errors.items():
        assert (error.code(), transport.error_reason(error)) == (
            grpc.StatusCode.NOT_FOUND, Refusal.UNKNOWN_DEVICE), f"{rpc}: {error.details()}"
        assert f"unknown device id {ghost!r}; register again" in error.details(), rpc
    assert reply.received_bytes == len(grad.payload)
    assert list(coordinator.wait(0).accepted) == [board.device_id]


# --- work and heartbeats -------------------------------------------------------------------------

def test_get_work_answers_idle_then_the_assignment_then_finished(coordinator, board):
    # Prepare
    mine = assignment(codec="fp16")

    def poll(max_wait_s: float) -> pb.WorkAssignment:
        return board.stub.GetWork(pb.WorkRequest(device_id=board.device_id, max_wait_s=max_wait_s),
                                  timeout=RPC_TIMEOUT_S)

    # Execute: a short poll before any work; a long poll that the opened attempt ends; then the end
    idle = poll(0.05)
    # (a poll that waited out its 30 s would end as DEADLINE_EXCEEDED at the 15 s RPC timeout)
    pending = board.stub.GetWork.future(pb.WorkRequest(device_id=board.device_id, max_wait_s=30.0),
                                        timeout=RPC_TIMEOUT_S)
    coordinator.open({board.device_id: mine})
    assigned = pending.result(timeout=RPC_TIMEOUT_S)
    coordinator.board.finish("all 6 steps done")
    finished = poll(5.0)

    # Assert
    assert idle.WhichOneof("work") == "idle"
    assert serde.work_from_proto(assigned) == mine
    assert serde.work_from_proto(finished) == Finished("all 6 steps done")


def test_heartbeat_keeps_telemetry_and_tells_the_newest_attempt(coordinator, board):
    # Prepare
    sample = TelemetrySample(timestamp=1_700_000_000.0, cpu_percent=37.5, battery_percent=80.0, plugged=False)

    # Execute
    before = _heartbeat(board)
    coordinator.open({board.device_id: assignment(step=3, attempt=2)})
    after = board.stub.Heartbeat(pb.HeartbeatRequest(device_id=board.device_id,
                                                     telemetry=serde.telemetry_to_proto(sample)),
                                 timeout=RPC_TIMEOUT_S)

    # Assert
    assert not before.HasField("newest_step")
    assert (after.newest_step, after.newest_attempt) == (3, 2)
    assert coordinator.registry.get(board.device_id).latest_telemetry == sample


# --- uploads -------------------------------------------------------------------------------------

def test_an_upload_is_accepted_once_and_a_second_one_is_already_answered(coordinator, board, tmp_path):
    # Prepare
    coordinator.open({board.device_id: assignment()})
    taking = time.monotonic()
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    computed = time.monotonic()

    # Execute
    reply = upload_good(board, grad)
    uploaded = time.monotonic()
    again = refused(lambda: upload_good(board, grad))
    status = refused(lambda: board.stub.GetUploadStatus(pb.UploadStatusRequest(
        device_id=board.device_id, step=work.step, attempt=work.attempt), timeout=RPC_TIMEOUT_S))
    outcome = coordinator.wait(work.step, work.attempt)

    # Assert: the answer is the one upload, exactly as sent
    assert reply.received_bytes == len(grad.payload)
    for error in (again, status):
        _assert_refused(error, grpc.StatusCode.ALREADY_EXISTS, Refusal.ALREADY_ANSWERED,
                        f"device {board.device_id} already answered step 0 attempt 0")
    assert list(outcome.accepted) == [board.device_id] and outcome.rejected == {} and outcome.missing == []
    contribution = outcome.accepted[board.device_id]
    assert contribution.samples == len(SAMPLES)
    # the coordinator's own clock: from the board taking the work to the upload being complete
    assert computed - taking - 0.5 < contribution.turnaround_s <= uploaded - taking
    for name, tensor in grad.tensors.items():
        assert torch.equal(contribution.tensors[name], tensor), name


def test_an_upload_for_a_closed_step_is_refused_and_the_next_step_is_served(coordinator, board, tmp_path):
    # Prepare: step 0 closes unanswered (its deadline passed); step 1 is open
    coordinator.open({board.device_id: assignment()})
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    missed = coordinator.wait(0, timeout_s=0.0)
    coordinator.store.publish(1, state_tensors(coordinator.model))
    coordinator.open({board.device_id: assignment(step=1)})

    # Execute
    error = refused(lambda: upload_good(board, grad))
    following = next_step(board)
    later = compute_gradient(board, following, tmp_path)
    reply = upload_good(board, later)

    # Assert
    assert missed.missing == [board.device_id]
    _assert_refused(error, grpc.StatusCode.FAILED_PRECONDITION, Refusal.STEP_CLOSED, "step 0 attempt 0 is closed")
    assert following.step == 1
    assert reply.received_bytes == len(later.payload)
    assert list(coordinator.wait(1).accepted) == [board.device_id]


def test_a_failure_report_is_recorded_as_the_tickets_answer(coordinator, board):
    # Prepare
    coordinator.open({board.device_id: assignment()})
    work = next_step(board)

    def report(kind: int, reason: str) -> pb.FailureAck:
        return board.stub.ReportFailure(pb.FailureReport(device_id=board.device_id, step=work.step,
                                                         attempt=work.attempt, kind=kind, reason=reason),
                                        timeout=RPC_TIMEOUT_S)

    # Execute: two malformed reports (they answer nothing), the real one, and a repeat
    unknown_kind = refused(lambda: report(99, "who knows"))
    no_reason = refused(lambda: report(FailureKind.INTERNAL, ""))
    report(FailureKind.NEIGHBOUR_TIMEOUT, "stage 2 sent nothing for 30 s")
    repeated = refused(lambda: report(FailureKind.INTERNAL, "again"))
    outcome = coordinator.wait(work.step, work.attempt)

    # Assert
    _assert_refused(unknown_kind, grpc.StatusCode.INVALID_ARGUMENT, Refusal.UNSPECIFIED, "unknown failure kind 99")
    _assert_refused(no_reason, grpc.StatusCode.INVALID_ARGUMENT, Refusal.UNSPECIFIED, "needs a reason")
    _assert_refused(repeated, grpc.StatusCode.ALREADY_EXISTS, Refusal.ALREADY_ANSWERED)
    assert outcome.rejected == {board.device_id: "failed (neighbour_timeout): stage 2 sent nothing for 30 s"}
    assert outcome.accepted == {}
    assert _heartbeat(board).newest_step == 0


# --- downloads -----------------------------------------------------------------------------------

def test_a_download_of_a_version_not_served_is_refused_and_the_served_one_follows(coordinator, board):
    # Execute
    error = refused(lambda: download(board, 5))
    served = download(board, 0)

    # Assert
    _assert_refused(error, grpc.StatusCode.FAILED_PRECONDITION, Refusal.VERSION_NOT_SERVED,
                    "parameter version 5 is not served; current version is 0")
    expected = state_tensors(coordinator.model)
    assert served.keys() == expected.keys()
    assert all(torch.equal(served[name], expected[name]) for name in expected)


def _download_deltas(board: Board, version: int, base: int) -> list[pb.ParameterMessage]:
    request = pb.ParameterRequest(device_id=board.device_id, version=version, base_version=base)
    return list(board.stub.DownloadParameters(request, timeout=RPC_TIMEOUT_S))


def test_deltas_from_a_job_that_sends_full_parameters_are_not_kept(coordinator, board):
    # Prepare
    coordinator.store.publish(1, state_tensors(coordinator.model))

    # Execute
    error = refused(lambda: _download_deltas(board, 1, 0))

    # Assert
    _assert_refused(error, grpc.StatusCode.FAILED_PRECONDITION, Refusal.DELTAS_NOT_KEPT,
                    "this job's downlink sends full parameters")
    assert download(board, 1)


def test_deltas_from_a_version_no_longer_kept_are_refused_and_kept_ones_are_served():
    # Prepare: an int8 downlink keeps the deltas of the last 8 versions; 10 are published
    coordinator = serve_coordinator(small_job(compression={"downlink": "int8"}))
    channel = transport.open_channel(coordinator.address)
    try:
        board = join(pb_grpc.CoordinatorStub(channel))
        for version in range(1, 10):
            with torch.no_grad():
                for p in coordinator.model.parameters():
                    p.add_(0.01)
            coordinator.store.publish(version, state_tensors(coordinator.model))

        # Execute
        error = refused(lambda: _download_deltas(board, 9, 0))
        kept = _download_deltas(board, 9, 7)

        # Assert
        _assert_refused(error, grpc.StatusCode.FAILED_PRECONDITION, Refusal.DELTAS_NOT_KEPT,
                        "deltas from version 0 to 9 are not kept (kept: deltas to versions 2..9)")
        names = {spec.name.split("/", 1)[0] for spec in kept[0].header.tensors}
        assert names == {"v8", "v9"}
    finally:
        channel.close()
        coordinator.close()


def test_a_version_published_again_is_served_as_published_last(coordinator, board):
    # Prepare: version 0 is downloaded once (so the servicer has encoded it), then published anew
    download(board, 0)
    changed = {name: tensor + 1.0 for name, tensor in state_tensors(coordinator.model).items()}
    coordinator.store.publish(0, changed)

    # Execute
    served = download(board, 0)

    # Assert
    assert all(torch.equal(served[name], changed[name]) for name in changed)


def test_an_update_with_a_report_nothing_can_use_is_refused_as_the_tickets_answer(coordinator, board, tmp_path):
    # Prepare: a good gradient whose report says the loss was NaN (a diverged board)
    coordinator.open({board.device_id: assignment()})
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    head = header(board, grad)
    head.report.loss = float("nan")

    # Execute
    error = refused(lambda: upload(board, head, chunks(grad)))
    outcome = coordinator.wait(work.step, work.attempt)

    # Assert: refused precisely, and counted as the board's refused answer, not as a board gone missing
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "loss must be finite" in error.details()
    assert outcome.missing == [] and "bad step report" in outcome.rejected[board.device_id]


def test_an_out_of_memory_report_asks_the_planner_for_less_memory_on_that_board(coordinator, board):
    # Prepare
    coordinator.open({board.device_id: assignment()})
    work = next_step(board)

    # Execute: the board's device ran out of memory for its part of the step
    board.stub.ReportFailure(pb.FailureReport(device_id=board.device_id, step=work.step, attempt=work.attempt,
                                              kind=FailureKind.OUT_OF_MEMORY, reason="blocks [2, 5) do not fit"),
                             timeout=RPC_TIMEOUT_S)
    outcome = coordinator.wait(work.step, work.attempt)

    # Assert: the attempt has its answer, and the board stays, marked for the planner
    assert outcome.rejected == {board.device_id: "failed (out_of_memory): blocks [2, 5) do not fit"}
    record = coordinator.registry.get(board.device_id)
    assert record.alive and record.out_of_memory
    coordinator.registry.cap_memory(board.device_id, 10**7)
    assert not coordinator.registry.get(board.device_id).out_of_memory
