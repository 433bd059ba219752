"""Bad input from a hand-written client: precise status codes, and the coordinator keeps serving.

Each test starts a real coordinator on 127.0.0.1:0 (mutual TLS under the session's fleet
authority) and speaks raw gRPC to it through the generated stubs, with a board certificate for
the name it registers as, computing real gradients for the samples it is assigned, so every
refusal is the coordinator's own and every "keeps serving" check is a real accepted upload or a
real next step. An attempt whose only update was refused applies nothing: the step is redone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable

import grpc
import pytest
from conftest import small_job
from rawboard import (
    CHUNK,
    RPC_TIMEOUT_S,
    Board,
    Gradient,
    Piece,
    chunks,
    compute_gradient,
    download,
    gradient_of,
    header,
    join,
    next_step,
    refused,
    register,
    stream,
    train_records,
    upload,
    upload_good,
)

import edgetrain
from coordinator.training.rounds import JobAborted
from edgetrain import transport
from edgetrain.errors import FailureKind, Refusal
from edgetrain.streaming import RawChunk
from edgetrain.transport import MAX_MESSAGE_BYTES
from protos import coordinator_pb2 as pb
from protos import tensor_pb2 as tpb

pytestmark = pytest.mark.timeout(60)

def bad_input_job(**training):
    """50 steps, one board, a 30 s step deadline; heartbeats lenient so a slow host is not dropped."""
    return small_job(training={"steps": 50, "min_clients": 1, "step_timeout_s": 30,
                               "heartbeat_timeout_s": 30.0, **training})


@pytest.fixture
def coordinator(coordinator_factory):
    """A coordinator for `bad_input_job()`; on teardown it must stop within a few seconds."""
    running = coordinator_factory(bad_input_job())
    yield running
    running.stop.set()
    running.thread.join(15)
    assert not running.thread.is_alive(), "coordinator did not stop within 15 s"


@pytest.fixture
def board(coordinator) -> Board:
    return join(coordinator.stub())


def redone_then_applied(board: Board, work: pb.StepWork, tmp_path, run_dir) -> dict:
    """After the only board's update for `work` was refused: the step is redone (a new attempt
    of the same step, nothing applied), a good upload for the redo is applied, and the step's
    record follows. Returns that record."""
    redo = next_step(board)
    assert (redo.step, redo.attempt) == (work.step, work.attempt + 1), "the step was not redone"
    assert work.step not in train_records(run_dir), "a step without a usable update was recorded as trained"
    upload_good(board, compute_gradient(board, redo, tmp_path))
    assert next_step(board).step == work.step + 1
    record = train_records(run_dir)[work.step]
    assert (record["attempts"], record["samples"]) == (work.attempt + 2, 24)
    assert [f["attempt"] for f in record["failures"]] == [work.attempt]
    assert board.device_id in record["failures"][0]["no_usable_update"]
    return record


# --- the happy path ----------------------------------------------------------------------------

def test_raw_client_good_upload_is_accepted_and_training_moves_on(coordinator, board, tmp_path):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)

    # Execute
    reply = upload_good(board, grad)
    following = next_step(board)

    # Assert
    assert (work.step, work.attempt, work.param_version) == (0, 0, 0)
    assert len(work.indices) == 24
    assert reply.received_bytes == len(grad.payload)
    assert following.step == 1
    record = train_records(coordinator.run_dir)[0]
    assert record["samples"] == 24
    assert record["rejected"] == {}
    assert record["devices"][board.device_id]["samples"] == 24


# --- refused updates: nothing is applied, the step is redone --------------------------------------

def _wrong_shape(spec: tpb.TensorSpec) -> list[str]:
    """Reverse the first tensor's dimensions (same byte count): only the shape is wrong."""
    want = list(spec.shape)
    spec.shape[:] = want[::-1]
    return [f"shape {want[::-1]}", f"expected {want}"]


def _wrong_dtype(spec: tpb.TensorSpec) -> list[str]:
    """Declare float32 bytes as int32 (same 4 bytes per element): only the dtype is wrong."""
    spec.dtype = tpb.INT32
    return ["dtype int32", "expected float32"]


@pytest.mark.parametrize("corrupt", [_wrong_shape, _wrong_dtype], ids=["shape", "dtype"])
def test_header_with_wrong_tensor_is_rejected_and_the_step_is_redone(coordinator, board, tmp_path, corrupt):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    head = header(board, grad)
    spec = next(t for t in head.bundle.tensors if len(t.shape) >= 2)  # a shape that reversed differs
    name = spec.name
    fragments = corrupt(spec)

    # Execute
    error = refused(lambda: upload(board, head, chunks(grad)))
    record = redone_then_applied(board, work, tmp_path, coordinator.run_dir)

    # Assert
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {name!r}" in error.details()
    for fragment in fragments:
        assert fragment in error.details()
    assert fragments[0] in record["rejected"][board.device_id]
    assert record["failed"] == []


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_gradient_is_rejected_and_the_step_is_redone(coordinator, board, tmp_path, bad_value):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    tensors = dict(grad.tensors)
    first = next(iter(tensors))
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[:3] = bad_value
    poisoned = gradient_of(work, tensors, grad.report)

    # Execute
    error = refused(lambda: upload_good(board, poisoned))
    record = redone_then_applied(board, work, tmp_path, coordinator.run_dir)

    # Assert
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {first!r} has 3 non-finite (NaN/Inf) values" in error.details()
    assert "non-finite" in record["rejected"][board.device_id]


def test_sample_count_not_matching_assignment_is_rejected(coordinator, board, tmp_path):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    grad.report.samples = len(work.indices) + 1

    # Execute
    error = refused(lambda: upload_good(board, grad))

    # Assert
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    want = len(work.indices)
    assert f"report says {want + 1} samples, assignment had {want}" in error.details()
    redone_then_applied(board, work, tmp_path, coordinator.run_dir)


def test_a_step_without_a_usable_update_in_every_attempt_stops_the_job(coordinator_factory, tmp_path):
    # Prepare: two attempts per step; the only board trains step 0, then gives step 1 up twice
    running = coordinator_factory(bad_input_job(steps=3, max_attempts=2))
    board = join(running.stub())
    work = next_step(board)
    upload_good(board, compute_gradient(board, work, tmp_path))

    # Execute
    for attempt in (0, 1):
        work = next_step(board)
        assert (work.step, work.attempt) == (1, attempt)
        board.stub.ReportFailure(pb.FailureReport(device_id=board.device_id, step=1, attempt=attempt,
                                                  kind=FailureKind.INTERNAL, reason="out of memory"),
                                 timeout=RPC_TIMEOUT_S)
    with pytest.raises(JobAborted) as stopped:
        running.wait(timeout=30)

    # Assert: the job stopped saying why; step 1 was never counted as trained
    assert str(stopped.value) == (f"step 1 failed on all 2 attempts; the last brought no usable update "
                                  f"({board.device_id}: failed (internal): out of memory)")
    assert list(train_records(running.run_dir)) == [0]
    summary = json.loads((running.run_dir / "summary.json").read_text())
    assert (summary["steps_applied"], summary["steps_attempted"]) == (1, 2)
    assert summary["stopped"] == str(stopped.value)


# --- broken streams resume from the last good byte -----------------------------------------------

def test_bad_crc_is_data_loss_and_upload_resumes_from_held_bytes(coordinator, board, tmp_path):
    # Prepare: five good chunks, then one whose crc32 does not match its data
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    good, bad = chunks(grad, stop=5 * CHUNK), chunks(grad)[5]
    status_request = pb.UploadStatusRequest(device_id=board.device_id, step=work.step, attempt=work.attempt)

    # Execute
    corrupted = RawChunk(bad.offset, bad.data, bad.crc32 ^ 1)
    error = refused(lambda: upload(board, header(board, grad), [*good, corrupted]))
    status = board.stub.GetUploadStatus(status_request, timeout=RPC_TIMEOUT_S)
    reply = upload(board, header(board, grad, resume_offset=status.received_bytes),
                   chunks(grad, start=status.received_bytes))

    # Assert
    assert error.code() == grpc.StatusCode.DATA_LOSS
    at = 5 * CHUNK
    assert f"chunk at byte {at} failed its crc32 check; resume from byte {at}" in error.details()
    assert (status.received_bytes, status.total_bytes) == (5 * CHUNK, len(grad.payload))
    assert reply.received_bytes == len(grad.payload)
    assert next_step(board).step == work.step + 1
    assert board.device_id in train_records(coordinator.run_dir)[work.step]["devices"]


def test_truncated_stream_is_data_loss_and_resume_completes(coordinator, board, tmp_path):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    held, total = 7 * CHUNK, len(grad.payload)

    # Execute
    error = refused(lambda: upload(board, header(board, grad), chunks(grad, stop=held)))
    status = board.stub.GetUploadStatus(
        pb.UploadStatusRequest(device_id=board.device_id, step=work.step, attempt=work.attempt),
        timeout=RPC_TIMEOUT_S)
    reply = upload(board, header(board, grad, resume_offset=held), chunks(grad, start=held))

    # Assert
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert f"stream ended at byte {held} of {total}; resume from byte {held}" in error.details()
    assert status.received_bytes == held
    assert reply.received_bytes == total
    assert next_step(board).step == work.step + 1


def test_resume_that_repeats_held_bytes_is_accepted(coordinator, board, tmp_path):
    # Prepare: 3 chunks held; the resumed sender starts over from byte 0 (duplicates are ignored)
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    refused(lambda: upload(board, header(board, grad), chunks(grad, stop=3 * CHUNK)))

    # Execute
    reply = upload(board, header(board, grad), chunks(grad))

    # Assert
    assert reply.received_bytes == len(grad.payload)
    assert next_step(board).step == work.step + 1


def _as_messages(head: pb.UploadHeader | None, pieces: Iterable[Piece]) -> list[pb.UploadMessage]:
    return list(stream(head, pieces))


def _streamed_header(b: Board, g: Gradient) -> pb.UploadHeader:
    """The header of a streamed upload (sent before backward ended): no report in it."""
    head = header(b, g)
    head.ClearField("report")
    return head


def _closing(g: Gradient) -> pb.UploadMessage:
    """The step report that closes a streamed upload."""
    return pb.UploadMessage(report=g.report)


def test_streamed_upload_with_its_report_last_is_accepted(coordinator, board, tmp_path):
    # Prepare: the header without a report, the chunks, then the report (as a board streaming
    # its gradients during backward sends them)
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    messages = [*_as_messages(_streamed_header(board, grad), chunks(grad)), _closing(grad)]

    # Execute
    reply = board.stub.UploadGradient(iter(messages), timeout=RPC_TIMEOUT_S)

    # Assert
    assert reply.received_bytes == len(grad.payload)
    assert next_step(board).step == work.step + 1
    device = train_records(coordinator.run_dir)[work.step]["devices"][board.device_id]
    assert device["samples"] == 24
    assert device["upload_streamed"] is True


@pytest.mark.parametrize(("make_messages", "code", "fragment"), [
    pytest.param(lambda b, g: _as_messages(header(b, g), [chunks(g)[0], chunks(g)[2]]),
                 grpc.StatusCode.OUT_OF_RANGE,
                 f"chunk at byte {2 * CHUNK} leaves a gap; resume from byte {CHUNK}",
                 id="gap"),
    pytest.param(lambda b, g: _as_messages(header(b, g, resume_offset=CHUNK), chunks(g, start=CHUNK)),
                 grpc.StatusCode.OUT_OF_RANGE, f"resume_offset {CHUNK} is past the 0 bytes held",
                 id="resume-past-held"),
    pytest.param(lambda b, g: _as_messages(header(b, g),
                                           [tpb.Chunk(offset=len(g.payload) - 10, data=bytes(20))]),
                 grpc.StatusCode.OUT_OF_RANGE, "runs past the declared", id="past-total"),
    pytest.param(lambda b, g: _as_messages(None, chunks(g)), grpc.StatusCode.INVALID_ARGUMENT,
                 "an upload must start with an UploadHeader message", id="chunk-first"),
    pytest.param(lambda b, g: [pb.UploadMessage()], grpc.StatusCode.INVALID_ARGUMENT,
                 "an upload must start with an UploadHeader message", id="empty-message-first"),
    pytest.param(lambda b, g: [], grpc.StatusCode.INVALID_ARGUMENT,
                 "an upload must start with an UploadHeader message", id="empty-stream"),
    pytest.param(lambda b, g: _as_messages(header(b, g), []) * 2, grpc.StatusCode.INVALID_ARGUMENT,
                 "only chunks may follow the upload header", id="second-header"),
    pytest.param(lambda b, g: [*_as_messages(header(b, g), chunks(g)), _closing(g)],
                 grpc.StatusCode.INVALID_ARGUMENT, "only chunks may follow the upload header",
                 id="report-after-a-plain-upload"),
    pytest.param(lambda b, g: _as_messages(_streamed_header(b, g), chunks(g)), grpc.StatusCode.INVALID_ARGUMENT,
                 "ended without its step report", id="streamed-without-report"),
    pytest.param(lambda b, g: [*_as_messages(_streamed_header(b, g), chunks(g)[:2]), _closing(g),
                               *_as_messages(None, chunks(g)[2:])],
                 grpc.StatusCode.INVALID_ARGUMENT, "a chunk message after the step report", id="chunk-after-report"),
    pytest.param(lambda b, g: [*_as_messages(_streamed_header(b, g), chunks(g)), _closing(g), _closing(g)],
                 grpc.StatusCode.INVALID_ARGUMENT, "a report message after the step report", id="second-report"),
])
def test_malformed_stream_is_refused_and_good_upload_follows(coordinator, board, tmp_path, make_messages,
                                                            code, fragment):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    messages = make_messages(board, grad)

    # Execute
    error = refused(lambda: board.stub.UploadGradient(iter(messages), timeout=RPC_TIMEOUT_S))
    reply = upload_good(board, grad)

    # Assert
    assert error.code() == code
    assert fragment in error.details()
    assert reply.received_bytes == len(grad.payload)
    assert next_step(board).step == work.step + 1


def test_oversize_message_is_resource_exhausted_and_server_keeps_serving(coordinator, board, tmp_path):
    # Prepare: one chunk of 9 MiB, above the 8 MiB receive limit
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    data = bytes(9 * 1024 * 1024)
    assert len(data) > MAX_MESSAGE_BYTES
    huge = tpb.Chunk(offset=0, data=data, crc32=0)

    # Execute
    error = refused(lambda: upload(board, header(board, grad), [huge]))
    reply = upload_good(board, grad)

    # Assert
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE_BYTES) in error.details()
    assert reply.received_bytes == len(grad.payload)
    assert next_step(board).step == work.step + 1


# --- uploads for the wrong step ------------------------------------------------------------------

@pytest.mark.parametrize(("shift_step", "shift_attempt"), [(100, 0), (0, 3)], ids=["step", "attempt"])
def test_unknown_step_or_attempt_is_not_found(coordinator, board, tmp_path, shift_step, shift_attempt):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    step, attempt = work.step + shift_step, work.attempt + shift_attempt
    status_request = pb.UploadStatusRequest(device_id=board.device_id, step=step, attempt=attempt)

    # Execute
    wrong = header(board, grad, step=step, attempt=attempt)
    upload_error = refused(lambda: upload(board, wrong, chunks(grad)))
    status_error = refused(lambda: board.stub.GetUploadStatus(status_request, timeout=RPC_TIMEOUT_S))
    reply = upload_good(board, grad)

    # Assert
    for error in (upload_error, status_error):
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert (f"unknown step {step} attempt {attempt}; current: step {work.step} attempt {work.attempt}"
                in error.details())
    assert reply.received_bytes == len(grad.payload)


def test_upload_for_a_closed_step_is_failed_precondition(coordinator, board, tmp_path):
    # Prepare: step 0 answered and closed (the board already has step 1)
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    upload_good(board, grad)
    following = next_step(board)

    # Execute
    error = refused(lambda: upload_good(board, grad))

    # Assert
    assert following.step == work.step + 1
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"step {work.step} attempt {work.attempt} is closed" in error.details()
    later = compute_gradient(board, following, tmp_path)
    assert upload_good(board, later).received_bytes == len(later.payload)


def test_second_upload_while_step_still_open_is_already_exists(coordinator_factory, tmp_path):
    # Prepare: two boards share step 0; the first answers twice before the second answers
    running = coordinator_factory(bad_input_job(min_clients=2))
    first, second = join(running.stub("raw-a"), "raw-a"), join(running.stub("raw-b"), "raw-b")
    try:
        work_a, work_b = next_step(first), next_step(second)
        grad_a = compute_gradient(first, work_a, tmp_path)
        upload_good(first, grad_a)

        # Execute
        error = refused(lambda: upload_good(first, grad_a))
        stranger = refused(lambda: upload(second, header(second, grad_a, device_id="raw-c-404"), []))
        upload_good(second, compute_gradient(second, work_b, tmp_path))

        # Assert
        assert work_a.step == work_b.step == 0
        assert len(work_a.indices) + len(work_b.indices) == 24
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"device {first.device_id} already answered step 0 attempt 0" in error.details()
        assert stranger.code() == grpc.StatusCode.NOT_FOUND
        assert next_step(first).step == 1
        record = train_records(running.run_dir)[0]
        assert set(record["devices"]) == {first.device_id, second.device_id}
        assert record["samples"] == 24
    finally:
        running.stop.set()


# --- unknown devices, bad registrations and profiles ---------------------------------------------

def test_unknown_device_is_not_found_on_every_rpc(coordinator, board, tmp_path):
    # Prepare
    ghost = "ghost-404"
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    calls = {
        "Heartbeat": lambda: board.stub.Heartbeat(pb.HeartbeatRequest(device_id=ghost),
                                                  timeout=RPC_TIMEOUT_S),
        "GetWork": lambda: board.stub.GetWork(pb.WorkRequest(device_id=ghost, max_wait_s=0.1),
                                              timeout=RPC_TIMEOUT_S),
        "UploadGradient": lambda: upload(board, header(board, grad, device_id=ghost), chunks(grad)),
        "GetUploadStatus": lambda: board.stub.GetUploadStatus(
            pb.UploadStatusRequest(device_id=ghost, step=work.step, attempt=work.attempt),
            timeout=RPC_TIMEOUT_S),
        "DownloadParameters": lambda: list(board.stub.DownloadParameters(
            pb.ParameterRequest(device_id=ghost, version=work.param_version), timeout=RPC_TIMEOUT_S)),
        "ReportProfile": lambda: board.stub.ReportProfile(pb.ProfileReport(
            device_id=ghost, timings=[pb.BatchTiming(batch_size=4, seconds=0.1)]), timeout=RPC_TIMEOUT_S),
    }

    # Execute
    errors = {rpc: refused(call) for rpc, call in calls.items()}

    # Assert
    for rpc, error in errors.items():
        assert error.code() == grpc.StatusCode.NOT_FOUND, rpc
        assert f"unknown device id {ghost!r}; register again" in error.details(), rpc
    board.stub.Heartbeat(pb.HeartbeatRequest(device_id=board.device_id), timeout=RPC_TIMEOUT_S)
    assert upload_good(board, grad).received_bytes == len(grad.payload)


def test_download_of_unserved_version_or_offset_is_refused(coordinator, board):
    # Prepare
    work = next_step(board)

    # Execute
    stale = refused(lambda: list(board.stub.DownloadParameters(
        pb.ParameterRequest(device_id=board.device_id, version=work.param_version + 5),
        timeout=RPC_TIMEOUT_S)))
    past = refused(lambda: list(board.stub.DownloadParameters(
        pb.ParameterRequest(device_id=board.device_id, version=work.param_version, offset=10**9),
        timeout=RPC_TIMEOUT_S)))

    # Assert
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"parameter version {work.param_version + 5} is not served" in stale.details()
    assert past.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"offset {10**9} is past the" in past.details()
    assert download(board, work.param_version)


def test_protocol_version_mismatch_is_failed_precondition(coordinator):
    # Prepare
    stub = coordinator.stub("old-board")
    wrong = edgetrain.PROTOCOL_VERSION + 1

    # Execute
    error = refused(lambda: register(stub, "old-board", protocol_version=wrong))
    reply = register(stub, "old-board")

    # Assert
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol version {wrong} not supported" in error.details()
    assert f"speaks {edgetrain.PROTOCOL_VERSION}" in error.details()
    assert reply.device_id


def test_register_without_a_name_takes_the_certificates_and_another_name_is_refused(coordinator):
    # Prepare
    stub = coordinator.stub("named-by-cert")

    # Execute
    reply = register(stub, name="")
    error = refused(lambda: register(stub, name="someone-else"))
    listed = stub.ListDevices(pb.ListDevicesRequest(), timeout=RPC_TIMEOUT_S).devices

    # Assert
    assert reply.device_id.startswith("named-by-cert-")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert transport.error_reason(error) == Refusal.NOT_PERMITTED
    assert "cannot take another board's name (someone-else)" in error.details()
    assert [(d.device_id, d.info.name) for d in listed] == [(reply.device_id, "named-by-cert")]


@pytest.mark.parametrize("timings", [
    pytest.param([], id="empty"),
    pytest.param([pb.BatchTiming(batch_size=0, seconds=0.1)], id="zero-batch"),
    pytest.param([pb.BatchTiming(batch_size=4, seconds=0.0)], id="zero-seconds"),
    pytest.param([pb.BatchTiming(batch_size=4, seconds=float("nan"))], id="nan-seconds"),
    pytest.param([pb.BatchTiming(batch_size=4, seconds=float("inf"))], id="inf-seconds"),
])
def test_report_profile_with_unusable_timings_is_invalid_argument(coordinator, timings):
    # Prepare
    stub = coordinator.stub()
    device_id = register(stub).device_id

    # Execute
    error = refused(lambda: stub.ReportProfile(pb.ProfileReport(device_id=device_id, timings=timings),
                                               timeout=RPC_TIMEOUT_S))
    board = join(stub)

    # Assert
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "profile needs timings with batch_size > 0 and finite seconds > 0" in error.details()
    assert next_step(board).step == 0


@pytest.mark.parametrize("wait", [float("nan"), float("inf")])
def test_get_work_with_non_finite_wait_is_invalid_argument(coordinator, board, wait):
    # Execute
    error = refused(lambda: board.stub.GetWork(pb.WorkRequest(device_id=board.device_id, max_wait_s=wait),
                                               timeout=RPC_TIMEOUT_S))

    # Assert: refused at once, and the coordinator still hands out work
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_wait_s must be a finite number" in error.details()
    assert next_step(board).step == 0


# --- shutdown ------------------------------------------------------------------------------------

def test_stop_while_a_step_is_open_ends_the_run_promptly(coordinator_factory):
    # Prepare: the board holds step 0 and stays registered, so only `stop` can end the attempt
    running = coordinator_factory(bad_input_job())
    board = join(running.stub())
    next_step(board)

    # Execute
    started = time.monotonic()
    running.stop.set()
    running.thread.join(10.0)

    # Assert
    assert not running.thread.is_alive(), f"still running {time.monotonic() - started:.1f} s after stop"
    assert "stopped" in str(running.result.get("error", ""))


def test_server_serves_concurrent_bad_and_good_calls(coordinator, board, tmp_path):
    # Prepare: a burst of refused calls from other threads while the board uploads
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    codes: list[grpc.StatusCode] = []

    def hammer() -> None:
        for _ in range(10):
            try:
                board.stub.Heartbeat(pb.HeartbeatRequest(device_id="nobody"), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as e:
                codes.append(e.code())

    threads = [threading.Thread(target=hammer) for _ in range(4)]

    # Execute
    for thread in threads:
        thread.start()
    reply = upload_good(board, grad)
    for thread in threads:
        thread.join(RPC_TIMEOUT_S)

    # Assert
    assert codes == [grpc.StatusCode.NOT_FOUND] * 40
    assert reply.received_bytes == len(grad.payload)


def test_metrics_stay_strict_json_when_an_attempt_brought_no_usable_update(coordinator, board, tmp_path):
    # Prepare
    work = next_step(board)
    grad = compute_gradient(board, work, tmp_path)
    grad.report.samples += 1

    # Execute
    refused(lambda: upload_good(board, grad))
    redone_then_applied(board, work, tmp_path, coordinator.run_dir)
    lines = (coordinator.run_dir / "metrics.jsonl").read_text().splitlines()

    # Assert
    def no_constants(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    assert lines
    for line in lines:
        json.loads(line, parse_constant=no_constants)
