"""Edge client entry point: emulate if asked, obtain the board's fleet credentials (pairing with a
join token the first time), find the coordinator, work, always clean up."""

from __future__ import annotations

import logging
from dataclasses import replace

import edgetrain
from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edge_client.credentials import BoardCredentials, obtain
from edge_client.emulation import BoardEmulation
from edge_client.lobby import Lobby
from edge_client.profiler import set_threads, torch_threads_for
from edge_client.telemetry import LinkMeter
from edge_client.worker import BATTERY_EMPTY, ClientOptions, EdgeWorker
from edgetrain import transport
from edgetrain.discovery import default_interfaces, find_coordinator, serves_jobs
from edgetrain.emulator.throttle import limit_cpu

logger = logging.getLogger(__name__)

__all__ = ["BATTERY_EMPTY", "run_client"]


def _discover(cluster: str | None, interfaces: list[str] | None, ca_fingerprint: str) -> str:
    """The address of the coordinator of the fleet whose CA is `ca_fingerprint` ("": an
    `--insecure` one, which advertises no CA)."""
    record = find_coordinator(interfaces=interfaces or default_interfaces(), cluster=cluster, timeout_s=30,
                              protocol_version=edgetrain.PROTOCOL_VERSION, ca_fingerprint=ca_fingerprint)
    logger.info("[Client] found coordinator %s (cluster %s) at %s over mDNS", record.instance, record.cluster,
                record.address)
    return record.address


def _credentials(address: str | None, options: ClientOptions, cluster: str | None,
                 interfaces: list[str] | None) -> BoardCredentials | None:
    """The board's fleet credentials (None with `--insecure`); see edge_client.credentials.obtain."""
    if options.insecure:
        return None
    return obtain(options.name, identity_path=options.identity, join_token=options.join_token, address=address,
                  pair_address=options.pair_address,
                  find_gateway=lambda fingerprint: _discover(cluster, interfaces, fingerprint))


def run_client(address: str | None, options: ClientOptions, *, threads: int | None = None,
               cluster: str | None = None, interfaces: list[str] | None = None) -> str:
    """Work for the coordinator at `address` (found over mDNS when None) until its job ends; at
    a job server (`edgetrain coordinator --jobs`), serve one job after another.

    Unless `options.insecure`, every channel and the board's StagePeer endpoint use its fleet
    certificate (paired with `options.join_token` when there is none yet), mDNS finds only its
    own fleet's coordinators, and the certificate renews itself in the background. A certificate
    that expired or was revoked ends the client with a TrustError (one line, exit code 5 in the
    CLI) instead of retries.

    Without an explicit address, a coordinator that stays unreachable is looked up again over
    mDNS (it may have restarted elsewhere). Returns the coordinator's reason for finishing, or
    BATTERY_EMPTY when an emulated battery ran flat.
    """
    emulation = BoardEmulation.from_file(options.board_file, options.power_w)
    if emulation.board:
        options = replace(options, emulated_speed=emulation.board.speed)
    set_threads(threads or torch_threads_for(options.emulated_speed))
    link = LinkMeter()
    with limit_cpu(options.emulated_speed, name=options.name) as limiter:
        if options.emulated_speed:
            logger.info("[Client] %s emulates %.2f of a core (%s)", options.name, options.emulated_speed,
                        limiter.mode)
        credentials = _credentials(address, options, cluster, interfaces)
        fleet = credentials.ca_fingerprint if credentials else ""
        security = credentials.gateway() if credentials else transport.INSECURE
        worker: EdgeWorker | None = None
        try:
            while True:
                found = address or _discover(cluster, interfaces, fleet)
                if credentials is not None:
                    credentials.check()
                    credentials.gateway_address = found
                    credentials.start_renewal()
                try:
                    if credentials is not None:
                        with credentials.calls():
                            jobs = serves_jobs(found, security=security)
                    else:
                        jobs = serves_jobs(found)
                except transport.Unreachable as e:
                    if address:
                        raise CoordinatorUnreachable(str(e)) from e
                    continue
                if jobs:
                    lobby = Lobby(found, options, limiter, emulation, link, credentials)
                    try:
                        return lobby.serve()
                    except CoordinatorUnreachable:
                        if address:
                            raise
                        logger.warning("[Client] lost the job server at %s; looking for it again", found)
                        continue
                    finally:
                        lobby.close()
                conn = CoordinatorConnection(found, shaper=emulation.shaper, link=link, credentials=credentials)
                if worker is None:
                    worker = EdgeWorker(conn, options, limiter, emulation)
                worker.conn = conn
                try:
                    return worker.run()
                except CoordinatorUnreachable:
                    if address:
                        raise
                    logger.warning("[Client] lost the coordinator at %s; looking for it again", conn.address)
                finally:
                    conn.close()
        finally:
            if credentials is not None:
                credentials.stop()
            if worker is not None and worker.endpoint is not None:
                worker.endpoint.close()
