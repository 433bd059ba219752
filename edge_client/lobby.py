"""A board in a job server's lobby: wait for a job, work for its coordinator, come back.

The board times the reference workload (``edgetrain.speed_reference``) under its CPU limit and
probes its link, joins, then long-polls ``NextJob``. An offer names the port of the job's own
coordinator on the job server's host; the board works for it exactly as for a lone coordinator
(``EdgeWorker``) until the job ends or its coordinator goes away, then polls again.
"""

from __future__ import annotations

import logging
import time

import grpc

import edgetrain
from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edge_client.emulation import BoardEmulation
from edge_client.telemetry import LinkMeter, probe_link
from edge_client.worker import BATTERY_EMPTY, ClientOptions, EdgeWorker
from edgetrain.emulator.throttle import CpuLimiter
from edgetrain.speed_reference import reference_seconds
from edgetrain.transport import CHANNEL_OPTIONS
from protos import jobs_pb2 as pb
from protos import jobs_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

POLL_S = 5.0
JOB_RETRY_BUDGET_S = 15.0
"""How long a board keeps retrying a job coordinator that went away (cancelled) before it returns."""
LOBBY_RETRY_BUDGET_S = 120.0
"""How long a board keeps retrying an unreachable job server (it may be restarting)."""


def is_job_server(address: str, budget_s: float = 60.0) -> bool:
    """Whether `address` serves the JobServer service (else it is a lone job's coordinator);
    CoordinatorUnreachable when nothing answers there within `budget_s`."""
    deadline = time.monotonic() + budget_s
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        while True:
            try:
                pb_grpc.JobServerStub(channel).Probe(pb.LobbyProbe(), timeout=5, wait_for_ready=True)
                return True
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return False
                if time.monotonic() > deadline:
                    raise CoordinatorUnreachable(f"nothing answers at {address}: {e.details()}") from e


class Lobby:
    """The board's side of the job server."""

    def __init__(self, address: str, options: ClientOptions, limiter: CpuLimiter, emulation: BoardEmulation,
                 link: LinkMeter) -> None:
        self.address, self.options, self.limiter, self.emulation, self.link = address, options, limiter, emulation, link
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.JobServerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _send_probe(self, payload: bytes) -> None:
        shaper = self.emulation.shaper
        if shaper:
            shaper.rpc_delay()
            shaper.before_send(len(payload))
        self._stub.Probe(pb.LobbyProbe(payload=payload), timeout=60)

    def join(self) -> None:
        reference = reference_seconds(self.limiter.working)
        mbit = probe_link(self._send_probe, self.link)
        self._stub.Join(pb.JoinRequest(name=self.options.name, reference_s=reference,
                                       link_mbit_per_s=mbit if mbit == mbit else 0.0,
                                       protocol_version=edgetrain.PROTOCOL_VERSION), timeout=30)
        logger.info("[Client] %s joined the job server at %s (reference %.3f s, link %.0f Mbit/s)",
                    self.options.name, self.address, reference, mbit if mbit == mbit else 0)

    def next_offer(self) -> pb.JobOffer:
        """Long-poll until the server offers a job; re-join if it forgot us, retry while it restarts."""
        unreachable_since = None
        while True:
            try:
                offer = self._stub.NextJob(pb.NextJobRequest(name=self.options.name, max_wait_s=POLL_S),
                                           timeout=POLL_S + 60)
                unreachable_since = None
                if offer.job_id:
                    return offer
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self.join()
                elif e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > LOBBY_RETRY_BUDGET_S:
                        raise CoordinatorUnreachable(f"job server {self.address} unreachable") from e
                    time.sleep(1.0)
                else:
                    raise

    def serve(self) -> str:
        """Serve jobs until the battery runs flat (returns BATTERY_EMPTY) or the server is gone."""
        self.join()
        host = self.address.rsplit(":", 1)[0]
        while True:
            offer = self.next_offer()
            logger.info("[Client] %s works for job %s (coordinator port %d)", self.options.name, offer.job_name,
                        offer.port)
            conn = CoordinatorConnection(f"{host}:{offer.port}", shaper=self.emulation.shaper, link=self.link,
                                         retry_budget_s=JOB_RETRY_BUDGET_S)
            worker = EdgeWorker(conn, self.options, self.limiter, self.emulation)
            try:
                reason = worker.run()
                logger.info("[Client] job %s ended: %s", offer.job_name, reason)
                if reason == BATTERY_EMPTY:
                    return reason
            except CoordinatorUnreachable:
                logger.warning("[Client] job %s's coordinator went away; back to the lobby", offer.job_name)
            except grpc.RpcError as e:  # a call cut off as the coordinator stopped (the job was cancelled)
                if e.code() != grpc.StatusCode.CANCELLED:
                    raise
                logger.warning("[Client] job %s's coordinator stopped mid-call; back to the lobby", offer.job_name)
            finally:
                conn.close()
                if worker.endpoint is not None:
                    worker.endpoint.close()
