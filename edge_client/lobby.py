"""A board in a job server's lobby: wait for a job, work for its coordinator, come back.

The board times the reference workload (``edgetrain.speed_reference``) under its CPU limit and
probes its link, joins, then long-polls ``NextJob``. An offer names the port of the job's own
coordinator on the job server's host; the board works for it exactly as for a lone coordinator
(``EdgeWorker``) until the job ends or its coordinator goes away, then polls again. Every channel
uses the board's fleet credentials (mutual TLS; plaintext with `--insecure`).
"""

from __future__ import annotations

import logging
import time

import grpc

import edgetrain
from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edge_client.credentials import BoardCredentials, trusted_calls
from edge_client.local_data import LocalData
from edge_client.telemetry import LinkMeter, probe_link
from edge_client.worker import BATTERY_EMPTY, ClientOptions, EdgeWorker
from edgetrain import transport
from edgetrain.board_hardware import BoardHardware
from edgetrain.speed_reference import reference_seconds
from protos import jobs_pb2 as pb
from protos import jobs_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

POLL_S = 5.0
JOB_RETRY = transport.RetryPolicy(budget_s=15.0)
"""A job coordinator that went away (cancelled) is retried this long before the board returns."""
LOBBY_RETRY = transport.RetryPolicy(budget_s=120.0, max_s=2.0,
                                    retry_on=frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}))
"""An unreachable job server (it may be restarting) is retried this long."""


class Lobby:
    """The board's side of the job server."""

    def __init__(self, address: str, options: ClientOptions, hardware: BoardHardware,
                 link: LinkMeter, credentials: BoardCredentials | None = None, *,
                 local: LocalData | None = None) -> None:
        self.address, self.options, self.hardware, self.link = address, options, hardware, link
        self.credentials = credentials
        self.local = local
        """The board's own images, if it trains on those (every job it works for)."""
        self._security = credentials.gateway() if credentials else transport.INSECURE
        self._generation = self._security.generation
        self._channel = transport.open_channel(address, self._security)
        self._server = pb_grpc.JobServerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    @property
    def _stub(self) -> pb_grpc.JobServerStub:
        """The stub on a channel made with the current certificate (reopened after a renewal;
        the lobby's calls run one at a time, so none is in flight on the old channel)."""
        if self._generation != self._security.generation:
            self._channel.close()
            self._generation = self._security.generation
            self._channel = transport.open_channel(self.address, self._security)
            self._server = pb_grpc.JobServerStub(self._channel)
        return self._server

    def _checked(self, call):
        return self.credentials.checked(call) if self.credentials is not None else call

    def _send_probe(self, payload: bytes) -> None:
        self.hardware.shaper.rpc_delay()
        self.hardware.shaper.before_send(len(payload))
        with trusted_calls(self.credentials):
            self._stub.Probe(pb.LobbyProbe(payload=payload), timeout=60)

    def join(self) -> None:
        reference = reference_seconds(self.hardware.throttle.working)
        mbit = probe_link(self._send_probe, self.link)
        request = pb.JoinRequest(name=self.options.name, reference_s=reference,
                                 link_mbit_per_s=mbit if mbit == mbit else 0.0,
                                 protocol_version=edgetrain.PROTOCOL_VERSION)
        try:
            with trusted_calls(self.credentials):
                LOBBY_RETRY.call(self._checked(lambda: self._stub.Join(request, timeout=30)), f"Join at {self.address}")
        except transport.Unreachable as e:
            raise CoordinatorUnreachable(str(e)) from e
        logger.info("[Client] %s joined the job server at %s (reference %.3f s, link %.0f Mbit/s)",
                    self.options.name, self.address, reference, mbit if mbit == mbit else 0)
        if self.credentials is not None and self.credentials.pair_started is not None:
            logger.info("[Client] %s joined the job server %.2f s after it started pairing", self.options.name,
                        time.perf_counter() - self.credentials.pair_started)

    def next_offer(self) -> pb.JobOffer:
        """Long-poll until the server offers a job; re-join if it forgot us, retry while it restarts."""
        request = pb.NextJobRequest(name=self.options.name, max_wait_s=POLL_S)
        while True:
            try:
                with trusted_calls(self.credentials):
                    offer = LOBBY_RETRY.call(self._checked(lambda: self._stub.NextJob(request, timeout=POLL_S + 60)),
                                             f"NextJob at {self.address}")
                if offer.job_id:
                    return offer
            except transport.Unreachable as e:
                raise CoordinatorUnreachable(str(e)) from e
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                self.join()

    def serve(self) -> str:
        """Serve jobs until the battery runs flat (returns BATTERY_EMPTY) or the server is gone."""
        self.join()
        host = self.address.rsplit(":", 1)[0]
        while True:
            offer = self.next_offer()
            logger.info("[Client] %s works for job %s (coordinator port %d)", self.options.name, offer.job_name,
                        offer.port)
            conn = CoordinatorConnection(f"{host}:{offer.port}", shaper=self.hardware.shaper, link=self.link,
                                         retry=JOB_RETRY, credentials=self.credentials)
            worker = EdgeWorker(conn, self.options, self.hardware, self.local)
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
