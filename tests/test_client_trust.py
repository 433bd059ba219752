"""The board's side of the fleet's trust, over real TLS: pairing with a token, later starts
without one, refusals said in one line (exit code 5) with nothing stored, revocation, renewal
before expiry, and who may call a board's StagePeer.

Client processes are real `edgetrain client` processes (conftest's client_factory) against a
real coordinator, or against a bare gateway (the pairing service alone) when the client must stop
before it trains; StagePeer endpoints are real gRPC servers on 127.0.0.1 with certificates of the
session's fleet (conftest's fleet_authority).
"""

from __future__ import annotations

import datetime as dt
import logging
import stat
import threading
from pathlib import Path

import grpc
import pytest
import torch
from conftest import board_identity, small_job, wait_for

from coordinator.pairing import serve_gateway
from coordinator.training.pipeline_work import Host, assign
from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edge_client.credentials import BoardCredentials
from edge_client.endpoint import MailKey, StageEndpoint
from edgetrain import serde, transport, trust
from edgetrain.config import job_from_dict
from edgetrain.errors import Refusal
from edgetrain.split import SpeedEstimate
from edgetrain.streaming import iter_chunks
from edgetrain.tensors import pack
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gateway(fleet_authority):
    """A gateway serving only pairing and renewal under the session's authority (fleet port)."""
    servers = serve_gateway("127.0.0.1:0", [], authority=fleet_authority)
    yield f"127.0.0.1:{servers.port}"
    servers.stop(None)


def _waiting_job():
    """A job that waits for a second board: a lone client registers, profiles and polls."""
    return small_job(training={"min_clients": 2, "steps": 50})


def _without_token(monkeypatch) -> None:
    """Client processes started from now on have no join token. (An empty value, not an unset
    one: they fork from a server started with the session's token in its environment.)"""
    monkeypatch.setenv("EDGETRAIN_JOIN_TOKEN", "")


def _log(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.log"
    return path.read_text() if path.exists() else ""


def _stops_in_one_line(proc, tmp_path: Path, name: str, words: str) -> str:
    """The client exited with code 5 saying `words`, without a traceback; returns its log."""
    code = proc.wait(60)
    log = _log(tmp_path, name)
    assert code == 5, log
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if line.startswith("edgetrain client: ")]
    assert len(lines) == 1 and words in lines[0], log
    return log


# --- pairing --------------------------------------------------------------------------------------

def test_a_board_pairs_with_the_token_and_later_starts_need_none(coordinator_factory, client_factory,
                                                                 fleet_authority, tmp_path, monkeypatch):
    # Prepare
    name = "pairs-once"
    coordinator = coordinator_factory(_waiting_job())
    path = trust.default_identity_path(name)

    # Execute: the first start pairs with the session token ($EDGETRAIN_JOIN_TOKEN) and joins
    first = client_factory(coordinator.address, name)
    wait_for(lambda: "joined job" in _log(tmp_path, name), 60, f"{name} to join the job")

    # Assert: its certificate is kept privately and names it; the pairing time is logged
    identity = trust.Identity.load(path)
    assert (identity.holder.name, identity.holder.role) == (name, trust.BOARD)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((path / f).stat().st_mode) == 0o600 for f in ("key.pem", "cert.pem", "ca.pem"))
    log = _log(tmp_path, name)
    assert "paired in" in log and "registered with the coordinator" in log and "after it started pairing" in log

    # Execute: a second start, with no token anywhere
    first.kill()
    first.wait(10)
    (tmp_path / f"{name}.log").unlink()
    _without_token(monkeypatch)
    client_factory(coordinator.address, name)
    wait_for(lambda: "joined job" in _log(tmp_path, name), 60, f"{name} to join again without a token")

    # Assert: it used the certificate it had (no new pairing)
    assert trust.Identity.load(path).holder.serial == identity.holder.serial
    assert "paired in" not in _log(tmp_path, name)


@pytest.mark.parametrize("case", ["used", "wrong secret"])
def test_a_used_or_wrong_token_stops_the_board_in_one_line_and_stores_nothing(case, gateway, client_factory,
                                                                              fleet_authority, tmp_path,
                                                                              monkeypatch):
    name = f"refused-{case.replace(' ', '-')}"
    token = fleet_authority.new_token()
    if case == "used":
        fleet_authority.redeem(token.token_id, token.secret, "someone-else")
    else:
        token = trust.JoinToken(token.token_id, "x" * 16, token.ca_fingerprint)
    monkeypatch.setenv("EDGETRAIN_JOIN_TOKEN", str(token))

    proc = client_factory(gateway, name)

    _stops_in_one_line(proc, tmp_path, name, "already used" if case == "used" else "wrong secret")
    assert not trust.Identity.exists(trust.default_identity_path(name))
    assert name not in {r["name"] for r in fleet_authority.certificates().values()}


def test_a_token_of_another_fleet_sends_nothing_to_this_gateway(gateway, client_factory, tmp_path, monkeypatch,
                                                                caplog):
    name = "wrong-fleet"
    other = trust.Authority.create(tmp_path / "other-fleet")
    monkeypatch.setenv("EDGETRAIN_JOIN_TOKEN", str(other.new_token()))
    caplog.set_level(logging.INFO, logger="coordinator.pairing")

    proc = client_factory(gateway, name)

    _stops_in_one_line(proc, tmp_path, name, "not the gateway of the fleet in the join token")
    assert not trust.Identity.exists(trust.default_identity_path(name))
    assert not [r for r in caplog.records if r.name == "coordinator.pairing"]  # no Pair call reached the gateway


def test_a_board_without_a_certificate_or_token_says_how_to_pair(gateway, client_factory, tmp_path, monkeypatch):
    _without_token(monkeypatch)

    proc = client_factory(gateway, "unpaired")

    _stops_in_one_line(proc, tmp_path, "unpaired", "this board is not paired: run `edgetrain client --join TOKEN`")


def test_an_expired_certificate_stops_the_board_in_one_line(gateway, client_factory, fleet_authority, tmp_path,
                                                            monkeypatch):
    name = "expired-board"
    fleet_authority.issue_identity(name, trust.BOARD, days=-1 / 86400).save(trust.default_identity_path(name))
    _without_token(monkeypatch)

    proc = client_factory(gateway, name)

    _stops_in_one_line(proc, tmp_path, name, f"certificate of {name} expired on")


# --- revocation and renewal -----------------------------------------------------------------------

def test_a_revoked_board_stops_in_one_line_on_its_next_call(coordinator_factory, client_factory, fleet_authority,
                                                            tmp_path):
    name = "revoked-board"
    coordinator = coordinator_factory(_waiting_job())
    proc = client_factory(coordinator.address, name)
    wait_for(lambda: "joined job" in _log(tmp_path, name), 60, f"{name} to join the job")

    fleet_authority.revoke(name)

    _stops_in_one_line(proc, tmp_path, name, f"{name}'s certificate was revoked by the gateway: it needs a new "
                                             "join token")


def test_a_short_lived_certificate_is_renewed_before_it_expires(coordinator_factory, client_factory,
                                                                fleet_authority, tmp_path, monkeypatch):
    # Prepare: a certificate that expires in 40 s (the gateway signs renewals for BOARD_DAYS)
    name = "renewing-board"
    path = trust.default_identity_path(name)
    old = fleet_authority.issue_identity(name, trust.BOARD, days=40 / 86400)
    old.save(path)
    _without_token(monkeypatch)
    coordinator = coordinator_factory(_waiting_job())

    # Execute
    proc = client_factory(coordinator.address, name)

    # Assert: a new certificate is on disk before the old one expires, and the board works on
    renewed = wait_for(lambda: (i := trust.Identity.load(path)).holder.serial != old.holder.serial and i, 30,
                       "the renewed certificate on disk")
    assert dt.datetime.now(dt.timezone.utc) < old.holder.not_after
    assert renewed.holder.name == name and renewed.holder.not_after > old.holder.not_after + dt.timedelta(days=1)
    assert stat.S_IMODE((path / "key.pem").stat().st_mode) == 0o600
    wait_for(lambda: "joined job" in _log(tmp_path, name), 60, f"{name} to join the job")
    assert proc.poll() is None, _log(tmp_path, name)


def test_renewal_is_checked_periodically_and_swaps_the_credentials_in_place(gateway, fleet_authority, tmp_path):
    # Prepare: 155 s of validity (plus the 5 minutes it is back-dated): due for renewal after ~3 s
    path = tmp_path / "periodic"
    identity = fleet_authority.issue_identity("periodic-board", trust.BOARD, days=155 / 86400)
    identity.save(path)
    credentials = BoardCredentials(identity, path, check_every_s=0.2)
    credentials.gateway_address = gateway
    assert not identity.needs_renewal()

    # Execute
    credentials.start_renewal()
    try:
        wait_for(lambda: credentials.credentials.generation == 1, 20, "the periodic renewal", interval_s=0.1)
    finally:
        credentials.stop()

    # Assert: the new certificate is in use and on disk
    assert credentials.identity.holder.serial != identity.holder.serial
    assert trust.Identity.load(path) == credentials.identity
    assert not credentials.identity.needs_renewal()


def test_the_connection_dials_with_the_renewed_certificate_from_the_next_call_on(gateway, fleet_authority,
                                                                                 tmp_path):
    # Prepare: a connection whose calls get through the handshake (the bare gateway has no
    # Coordinator service: UNIMPLEMENTED is its answer)
    identity = fleet_authority.issue_identity("reconnecting-board", trust.BOARD)
    credentials = BoardCredentials(identity, tmp_path / "reconnecting")
    conn = CoordinatorConnection(gateway, credentials=credentials, retry=transport.RetryPolicy(budget_s=1.0))
    try:
        assert _refused(conn.list_devices).code() == grpc.StatusCode.UNIMPLEMENTED

        # Execute: the credentials change in place to a certificate the gateway does not accept
        stranger = trust.Authority.create(tmp_path / "other-fleet").issue_identity("reconnecting-board", trust.BOARD)
        credentials.credentials.replace(trust.Identity(stranger.key, stranger.cert, identity.ca))

        # Assert: the next call dials anew with it (the old channel would still have worked)
        with pytest.raises(CoordinatorUnreachable):
            conn.list_devices()
    finally:
        conn.close()


def test_the_renewal_interval_follows_the_lifetime(fleet_authority, tmp_path):
    def interval(days: float) -> float:
        return BoardCredentials(fleet_authority.issue_identity("interval-board", trust.BOARD, days=days),
                                tmp_path).check_interval_s()

    assert interval(trust.BOARD_DAYS) == 3600.0  # a twentieth of 30 days, capped at an hour
    assert interval(40 / 86400) == pytest.approx((300 + 40) / 20, abs=1)  # 5 minutes back-dated
    assert interval(-4 / 1440) == 5.0  # a minute in all: checked every 5 s, not every 3


# --- the StagePeer --------------------------------------------------------------------------------

@pytest.fixture
def stage_peer():
    """Board "stage-b"'s StagePeer endpoint, with a small CNN for job "job"."""
    from edgetrain.models import build_model

    endpoint = StageEndpoint("127.0.0.1:0", credentials=transport.Credentials(board_identity("stage-b")))
    endpoint.state.attach(build_model("small_cnn", seed=0), "job")
    yield endpoint
    endpoint.close()


def _plan_work(endpoint: StageEndpoint):
    """Board stage-b's work in a two-stage plan after stage-a (as the board receives it: through
    the wire form)."""
    job = job_from_dict({"model": "small_cnn", "pipeline": {"microbatches": 2, "stages": [
        {"blocks": 2, "boards": ["stage-a"]}, {"blocks": 2, "boards": ["stage-b"]}]}})
    hosts = {"stage-a": Host("dev-a", "127.0.0.1:1", SpeedEstimate(0.0, 10.0)),
             "stage-b": Host("dev-b", f"127.0.0.1:{endpoint.port}", SpeedEstimate(0.0, 10.0))}
    out = assign(job.pipeline.plan(), job.pipeline, step=0, attempt=0, indices=list(range(8)),
                 block_names=["c1", "c2", "c3", "head"], hosts=hosts, augment=False, data_seed=0)
    return serde.work_from_proto(serde.work_to_proto(out["dev-b"]))


def _send(address: str, identity: trust.Identity | None, *, step: int = 0, from_device: str = "dev-a",
          timeout: float = 10, credentials: grpc.ChannelCredentials | None = None):
    """One stage tensor for micro-batch 0 of `step` (rows 0-4) sent to `address` as `identity`."""
    metas, payload = pack({"x": torch.ones(4, 3)})
    header = spb.StageHeader(job_id="job", step=step, attempt=0, pipeline=0, microbatch=0, from_stage=0,
                             row_begin=0, row_end=4, from_device=from_device, bundle=serde.header_to_proto(metas))
    messages = [spb.StageMessage(header=header)] + [spb.StageMessage(chunk=serde.chunk_to_proto(c))
                                                     for c in iter_chunks(payload)]
    if credentials is not None:
        channel = grpc.secure_channel(address, credentials,
                                      options=[("grpc.ssl_target_name_override", trust.BOARD_SERVER_NAME)])
    elif identity is None:
        channel = transport.open_channel(address)
    else:
        channel = transport.open_channel(address, identity.security(trust.BOARD_SERVER_NAME))
    try:
        return spb_grpc.StagePeerStub(channel).Send(iter(messages), timeout=timeout)
    finally:
        channel.close()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _key(step: int = 0, from_device: str = "dev-a") -> MailKey:
    return MailKey(step, 0, 0, 0, False, 0, 0, 4, from_device)


def test_the_plan_names_each_stage_host_by_its_certificate_name(stage_peer):
    work = _plan_work(stage_peer)
    assert [(h.device_id, h.name) for h in work.stage.prev_hosts] == [("dev-a", "stage-a")]
    assert [(h.device_id, h.name) for h in work.stage.hosts] == [("dev-b", "stage-b")]


def test_strangers_cannot_call_a_stage_peer(stage_peer, fleet_authority, tmp_path):
    address = f"127.0.0.1:{stage_peer.port}"
    stage_peer.expect(_plan_work(stage_peer))
    other = trust.Authority.create(tmp_path / "other-fleet").issue_identity("stage-a", trust.BOARD)
    forged = trust.Identity(other.key, other.cert, fleet_authority.ca_pem)  # trusts our CA, holds theirs

    for attempt in (lambda: _send(address, None),  # plaintext
                    lambda: _send(address, None, credentials=grpc.ssl_channel_credentials(fleet_authority.ca_pem)),
                    lambda: _send(address, forged)):
        assert _refused(attempt).code() == grpc.StatusCode.UNAVAILABLE  # no handshake
    operator = _refused(lambda: _send(address, fleet_authority.operator_identity()))
    assert operator.code() == grpc.StatusCode.PERMISSION_DENIED
    assert transport.error_reason(operator) == Refusal.NOT_PERMITTED

    # nothing arrived, and the endpoint still serves the board the plan names
    assert _send(address, board_identity("stage-a")).received_bytes > 0
    assert torch.equal(stage_peer.mailbox.take(_key(), 1.0, "activations"), torch.ones(4, 3))


def test_only_the_boards_the_plan_names_may_send(stage_peer):
    address = f"127.0.0.1:{stage_peer.port}"

    # a Send for work this board has not been given yet waits for it
    sent: dict = {}
    early = threading.Thread(target=lambda: sent.update(ack=_send(address, board_identity("stage-a"))))
    early.start()
    early.join(0.5)
    assert early.is_alive()  # held until this board knows its work for step 0
    stage_peer.expect(_plan_work(stage_peer))
    early.join(10)
    assert sent["ack"].received_bytes > 0
    assert torch.equal(stage_peer.mailbox.take(_key(), 1.0, "activations"), torch.ones(4, 3))

    # a fleet board the plan does not name, or a named board sending as another device, is refused
    for identity, device in ((board_identity("stage-c"), "dev-a"), (board_identity("stage-c"), "dev-c"),
                             (board_identity("stage-a"), "dev-b")):
        refused = _refused(lambda identity=identity, device=device: _send(address, identity, from_device=device))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
        assert transport.error_reason(refused) == Refusal.NOT_PERMITTED
    # so is a Send for a step this board is never given (before the caller's deadline)
    refused = _refused(lambda: _send(address, board_identity("stage-a"), step=5, timeout=3))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED and "no work" in refused.details()
    with pytest.raises(Exception, match="no activations"):
        stage_peer.mailbox.take(_key(from_device="dev-c"), 0.1, "activations")


def test_a_board_sends_to_its_neighbour_through_its_own_endpoint(stage_peer):
    sender = StageEndpoint("127.0.0.1:0", credentials=transport.Credentials(board_identity("stage-a")))
    try:
        stage_peer.expect(_plan_work(stage_peer))
        sender.send(f"127.0.0.1:{stage_peer.port}", "job", _key(), torch.ones(4, 3), 10).result(15)
        assert torch.equal(stage_peer.mailbox.take(_key(), 1.0, "activations"), torch.ones(4, 3))
    finally:
        sender.close()


def test_state_calls_come_from_the_gateway_only(stage_peer, fleet_authority):
    address = f"127.0.0.1:{stage_peer.port}"
    model = stage_peer.state.model
    prefixes = tuple(f"blocks.{k}." for k in list(model.blocks.keys())[0:2])
    state = {n: t.detach().clone() for n, t in model.state_dict().items() if n.startswith(prefixes)}
    request = spb.StateRequest(job_id="job", first_block=0, end_block=2, version=0)

    def load(identity: trust.Identity):
        metas, payload = pack(state)
        messages = [spb.StateMessage(request=request), spb.StateMessage(header=serde.header_to_proto(metas))]
        messages += [spb.StateMessage(chunk=serde.chunk_to_proto(c)) for c in iter_chunks(payload)]
        channel = transport.open_channel(address, identity.security(trust.BOARD_SERVER_NAME))
        try:
            return spb_grpc.StagePeerStub(channel).LoadState(iter(messages), timeout=10)
        finally:
            channel.close()

    def pull(identity: trust.Identity):
        channel = transport.open_channel(address, identity.security(trust.BOARD_SERVER_NAME))
        try:
            return list(spb_grpc.StagePeerStub(channel).PullState(request, timeout=10))
        finally:
            channel.close()

    for call in (load, pull):
        refused = _refused(lambda call=call: call(board_identity("stage-a")))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert transport.error_reason(refused) == Refusal.NOT_PERMITTED
    assert not stage_peer.state.holds(0, 2)

    # the gateway's calls reach the endpoint (it owns no stage yet: the pull says so; the
    # gateway's loads and pulls that work are in test_stage_state.py)
    answered = _refused(lambda: pull(fleet_authority.gateway_identity()))
    assert answered.code() == grpc.StatusCode.FAILED_PRECONDITION and "owns no stage" in answered.details()


def test_credentials_are_checked_before_a_call(fleet_authority, tmp_path):
    expired = fleet_authority.issue_identity("checked-board", trust.BOARD, days=-1 / 86400)
    credentials = BoardCredentials(expired, tmp_path / "checked")
    with pytest.raises(trust.TrustError, match="certificate of checked-board expired on"):
        credentials.check()
