"""The fleet authority, join tokens and pairing over real TLS (a real gRPC server on loopback)."""

from __future__ import annotations

import datetime as dt
import os
import stat
import time

import grpc
import pytest

from coordinator.pairing import serve_gateway
from edge_client.pairing import CredentialRevoked, PairingRefused, pair, renew
from edgetrain import transport, trust
from edgetrain.errors import Refusal
from protos import pairing_pb2 as ppb
from protos import pairing_pb2_grpc as ppb_grpc


@pytest.fixture
def authority(tmp_path):
    return trust.Authority.create(tmp_path / "authority")


class Gateway:
    def __init__(self, authority):
        self.servers = serve_gateway("127.0.0.1:0", [], authority=authority)
        self.address = f"127.0.0.1:{self.servers.port}"
        self.pairing = f"127.0.0.1:{self.servers.pairing_port}"
        assert self.servers.pairing_port == self.servers.port + 1


@pytest.fixture
def gateway(authority):
    gateway = Gateway(authority)
    yield gateway
    gateway.servers.stop(None)


def test_the_authority_keeps_its_secrets_private(authority):
    assert stat.S_IMODE(os.stat(authority.directory).st_mode) == 0o700
    for path in authority.directory.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert authority.gateway_identity().holder.role == trust.GATEWAY
    assert authority.operator_identity().holder.role == trust.OPERATOR
    token = authority.new_token()
    assert token.secret not in (authority.directory / "tokens.json").read_text()  # only its hash is kept
    assert trust.JoinToken.parse(str(token)) == token


@pytest.mark.parametrize("text", ["", "abc", "abcdef.0123456789abcdef", "ABCDEF.0123456789abcdef." + "0" * 64])
def test_a_malformed_token_is_refused_in_one_line(text):
    with pytest.raises(trust.TrustError, match="malformed join token"):
        trust.JoinToken.parse(text)


def test_a_token_is_spent_once_and_expires(authority):
    token = authority.new_token()
    with pytest.raises(PermissionError, match="wrong secret"):
        authority.redeem(token.token_id, "x" * 16, "b1")
    authority.redeem(token.token_id, token.secret, "b1")
    with pytest.raises(PermissionError, match="already used"):
        authority.redeem(token.token_id, token.secret, "b2")
    old = authority.new_token(ttl_s=0.001)
    expires = authority.tokens()[old.token_id]["expires"]
    while time.time() <= expires:  # the condition: its expiry has passed
        time.sleep(0.001)
    with pytest.raises(PermissionError, match="expired"):
        authority.redeem(old.token_id, old.secret, "b3")


def test_a_board_pairs_with_one_token_and_the_token_cannot_be_reused(authority, gateway, tmp_path):
    token = authority.new_token()
    identity = pair(gateway.pairing, token, "board-a", tmp_path / "a")
    assert identity.holder == trust.Identity.load(tmp_path / "a").holder
    assert (identity.holder.name, identity.holder.role) == ("board-a", trust.BOARD)
    assert stat.S_IMODE((tmp_path / "a" / "key.pem").stat().st_mode) == 0o600
    with pytest.raises(PairingRefused, match="already used"):
        pair(gateway.pairing, token, "board-b", tmp_path / "b")
    assert not trust.Identity.exists(tmp_path / "b")


def test_a_token_of_another_fleet_sends_nothing_to_this_gateway(authority, gateway, tmp_path):
    other = trust.Authority.create(tmp_path / "other")
    foreign = other.new_token()
    with pytest.raises(trust.TrustError, match="not the gateway of the fleet"):
        pair(gateway.pairing, foreign, "board-a", tmp_path / "a")
    # a token whose fingerprint was changed to this fleet's but whose secret is not this fleet's
    forged = trust.JoinToken(foreign.token_id, foreign.secret, authority.fingerprint)
    with pytest.raises(PairingRefused, match="unknown join token"):
        pair(gateway.pairing, forged, "board-a", tmp_path / "a")


@pytest.mark.parametrize("port", ["pairing", "address"])
def test_calls_without_a_fleet_certificate_are_refused(authority, gateway, port):
    channel = grpc.secure_channel(getattr(gateway, port), grpc.ssl_channel_credentials(authority.ca_pem),
                                  options=[("grpc.ssl_target_name_override", trust.GATEWAY_SERVER_NAME)])
    with pytest.raises(grpc.RpcError) as refused:
        ppb_grpc.PairingStub(channel).Renew(ppb.RenewRequest(csr_pem=b"x"), timeout=10)
    if port == "pairing":  # the pairing port admits callers without a certificate, to Pair only
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert transport.error_reason(refused.value) == Refusal.NOT_AUTHENTICATED
    else:  # the fleet port requires a certificate in the handshake
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_a_certificate_of_another_ca_fails_the_handshake(authority, gateway, tmp_path):
    other = trust.Authority.create(tmp_path / "other")
    stranger = other.issue_identity("board-a", trust.BOARD)
    forged = trust.Identity(stranger.key, stranger.cert, authority.ca_pem)  # trusts our CA, holds theirs
    channel = transport.open_channel(gateway.address, forged.security())
    with pytest.raises(grpc.RpcError) as refused:
        ppb_grpc.PairingStub(channel).Renew(ppb.RenewRequest(csr_pem=b"x"), timeout=10)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    channel.close()


def test_a_board_renews_its_certificate_until_it_is_revoked(authority, gateway, tmp_path):
    identity = pair(gateway.pairing, authority.new_token(), "board-a", tmp_path / "a")
    credentials = transport.Credentials(identity)
    renewed = renew(gateway.address, credentials, tmp_path / "a")
    assert renewed.holder.serial != identity.holder.serial
    assert credentials.identity == renewed and credentials.generation == 1
    authority.revoke("board-a")
    with pytest.raises(CredentialRevoked, match="revoked"):
        renew(gateway.address, credentials, tmp_path / "a")
    # a new token readmits the name
    again = pair(gateway.pairing, authority.new_token(), "board-a", tmp_path / "a2")
    assert renew(gateway.address, transport.Credentials(again), tmp_path / "a2").holder.name == "board-a"


def test_a_board_cannot_renew_as_another_board(authority, gateway, tmp_path):
    identity = pair(gateway.pairing, authority.new_token(), "board-a", tmp_path / "a")
    channel = transport.open_channel(gateway.address, identity.security())
    with pytest.raises(grpc.RpcError) as refused:
        ppb_grpc.PairingStub(channel).Renew(ppb.RenewRequest(csr_pem=trust.make_csr(trust.new_key(), "board-b")),
                                            timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    channel.close()


def test_renewal_is_due_in_the_last_third_of_the_lifetime(authority):
    identity = authority.issue_identity("board-a", trust.BOARD, days=30)
    now = dt.datetime.now(dt.timezone.utc)
    assert not identity.needs_renewal(now)
    assert identity.needs_renewal(now + dt.timedelta(days=21))
    assert identity.expired(now + dt.timedelta(days=31))
