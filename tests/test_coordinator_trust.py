"""The coordinator under mutual TLS: who may call it, and a board's name is its certificate.

Real gRPC servers on 127.0.0.1 with real TLS: the in-process coordinator (tests/inprocess.py,
the test plays the trainer) served by coordinator.pairing.serve_gateway under the session's
fleet authority, and `run_coordinator` itself where the whole coordinator matters (its port
file, a restart, a step trained for real with raw boards). Every refusal is checked to have
changed nothing on the server.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import board_channel, small_job, start_coordinator
from inprocess import InProcessCoordinator, assignment, serve_coordinator
from rawboard import (
    RPC_TIMEOUT_S,
    chunks,
    compute_gradient,
    header,
    join,
    next_step,
    refused,
    register,
    train_records,
    upload,
    upload_good,
)

from edge_client.pairing import pair
from edgetrain import transport, trust
from edgetrain.errors import FailureKind, Refusal
from edgetrain.streaming import RawChunk
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coordinator(fleet_authority) -> Iterator[InProcessCoordinator]:
    """An in-process coordinator serving mutual TLS under the session's fleet authority."""
    running = serve_coordinator(small_job(), authority=fleet_authority)
    yield running
    running.close()


def _stub(address: str, security: transport.Security) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(transport.open_channel(address, security))


def _registered(coordinator: InProcessCoordinator) -> list[tuple[str, str, float]]:
    """(device id, name, last seen) of every device: what a refused call must leave as it was."""
    return [(r.device_id, r.name, r.last_seen) for r in coordinator.registry.snapshot()]


def _assert_refused(error: grpc.RpcError, code: grpc.StatusCode, reason: Refusal, fragment: str = "") -> None:
    assert (error.code(), transport.error_reason(error)) == (code, reason), error.details()
    assert fragment in error.details()


# --- who may connect -----------------------------------------------------------------------------

def _without_certificate(authority: trust.Authority, tmp_path: Path) -> transport.Security:
    """TLS that trusts the fleet CA but shows no certificate of its own."""
    class ServerTLSOnly(transport.Security):
        def channel_credentials(self):
            return grpc.ssl_channel_credentials(root_certificates=authority.ca_pem)

        def channel_options(self):
            return [("grpc.ssl_target_name_override", trust.GATEWAY_SERVER_NAME)]

    return ServerTLSOnly()


def _another_fleets_board(authority: trust.Authority, tmp_path: Path) -> transport.Security:
    """A board certificate of another CA, by a client that trusts this fleet's CA."""
    stranger = trust.Authority.create(tmp_path / "other").issue_identity("intruder", trust.BOARD)
    return trust.Identity(stranger.key, stranger.cert, authority.ca_pem).security()


def _expired_board(authority: trust.Authority, tmp_path: Path) -> transport.Security:
    """A certificate of this fleet that expired two minutes ago."""
    return authority.issue_identity("intruder", trust.BOARD, days=-2 / 1440).security()


def _plaintext(authority: trust.Authority, tmp_path: Path) -> transport.Security:
    return transport.INSECURE


@pytest.mark.parametrize("security", [_without_certificate, _another_fleets_board, _expired_board, _plaintext],
                         ids=["no-certificate", "another-ca", "expired", "plaintext"])
def test_a_caller_without_a_valid_fleet_certificate_fails_the_handshake(coordinator, fleet_authority, tmp_path,
                                                                       security):
    # Prepare
    honest = join(pb_grpc.CoordinatorStub(board_channel(coordinator.address, "honest")), "honest")
    before = _registered(coordinator)
    stranger = _stub(coordinator.address, security(fleet_authority, tmp_path))

    # Execute
    errors = [refused(lambda: register(stranger, "intruder")),
              refused(lambda: stranger.ListDevices(pb.ListDevicesRequest(), timeout=RPC_TIMEOUT_S)),
              refused(lambda: stranger.ReportFailure(pb.FailureReport(
                  device_id=honest.device_id, step=0, attempt=0, reason="forged", kind=FailureKind.INTERNAL),
                  timeout=RPC_TIMEOUT_S))]

    # Assert: refused before any handler ran; nothing changed and the fleet's board is served
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE] * 3, [e.details() for e in errors]
    assert _registered(coordinator) == before
    honest.stub.Heartbeat(pb.HeartbeatRequest(device_id=honest.device_id), timeout=RPC_TIMEOUT_S)


def test_a_revoked_board_is_refused_from_its_next_call_and_nothing_changes(coordinator, fleet_authority):
    # Prepare: a board registered and profiled, then revoked on the gateway
    board = join(pb_grpc.CoordinatorStub(board_channel(coordinator.address, "revoked-raw-board")), "revoked-raw-board")
    board.stub.Heartbeat(pb.HeartbeatRequest(device_id=board.device_id), timeout=RPC_TIMEOUT_S)
    fleet_authority.revoke("revoked-raw-board")
    before = _registered(coordinator)

    # Execute
    heartbeat = refused(lambda: board.stub.Heartbeat(pb.HeartbeatRequest(device_id=board.device_id),
                                                     timeout=RPC_TIMEOUT_S))
    again = refused(lambda: register(board.stub, "revoked-raw-board"))
    listing = refused(lambda: board.stub.ListDevices(pb.ListDevicesRequest(), timeout=RPC_TIMEOUT_S))

    # Assert
    for error in (heartbeat, again, listing):
        _assert_refused(error, grpc.StatusCode.PERMISSION_DENIED, Refusal.CREDENTIAL_REVOKED, "was revoked")
    assert _registered(coordinator) == before


def test_an_operator_certificate_lists_devices_but_cannot_register(coordinator, fleet_authority):
    # Prepare
    join(pb_grpc.CoordinatorStub(board_channel(coordinator.address, "listed")), "listed")
    operator = _stub(coordinator.address, fleet_authority.operator_identity().security(trust.GATEWAY_SERVER_NAME))
    before = _registered(coordinator)

    # Execute
    error = refused(lambda: register(operator, "listed"))
    listed = operator.ListDevices(pb.ListDevicesRequest(), timeout=RPC_TIMEOUT_S).devices

    # Assert
    _assert_refused(error, grpc.StatusCode.PERMISSION_DENIED, Refusal.NOT_PERMITTED, "needs a board credential")
    assert [d.info.name for d in listed] == ["listed"]
    assert _registered(coordinator) == before


# --- a board is its certificate ------------------------------------------------------------------

def test_a_board_cannot_register_under_another_boards_name(coordinator):
    # Prepare
    stub = pb_grpc.CoordinatorStub(board_channel(coordinator.address, "board-a"))

    # Execute
    error = refused(lambda: register(stub, "board-b"))
    own = register(stub, "board-a")

    # Assert
    _assert_refused(error, grpc.StatusCode.PERMISSION_DENIED, Refusal.NOT_PERMITTED,
                    "board board-a cannot take another board's name (board-b)")
    assert [r.name for r in coordinator.registry.snapshot()] == ["board-a"]
    assert own.device_id.startswith("board-a-")


def test_a_board_cannot_act_for_another_boards_device_and_the_step_is_not_voided(coordinator, tmp_path):
    # Prepare: boards A and B share an attempt; A knows B's device id (ListDevices shows it)
    a = join(pb_grpc.CoordinatorStub(board_channel(coordinator.address, "board-a")), "board-a")
    b = join(pb_grpc.CoordinatorStub(board_channel(coordinator.address, "board-b")), "board-b")
    coordinator.open({a.device_id: assignment(indices=range(0, 240, 20)),
                      b.device_id: assignment(indices=range(240, 480, 20))})
    work_b = next_step(b)
    grad_b = compute_gradient(b, work_b, tmp_path)
    victim, stub = b.device_id, a.stub
    before, speed_before = _registered(coordinator), coordinator.registry.get(victim).speed
    bad_report = header(a, grad_b, device_id=victim)
    bad_report.report.loss = float("nan")
    calls = {
        "ReportFailure": lambda: stub.ReportFailure(pb.FailureReport(
            device_id=victim, step=0, attempt=0, reason="forged", kind=FailureKind.INTERNAL), timeout=RPC_TIMEOUT_S),
        "UploadGradient": lambda: upload(a, header(a, grad_b, device_id=victim), chunks(grad_b)),
        "UploadGradient(bad report)": lambda: upload(a, bad_report, []),
        "GetUploadStatus": lambda: stub.GetUploadStatus(pb.UploadStatusRequest(device_id=victim, step=0, attempt=0),
                                                        timeout=RPC_TIMEOUT_S),
        "Heartbeat": lambda: stub.Heartbeat(pb.HeartbeatRequest(device_id=victim), timeout=RPC_TIMEOUT_S),
        "GetWork": lambda: stub.GetWork(pb.WorkRequest(device_id=victim, max_wait_s=0.1), timeout=RPC_TIMEOUT_S),
        "DownloadParameters": lambda: list(stub.DownloadParameters(pb.ParameterRequest(device_id=victim, version=0),
                                                                   timeout=RPC_TIMEOUT_S)),
        "ReportProfile": lambda: stub.ReportProfile(pb.ProfileReport(
            device_id=victim, timings=[pb.BatchTiming(batch_size=4, seconds=1e-4)]), timeout=RPC_TIMEOUT_S),
        "Probe": lambda: stub.Probe(pb.ProbeRequest(device_id=victim, payload=b"x"), timeout=RPC_TIMEOUT_S),
    }

    # Execute
    errors = {rpc: refused(call) for rpc, call in calls.items()}
    after, speed_after = _registered(coordinator), coordinator.registry.get(victim).speed
    upload_good(b, grad_b)
    upload_good(a, compute_gradient(a, next_step(a), tmp_path))
    outcome = coordinator.wait(0)

    # Assert: every call refused naming both boards; B's ticket, profile and liveness untouched
    for rpc, error in errors.items():
        assert (error.code(), transport.error_reason(error)) == (
            grpc.StatusCode.PERMISSION_DENIED, Refusal.NOT_PERMITTED), f"{rpc}: {error.details()}"
        assert f"board board-a cannot call {rpc.split('(')[0]} for device {victim} of board board-b" \
            in error.details(), rpc
    assert (after, speed_after) == (before, speed_before)
    assert sorted(outcome.accepted) == sorted([a.device_id, b.device_id])
    assert outcome.rejected == {} and outcome.missing == []


def test_a_forged_failure_cannot_void_a_trained_step(coordinator_factory, tmp_path):
    # Prepare: a real coordinator training with one raw board; a second paired board that knows
    # the first one's device id tries to fail its step for it
    running = coordinator_factory(small_job(training={"steps": 2, "min_clients": 1, "step_timeout_s": 30,
                                                      "heartbeat_timeout_s": 30.0}))
    victim = join(running.stub("victim"), "victim")
    mallory = running.stub("mallory")
    register(mallory, "mallory")
    work = next_step(victim)

    # Execute
    forged = refused(lambda: mallory.ReportFailure(pb.FailureReport(
        device_id=victim.device_id, step=work.step, attempt=work.attempt, reason="forged",
        kind=FailureKind.INTERNAL), timeout=RPC_TIMEOUT_S))
    upload_good(victim, compute_gradient(victim, work, tmp_path))
    following = next_step(victim)
    upload_good(victim, compute_gradient(victim, following, tmp_path))
    summary = running.wait(timeout=30)

    # Assert: refused, and both steps trained on the victim's update at the first attempt
    _assert_refused(forged, grpc.StatusCode.PERMISSION_DENIED, Refusal.NOT_PERMITTED,
                    "cannot call ReportFailure for device")
    records = train_records(running.run_dir)
    assert [(r["step"], r["attempts"], r["samples"], r["rejected"]) for r in records.values()] == [
        (0, 1, 24, {}), (1, 1, 24, {})]
    assert (summary["steps_applied"], summary["steps_attempted"], summary["stopped"]) == (2, 2, None)


# --- the coordinator's servers -------------------------------------------------------------------

def test_the_port_file_names_the_fleet_and_pairing_ports_and_pairing_survives_a_restart(tmp_path, fleet_authority):
    # Prepare: a coordinator (run_coordinator) under the session authority; a board pairs with the
    # join token through the pairing address of the port file
    job = small_job(training={"steps": 1, "min_clients": 1})
    first = start_coordinator(job, tmp_path / "first")
    lines = (tmp_path / "first" / "address").read_text().splitlines()
    token = fleet_authority.new_token()
    identity = pair(lines[1], token, "restarted", tmp_path / "restarted")
    security = trust.Identity.load(tmp_path / "restarted").security()
    registered_first = register(_stub(first.address, security), "restarted").device_id
    first.stop.set()
    first.thread.join(30)

    # Execute: a new coordinator opening the same authority directory; the board comes back with
    # its saved credentials (its token is spent)
    second = start_coordinator(job, tmp_path / "second")
    try:
        again = register(_stub(second.address, security), "")
        spent = fleet_authority.tokens()[token.token_id]["uses_left"]
    finally:
        second.stop.set()
        second.thread.join(30)

    # Assert
    host, port = first.address.rsplit(":", 1)
    assert lines == [first.address, f"{host}:{int(port) + 1}"]
    assert identity.holder.name == "restarted" and registered_first.startswith("restarted-")
    assert again.device_id.startswith("restarted-") and spent == 0


def test_an_insecure_coordinator_serves_plaintext_on_one_port(tmp_path):
    # Prepare
    from coordinator.main import run_coordinator

    port_file, stop, result = tmp_path / "address", threading.Event(), {}
    thread = threading.Thread(target=lambda: result.setdefault("error", _run_quietly(
        run_coordinator, small_job(), port_file=str(port_file), runs_dir=str(tmp_path / "runs"), stop=stop)),
        daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)

    # Execute
    try:
        lines = port_file.read_text().splitlines()
        stub = _stub(lines[0], transport.INSECURE)
        reply = register(stub, "plain")
        listed = stub.ListDevices(pb.ListDevicesRequest(), timeout=RPC_TIMEOUT_S).devices
    finally:
        stop.set()
        thread.join(30)

    # Assert: one line, no pairing port; the board is named as it says (no certificate to check)
    assert len(lines) == 1
    assert reply.device_id.startswith("plain-") and [d.info.name for d in listed] == ["plain"]
    assert "stopped" in str(result.get("error"))


def _run_quietly(run, job, **kwargs):
    """Run `run(job, **kwargs)`; the exception it ended with (a stopped job raises JobAborted)."""
    try:
        run(job, **kwargs)
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return e
    return None


def test_a_stopped_job_writes_a_summary_that_says_so(coordinator_factory):
    # Prepare: nobody joins; the job is stopped while waiting
    running = coordinator_factory(small_job())

    # Execute
    running.stop.set()
    running.thread.join(30)

    # Assert
    summary = json.loads((running.run_dir / "summary.json").read_text())
    assert (summary["steps_applied"], summary["steps_attempted"]) == (0, 0)
    assert summary["stopped"] == "stopped while waiting for devices"
    assert summary["test_accuracy"] is None
    assert isinstance(running.result.get("error"), Exception)


# --- checksums where the channel has none ---------------------------------------------------------

def test_chunks_carry_a_crc32_only_on_a_plaintext_channel_and_either_kind_is_accepted(coordinator, tmp_path):
    # Prepare: the same job served over mutual TLS (the fixture) and over plaintext, a board on each
    plain = serve_coordinator(small_job())
    try:
        boards = {"tls": join(pb_grpc.CoordinatorStub(board_channel(coordinator.address, "board-a")), "board-a"),
                  "plaintext": join(_stub(plain.address, transport.INSECURE), "board-p")}
        for running, board in ((coordinator, boards["tls"]), (plain, boards["plaintext"])):
            running.open({board.device_id: assignment(indices=range(0, 240, 20))})

        # Execute: each board downloads version 0, then uploads its gradient in chunks without crc32s
        downloaded = {kind: list(board.stub.DownloadParameters(
            pb.ParameterRequest(device_id=board.device_id, version=0), timeout=RPC_TIMEOUT_S))
            for kind, board in boards.items()}
        replies = {}
        for kind, board in boards.items():
            grad = compute_gradient(board, next_step(board), tmp_path)
            bare = [RawChunk(c.offset, c.data, None) for c in chunks(grad)]
            replies[kind] = (upload(board, header(board, grad), bare).received_bytes, len(grad.payload))
        outcomes = [coordinator.wait(0), plain.wait(0)]
    finally:
        plain.close()

    # Assert: TLS authenticates every byte, so its chunks have no crc32; plaintext's all have theirs;
    # the bytes are the same; uploads without crc32s are taken whole on both
    pieces = {kind: [m.chunk for m in messages if m.WhichOneof("kind") == "chunk"] for kind, messages in downloaded.items()}
    assert pieces["tls"] and not any(c.HasField("crc32") for c in pieces["tls"])
    assert all(c.HasField("crc32") and c.crc32 == zlib.crc32(c.data) for c in pieces["plaintext"])
    assert b"".join(c.data for c in pieces["tls"]) == b"".join(c.data for c in pieces["plaintext"])
    assert all(received == total for received, total in replies.values()), replies
    assert [sorted(o.accepted) for o in outcomes] == [[boards["tls"].device_id], [boards["plaintext"].device_id]]
