"""The Pairing service: a board spends a join token to get its certificate signed, and renews it.

Served next to the Coordinator or JobServer service on the same port. ``Pair`` is the one call
that needs no fleet certificate (``trust_guard`` leaves it open); ``Renew`` needs the board's
current certificate, and renews only that name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

import edgetrain
from edgetrain import transport, trust
from edgetrain.errors import Refusal
from protos import pairing_pb2 as ppb
from protos import pairing_pb2_grpc as ppb_grpc

logger = logging.getLogger(__name__)

BOARD_CALLS = tuple(f"Coordinator/{m}" for m in (
    "Register", "ReportProfile", "Heartbeat", "Attach", "GetWork", "DownloadParameters", "UploadGradient", "GetUploadStatus",
    "Probe", "ReportFailure")) + ("Pairing/Renew", "JobServer/Join", "JobServer/NextJob")
"""Calls only a board makes (on the Coordinator, Pairing and JobServer services)."""
OPERATOR_CALLS = ("JobServer/Submit", "JobServer/Cancel")
"""Calls that change a job server's queue: an operator's (the gateway's own operator credential,
or one issued with `edgetrain operator add`)."""


def trust_guard(authority: trust.Authority) -> transport.Guard:
    """The access rules of a gateway server (coordinator or job server) under `authority`:
    Pair is open, board calls need a board certificate, queue changes an operator's, anything
    else (listing devices or jobs) any fleet certificate; revoked certificates are refused."""
    access: dict[str, frozenset[str]] = {"Pairing/Pair": transport.OPEN}
    access.update({name: frozenset({trust.BOARD}) for name in BOARD_CALLS})
    access.update({name: frozenset({trust.OPERATOR, trust.GATEWAY}) for name in OPERATOR_CALLS})
    return transport.Guard(access, revoked=authority.is_revoked)


def gateway_security(authority: trust.Authority, *, pairing: bool = False) -> transport.MutualTLS:
    """How a gateway server listens: its certificate, and callers' certificates required — except
    on the pairing port, where a board that has none yet proves itself with its join token."""
    return authority.gateway_identity().security(trust.BOARD_SERVER_NAME, require_client_auth=not pairing)


class PairingServicer(ppb_grpc.PairingServicer):
    """Signs boards' certificate requests: against a join token (Pair) or their certificate (Renew)."""

    def __init__(self, authority: trust.Authority) -> None:
        self._authority = authority

    def Pair(self, request: ppb.PairRequest, context) -> ppb.PairReply:
        if request.protocol_version != edgetrain.PROTOCOL_VERSION:
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                            f"protocol version {request.protocol_version} not supported; this gateway speaks "
                            f"{edgetrain.PROTOCOL_VERSION}", Refusal.PROTOCOL_MISMATCH)
        try:
            name, _ = trust.read_csr(request.csr_pem)
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            self._authority.redeem(request.token_id, request.secret, name)
        except PermissionError as e:
            logger.warning("[Pairing] refused %s from %s: %s", name, context.peer(), e)
            transport.abort(context, grpc.StatusCode.UNAUTHENTICATED, str(e), Refusal.TOKEN_REFUSED)
        self._authority.readmit(name)  # a new token lets a revoked name back in
        certificate = self._authority.sign(request.csr_pem)
        logger.info("[Pairing] %s paired (token %s)", name, request.token_id)
        return ppb.PairReply(certificate_pem=certificate)

    def Renew(self, request: ppb.RenewRequest, context) -> ppb.RenewReply:
        peer = transport.peer_of(context)
        if peer is None:  # only on an --insecure server: nothing to renew
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, "this gateway serves without TLS")
        try:
            certificate = self._authority.sign(request.csr_pem, name=peer.name)
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PermissionError as e:
            transport.abort(context, grpc.StatusCode.PERMISSION_DENIED, str(e), Refusal.NOT_PERMITTED)
        logger.info("[Pairing] %s renewed its certificate", peer.name)
        return ppb.RenewReply(certificate_pem=certificate)


def pairing_service(authority: trust.Authority | None) -> list:
    """The (add_to_server, servicer) pair to serve next to a gateway service; none when insecure."""
    return [(ppb_grpc.add_PairingServicer_to_server, PairingServicer(authority))] if authority else []


def pairing_address(address: str) -> str:
    """The pairing address of the gateway whose fleet port is `address`: the next port."""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + 1}"


GATEWAY_WORKERS = 1024
"""Threads of a gateway's fleet port. grpcio's sync server holds a thread for each call in
progress, and every idle board always holds two (its presence stream and its long work poll):
at 256 boards 128 threads were all taken by the polls alone and heartbeats queued for 9 s (alive
189 of 256). 1024 leaves room for 256 boards' polls, streams and transfers at once; the pool
makes a thread only when no idle one is left."""


@dataclass
class GatewayServer:
    """A gateway's servers: its fleet port (mutual TLS) and its pairing port (server TLS only,
    Pair alone); without an authority (`--insecure`), one plaintext port and no pairing."""

    server: grpc.Server
    port: int
    pairing_server: grpc.Server | None = None
    pairing_port: int = 0

    def stop(self, grace: float | None) -> None:
        """Stop both servers, waiting up to `grace` seconds for calls in flight."""
        events = [s.stop(grace) for s in (self.server, self.pairing_server) if s is not None]
        for event in events:
            event.wait()


def serve_gateway(bind: str, services: list, *, authority: trust.Authority | None, pair_bind: str | None = None,
                  max_workers: int = GATEWAY_WORKERS) -> GatewayServer:
    """Serve `services` ((add_to_server, servicer) pairs) on `bind`: plaintext without an
    authority (`--insecure`), else mutual TLS with Renew, plus Pair on the pairing port — by
    default the next port (with port 0, a free pair of ports is found), "none" for no pairing
    port (a job server's per-job coordinators: boards pair with the job server)."""
    if authority is None:
        server, port = transport.create_server(bind, services, max_workers=max_workers)
        return GatewayServer(server, port)
    guard = trust_guard(authority)
    host, _, wanted = bind.rpartition(":")
    for _ in range(50):
        server, port = transport.create_server(bind, [*services, *pairing_service(authority)],
                                               max_workers=max_workers, security=gateway_security(authority),
                                               guard=guard)
        if pair_bind == "none":
            return GatewayServer(server, port)
        try:
            pairing, pairing_port = transport.create_server(pair_bind or f"{host}:{port + 1}",
                                                            pairing_service(authority), max_workers=8,
                                                            security=gateway_security(authority, pairing=True),
                                                            guard=guard)
            return GatewayServer(server, port, pairing, pairing_port)
        except OSError:
            server.stop(None)
            if pair_bind or int(wanted):  # the ports were asked for: say so
                raise
    raise OSError(f"no two consecutive free ports on {host} for the fleet and pairing ports")
