"""Who may use a job server, over real mutual TLS: strangers, boards, operators, another fleet.

The job server and its gRPC face run in this process (tests/test_job_server.InProcessServer,
served exactly as `serve_jobs` serves them) under the session's fleet authority; nothing here
trains. Every refusal is followed by a call that must still succeed.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from conftest import board_identity, wait_for
from test_job_server import InProcessServer, job_yaml, operator_security, session_authority

import edgetrain
from coordinator.jobs.lobby import FAR_OFF, LobbyBoard, far_off, fleet_ratio, step_rate, upload_mbit
from coordinator.jobs.servicer import serve_jobs
from coordinator.jobs.speed import PlannerSpeed, board_spec, implied_speed
from coordinator.jobs.submission import submitted_job
from coordinator.training.metrics import MetricsLog
from edge_client.pairing import pair
from edgetrain import transport, trust
from edgetrain.config import ConfigError, job_from_dict
from edgetrain.errors import Refusal
from protos import coordinator_pb2 as cpb
from protos import coordinator_pb2_grpc as cpb_grpc
from protos import jobs_pb2 as pb
from protos import jobs_pb2_grpc as pb_grpc

JOB = job_yaml("ok", 5, {"kind": "soft"})


@pytest.fixture
def server(tmp_path):
    running = InProcessServer(tmp_path / "state")
    yield running
    running.close()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _join(stub, name: str, reference_s: float = 0.1):
    return stub.Join(pb.JoinRequest(name=name, reference_s=reference_s, protocol_version=edgetrain.PROTOCOL_VERSION),
                     timeout=10)


def _user_calls(stub) -> list:
    """Submit, Cancel and ListJobs on `stub`, each as a call of no arguments."""
    return [lambda: stub.Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10),
            lambda: stub.Cancel(pb.CancelRequest(id="j1"), timeout=10),
            lambda: stub.ListJobs(pb.ListJobsRequest(), timeout=10)]


def _jobs(server) -> dict[str, str]:
    return {j.id: j.state for j in server.stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs}


def test_a_stranger_without_a_certificate_cannot_submit_cancel_or_list(server):
    server.stub.Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10)
    plaintext = server.stub_as(transport.INSECURE)
    # TLS that verifies the gateway but shows no certificate of its own
    channel = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(session_authority().ca_pem),
                                  options=[("grpc.ssl_target_name_override", trust.GATEWAY_SERVER_NAME)])
    server.channels.append(channel)
    for stranger in (plaintext, pb_grpc.JobServerStub(channel)):
        for call in _user_calls(stranger):
            assert _refused(call).code() == grpc.StatusCode.UNAVAILABLE  # the fleet port's handshake wants a certificate
            assert _jobs(server) == {"j1": "waiting"}
    # the pairing port admits callers without a certificate, to Pair only
    pairing = grpc.secure_channel(f"127.0.0.1:{server.servers.pairing_port}",
                                  grpc.ssl_channel_credentials(session_authority().ca_pem),
                                  options=[("grpc.ssl_target_name_override", trust.GATEWAY_SERVER_NAME)])
    server.channels.append(pairing)
    refused = _refused(lambda: pb_grpc.JobServerStub(pairing).Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10))
    assert refused.code() == grpc.StatusCode.UNIMPLEMENTED
    assert _jobs(server) == {"j1": "waiting"}


def test_a_board_certificate_can_list_but_not_submit_or_cancel(server):
    server.stub.Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10)
    board = server.board("b-curious")
    for call in (lambda: board.Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10),
                 lambda: board.Cancel(pb.CancelRequest(id="j1"), timeout=10)):
        refused = _refused(call)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
        assert transport.error_reason(refused) == Refusal.NOT_PERMITTED
        assert "operator" in refused.details()
        assert _jobs(server) == {"j1": "waiting"}
    assert [j.id for j in board.ListJobs(pb.ListJobsRequest(), timeout=10).jobs] == ["j1"]


def test_an_operator_submits_lists_and_cancels_and_a_gateway_may_too(server):
    view = server.stub.Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10)
    assert (view.id, view.state) == ("j1", "waiting")
    gateway = server.stub_as(session_authority().gateway_identity().security(trust.GATEWAY_SERVER_NAME))
    assert gateway.Cancel(pb.CancelRequest(id="j1"), timeout=10).state == "cancelled"
    assert _jobs(server) == {"j1": "cancelled"}


def test_a_certificate_of_another_fleet_fails_the_handshake(server, tmp_path):
    other = trust.Authority.create(tmp_path / "other")
    for role in (trust.OPERATOR, trust.BOARD):
        foreign = other.issue_identity("intruder", role)
        # it even trusts this fleet's CA, so only its own certificate can fail it
        forged = trust.Identity(foreign.key, foreign.cert, session_authority().ca_pem)
        stub = server.stub_as(forged.security(trust.GATEWAY_SERVER_NAME))
        for call in [*_user_calls(stub), lambda stub=stub: _join(stub, "intruder")]:
            assert _refused(call).code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    assert _jobs(server) == {}
    assert list(server.stub.ListJobs(pb.ListJobsRequest(), timeout=10).boards) == []


def test_a_fake_board_cannot_join_or_take_another_boards_job(server):
    real = server.board("b-real")
    _join(real, "b-real")
    impostor = server.board("b-impostor")
    refused = _refused(lambda: _join(impostor, "b-real"))  # joining under another board's name
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED and "b-real" in refused.details()
    assert transport.error_reason(refused) == Refusal.NOT_PERMITTED
    refused = _refused(lambda: impostor.NextJob(pb.NextJobRequest(name="b-real", max_wait_s=0), timeout=10))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert transport.error_reason(refused) == Refusal.NOT_PERMITTED
    # an operator's certificate is no board's: it cannot join the lobby at all
    refused = _refused(lambda: _join(server.stub, "b-real"))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    # without a certificate nothing gets through the handshake
    assert _refused(lambda: _join(server.stub_as(transport.INSECURE), "b-fake")).code() == grpc.StatusCode.UNAVAILABLE
    boards = server.stub.ListJobs(pb.ListJobsRequest(), timeout=10).boards
    assert [b.name for b in boards] == ["b-real"]
    assert boards[0].claimed_speed == pytest.approx(0.05 / 0.1)  # its own claim, no one else's
    assert real.NextJob(pb.NextJobRequest(name="b-real", max_wait_s=0), timeout=10).job_id == ""


def test_a_revoked_board_is_refused_from_its_next_call(server):
    authority = session_authority()
    identity = authority.issue_identity("b-revoked", trust.BOARD)
    board = server.stub_as(identity.security(trust.GATEWAY_SERVER_NAME))
    _join(board, "b-revoked")
    authority.revoke("b-revoked")
    for call in (lambda: _join(board, "b-revoked"),
                 lambda: board.NextJob(pb.NextJobRequest(name="b-revoked", max_wait_s=0), timeout=10)):
        refused = _refused(call)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert transport.error_reason(refused) == Refusal.CREDENTIAL_REVOKED
    assert _jobs(server) == {}


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("   \n", "empty"),
    ("---\n", "empty"),
    ("{}", "empty"),
    ("[]", "expected a mapping"),
    ("name: x\n", "does not say its model or length (training.steps or training.epochs)"),
    ("name: x\nmodel: small_cnn\n", "does not say its length"),
    ("model: small_cnn\ntraining: {steps: 5}\n", "does not say its name;"),
    ("name: x\nmodel: small_cnn\ntraining: {global_batch: 16}\n", "does not say its length"),
])
def test_an_empty_or_defaulted_submission_is_refused_and_nothing_is_queued(server, text, words):
    refused = _refused(lambda: server.stub.Submit(pb.SubmitRequest(job_yaml=text), timeout=10))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.details()
    assert _jobs(server) == {}
    # a job that writes its name, model and length is queued (the rest may be defaults)
    view = server.stub.Submit(pb.SubmitRequest(job_yaml="name: x\nmodel: small_cnn\ntraining: {epochs: 1}\n"),
                              timeout=10)
    assert (view.name, view.model, view.state) == ("x", "small_cnn", "waiting")


def test_the_jobs_commands_dial_with_the_security_they_are_given(server):
    from coordinator.jobs.command import JobsCommandError, cancel_job, jobs_report

    with pytest.raises(JobsCommandError) as plaintext:
        jobs_report(server=server.address)  # as with --insecure, at a job server of a fleet
    assert plaintext.value.args[0].startswith("UNAVAILABLE: ") and "--insecure" in plaintext.value.args[0]
    assert "\n" not in plaintext.value.args[0]
    board = board_identity("b-cli").security(trust.GATEWAY_SERVER_NAME)
    with pytest.raises(JobsCommandError, match=r"^PERMISSION_DENIED: .*operator"):
        cancel_job("j1", server=server.address, security=board)
    assert jobs_report(server=server.address, security=operator_security()).startswith(
        f"job server {server.address}: scheduler rolling")


def test_the_submission_rule_is_the_same_on_the_command_line(tmp_path):
    from coordinator.jobs.command import JobsCommandError, submit_job

    path = tmp_path / "job.yaml"
    path.write_text("name: x\n")
    with pytest.raises(JobsCommandError, match=r"job.yaml: the job does not say its model or length"):
        submit_job(path, [], server="127.0.0.1:1")  # refused before any server is dialed
    assert submitted_job("name: x\nmodel: small_cnn\ntraining: {steps: 3}\n").training.steps == 3
    with pytest.raises(ConfigError, match="empty"):
        submitted_job("")


def test_serve_jobs_serves_mutual_tls_and_boards_pair_on_the_next_port(tmp_path):
    authority = session_authority()
    stop = threading.Event()
    port_file = tmp_path / "server.address"
    thread = threading.Thread(target=serve_jobs, kwargs=dict(
        bind="127.0.0.1:0", state_dir=tmp_path / "state", runs_dir=tmp_path / "runs", data_dir=tmp_path / "data",
        port_file=str(port_file), stop=stop, authority=authority), daemon=True)
    thread.start()
    try:
        lines = wait_for(lambda: port_file.exists() and port_file.read_text().splitlines(), 120, "the job server")
        address, pairing = lines
        assert pairing == f"127.0.0.1:{int(address.rsplit(':', 1)[1]) + 1}"
        identity = pair(pairing, authority.new_token(), "b-paired", tmp_path / "b-paired")
        board = pb_grpc.JobServerStub(transport.open_channel(address, identity.security(trust.GATEWAY_SERVER_NAME)))
        _join(board, "b-paired")
        operator = pb_grpc.JobServerStub(transport.open_channel(address, operator_security()))
        assert [b.name for b in operator.ListJobs(pb.ListJobsRequest(), timeout=10).boards] == ["b-paired"]
        refused = _refused(lambda: board.Submit(pb.SubmitRequest(job_yaml=JOB), timeout=10))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


@pytest.mark.parametrize("secure", [True, False], ids=["fleet", "insecure"])
def test_a_jobs_coordinator_serves_as_its_job_server_does(tmp_path, secure):
    """Under the job server's authority with no pairing port of its own, or plaintext when the
    job server is --insecure (this one starts a real job coordinator process)."""
    server = InProcessServer(tmp_path / "state", authority=session_authority() if secure else None)
    try:
        board = server.board("b-worker")
        _join(board, "b-worker")
        server.stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("served", 5, {"kind": "hard", "boards": ["b-worker"]})),
                           timeout=10)
        offer = board.NextJob(pb.NextJobRequest(name="b-worker", max_wait_s=30), timeout=200)
        assert offer.job_id == "j1"
        job_address = f"127.0.0.1:{offer.port}"
        port_file = server.server.state_dir / "jobs" / f"{offer.job_name}.address"
        assert port_file.read_text().splitlines() == [job_address]  # no pairing address: boards pair with the job server
        worker = board_identity("b-worker").security(trust.GATEWAY_SERVER_NAME) if secure else transport.INSECURE
        with transport.open_channel(job_address, worker) as channel:
            devices = cpb_grpc.CoordinatorStub(channel).ListDevices(cpb.ListDevicesRequest(), timeout=30)
        assert devices.job_id == offer.job_name
        other = transport.INSECURE if secure else board_identity("b-worker").security(trust.GATEWAY_SERVER_NAME)
        with transport.open_channel(job_address, other) as channel:
            refused = _refused(lambda: cpb_grpc.CoordinatorStub(channel).ListDevices(cpb.ListDevicesRequest(),
                                                                                     timeout=10))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE  # the other kind of channel gets no handshake
        server.stub.Cancel(pb.CancelRequest(id="j1"), timeout=30)
    finally:
        server.close()


# --- claims against measurements ----------------------------------------------------------------


def test_a_claim_far_off_its_measurement_is_flagged_and_planned_by_the_measurement():
    board = LobbyBoard(name="b", claimed_speed=3.0, mbit_per_s=100.0, last_seen=0.0)
    assert (board.speed, board.flag) == (3.0, "")  # not measured: planned as claimed
    board.implied_speed, board.measured_in = 0.3, "j4"
    assert board.far_off and board.speed == board.measured_speed == 0.3
    assert board.flag == "claims 3.00 of a core; its steps in job j4 measured 0.30"
    board.claimed_speed = 0.5  # it joins again with an honest claim
    assert not board.far_off and board.speed == 0.5 and board.flag == ""
    assert far_off(0.1, 0.1 * FAR_OFF * 1.01) and not far_off(0.1, 0.1 * FAR_OFF * 0.99)
    assert not far_off(0.0, 5.0) and not far_off(5.0, 0.0)  # an unknown side says nothing


def test_boards_are_judged_against_the_fleet_once_three_are_measured():
    # every honest board's steps measured 4x its claim (the server timed its reference under load,
    # say); the liar's measured a thousandth of its claim
    boards = [LobbyBoard(name=f"b{i}", claimed_speed=claim, mbit_per_s=0.0, last_seen=0.0, implied_speed=4 * claim)
              for i, claim in enumerate((0.3, 0.5, 0.4))]
    liar = LobbyBoard(name="liar", claimed_speed=400.0, mbit_per_s=0.0, last_seen=0.0, implied_speed=1.6,
                      measured_in="j9")
    assert fleet_ratio([boards[0], liar]) == 1.0  # two boards measured: too few to calibrate
    assert fleet_ratio([*boards[:2], liar]) == pytest.approx(4.0)  # the median of three: the liar cannot move it
    ratio = fleet_ratio([*boards, liar])
    assert ratio == pytest.approx(4.0)
    for board in [*boards, liar]:
        board.fleet_ratio = ratio
    assert [b.flag for b in boards] == ["", "", ""]
    assert liar.far_off and liar.speed == liar.measured_speed == pytest.approx(0.4)  # in the claims' terms
    assert liar.flag == ("claims 400.00 of a core; its steps in job j9 measured 0.40 (other boards' steps "
                         "measured 4.00x their claims)")


def test_the_measured_rate_is_the_median_of_this_launchs_steps_timed_by_the_coordinator(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")  # the coordinator's own step log
    log.write({"kind": "train", "step": 0, "samples": 16, "step_s": 100.0,  # a step of an earlier launch
               "devices": {"b-1": {"upload_bytes": 1_000_000, "upload_s": 100.0}}})
    since = time.time() + 0.01
    wait_for(lambda: time.time() > since + 0.001, 5, "the clock to pass the launch", interval_s=0.005)  # times are in ms
    steps = [(16, 0.5), (16, 8.0), (16, 2.0), (0, 0.5), (16, 2.0), (16, 1.0)]  # the first warms up
    for step, (samples, seconds) in enumerate(steps, start=1):
        upload = {"upload_bytes": 1_000_000, "upload_s": seconds / 10} if samples else {}
        log.write({"kind": "train", "step": step, "samples": samples, "step_s": seconds, "devices": {"b-1": upload}})
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert step_rate(records, since) == pytest.approx(8.0)  # median of 2, 8, 8, 16 samples/s; the void step skipped
    assert step_rate(records[:4], since) == 0.0  # fewer than MIN_STEPS steps after the first say nothing
    assert upload_mbit(records, since) == pytest.approx(40.0)  # 8 Mbit in 0.05, 0.1, 0.2, 0.2 or 0.8 s: the median


def test_a_streamed_upload_is_timed_by_its_steps_download():
    # an upload sent during compute took 0.01 s past it: not the link's rate; the step's download of
    # about as many bytes (0.4 s) is
    records = [{"kind": "train", "time": 10.0, "devices": {"b-1": {
        "upload_bytes": 1_000_000, "upload_s": 0.01, "upload_streamed": True, "download_s": 0.4}}}]
    assert upload_mbit(records, 5.0) == pytest.approx(20.0)


def test_the_implied_speed_is_the_speed_at_which_the_planner_predicts_the_measured_rate():
    config = job_from_dict({"name": "m", "model": "small_cnn", "training": {"global_batch": 16, "steps": 5}})
    for speed in (0.1, 0.3, 2.0):
        rate = PlannerSpeed({"m": config}, {"b": board_spec("b", speed, 100.0)})._predict(config, ("b",))
        assert implied_speed(config, "b", 100.0, rate) == pytest.approx(speed, rel=1e-3)
    assert implied_speed(config, "b", 100.0, 1e12) == 64.0  # faster than any board: the clamp
