"""Pairing from the board's side: verify the gateway against the token's CA fingerprint, have a
certificate signed for a key made here (the key never leaves the board), keep it, renew it.
"""

from __future__ import annotations

import logging
import socket
import ssl
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

import edgetrain
from edgetrain import transport, trust
from edgetrain.errors import Refusal
from protos import pairing_pb2 as ppb
from protos import pairing_pb2_grpc as ppb_grpc

logger = logging.getLogger(__name__)

PAIR_TIMEOUT_S = 15.0


class PairingRefused(trust.TrustError):
    """The gateway refused the token or the request (said in one line; retrying will not help)."""


class CredentialRevoked(trust.TrustError):
    """The gateway revoked this board's certificate: it needs a new join token."""


class CertificateExpired(trust.TrustError):
    """This board's certificate has expired (it was not renewed in time): it needs a new join token."""


def pairing_address(fleet_address: str) -> str:
    """Where the gateway whose fleet port is `fleet_address` pairs boards: the next port (as
    coordinator.pairing serves it; `--pair-address` when the gateway serves it elsewhere)."""
    host, _, port = fleet_address.rpartition(":")
    return f"{host}:{int(port) + 1}"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def fetch_fleet_ca(address: str, ca_fingerprint: str, timeout_s: float = PAIR_TIMEOUT_S) -> bytes:
    """The fleet CA certificate (PEM) the gateway at `address` presents, checked against the
    fingerprint from a join token before anything is sent (TrustError when it is another fleet).

    The TLS handshake here verifies nothing by itself (the board has no CA yet): the chain the
    server sends is compared with the pinned fingerprint, and the server's certificate must be
    signed by that CA. Unreachable when nothing answers."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # verified below, against the pinned fingerprint
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(_split(address), timeout=timeout_s) as raw, \
                context.wrap_socket(raw) as tls:
            chain = tls.get_unverified_chain() if hasattr(tls, "get_unverified_chain") else \
                tls._sslobj.get_unverified_chain()  # public from Python 3.13
            ders = [c if isinstance(c, bytes) else c.public_bytes(ssl._ssl.ENCODING_DER) for c in chain or []]
    except (OSError, ssl.SSLError) as e:
        raise transport.Unreachable(f"cannot reach the gateway at {address} over TLS: {e}") from None
    certs = [x509.load_der_x509_certificate(der) for der in ders]
    ca = next((c for c in certs if trust.fingerprint(c) == ca_fingerprint), None)
    if ca is None or not certs:
        raise trust.TrustError(f"the server at {address} is not the gateway of the fleet in the join token "
                               "(its CA fingerprint differs): nothing was sent to it")
    trust.verify_issued_by(certs[0].public_bytes(serialization.Encoding.PEM), ca)
    return ca.public_bytes(serialization.Encoding.PEM)


def pair(address: str, token: trust.JoinToken, name: str, path: Path) -> trust.Identity:
    """Join the fleet of the gateway at `address` as `name` with `token`; the identity is saved
    at `path` (0600) and returned. PairingRefused when the gateway says no."""
    ca_pem = fetch_fleet_ca(address, token.ca_fingerprint)
    key = trust.new_key()
    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem),
                                  options=transport.CHANNEL_OPTIONS
                                  + [("grpc.ssl_target_name_override", trust.GATEWAY_SERVER_NAME)])
    try:
        reply = ppb_grpc.PairingStub(channel).Pair(
            ppb.PairRequest(token_id=token.token_id, secret=token.secret, csr_pem=trust.make_csr(key, name),
                            protocol_version=edgetrain.PROTOCOL_VERSION), timeout=PAIR_TIMEOUT_S)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise transport.Unreachable(f"pairing with {address}: {transport.describe(e)}") from None
        raise PairingRefused(f"the gateway refused to pair {name}: {e.details()}") from None
    finally:
        channel.close()
    trust.verify_issued_by(reply.certificate_pem, x509.load_pem_x509_certificate(ca_pem))
    identity = trust.Identity(trust.key_pem(key), reply.certificate_pem, ca_pem)
    if identity.holder.name != name:
        raise trust.TrustError(f"the gateway signed a certificate for {identity.holder.name}, not {name}")
    identity.save(path)
    logger.info("[Client] paired as %s with the fleet whose CA is %s…; credentials kept in %s", name,
                token.ca_fingerprint[:16], path)
    return identity


def renew(address: str, credentials: transport.Credentials, path: Path) -> trust.Identity:
    """A fresh certificate (and key) for this board from the gateway at `address`, authenticated
    by the current one; saved at `path` and put in use (`credentials`)."""
    current = credentials.identity
    key = trust.new_key()
    security = transport.MutualTLS(credentials, server_name=trust.GATEWAY_SERVER_NAME)
    channel = transport.open_channel(address, security)
    try:
        reply = transport.CALLS.call(lambda: ppb_grpc.PairingStub(channel).Renew(
            ppb.RenewRequest(csr_pem=trust.make_csr(key, current.holder.name)), timeout=PAIR_TIMEOUT_S),
            f"certificate renewal at {address}")
    except grpc.RpcError as e:
        if transport.error_reason(e) == Refusal.CREDENTIAL_REVOKED:
            raise CredentialRevoked(e.details()) from None
        raise
    finally:
        channel.close()
    identity = trust.Identity(trust.key_pem(key), reply.certificate_pem, current.ca)
    trust.verify_issued_by(identity.cert, x509.load_pem_x509_certificate(current.ca))
    identity.save(path)
    credentials.replace(identity)
    logger.info("[Client] renewed the certificate of %s (valid until %s)", identity.holder.name,
                identity.holder.not_after.isoformat(timespec="minutes"))
    return identity

