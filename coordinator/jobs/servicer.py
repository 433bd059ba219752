"""The job server's gRPC face (service ``JobServer``) and ``serve_jobs``, its entry point.

Thin handlers: every bad request gets a precise status and the server keeps serving. Who may
call what is checked before a handler runs (``coordinator.pairing.trust_guard``: Submit and
Cancel need an operator's certificate, Join and NextJob a board's, the rest any fleet
certificate); the handlers add that a board joins and polls only under the name in its
certificate. On a plaintext (``--insecure``) server none of this is checked.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc

import edgetrain
from coordinator.advertiser import advertise_on
from coordinator.dashboard.server import serve_dashboard
from coordinator.dashboard.view import JobServerView
from coordinator.jobs.server import JobServer, KeyReused
from coordinator.jobs.store import JobRecord
from coordinator.pairing import serve_gateway
from edgetrain import transport, trust
from edgetrain.config import ConfigError
from edgetrain.errors import Refusal
from protos import jobs_pb2 as pb
from protos import jobs_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def job_view(job: JobRecord, runs_dir: Path) -> pb.JobView:
    return pb.JobView(id=job.id, name=job.name, model=job.model, kind=job.kind, request=job.request,
                      state=job.state, boards=job.boards, priority=job.priority, submitted=job.submitted,
                      planned_start=job.planned_start, predicted_finish=job.predicted_finish,
                      started=job.started, finished=job.finished, steps=job.steps, steps_done=job.steps_done,
                      predicted_samples_per_s=job.predicted_samples_per_s,
                      measured_samples_per_s=job.measured_samples_per_s, message=job.message,
                      run_dir=str(runs_dir / job.run_name), launches=job.launches)


class JobServerServicer(pb_grpc.JobServerServicer):
    """gRPC face of a JobServer; every bad request gets a precise status, the server keeps serving."""

    def __init__(self, server: JobServer) -> None:
        self.server = server

    def Submit(self, request: pb.SubmitRequest, context) -> pb.JobView:
        try:
            job = self.server.submit(request.job_yaml, request.idempotency_key)
            return job_view(job, self.server.runs_dir)
        except KeyReused as e:
            transport.abort(context, grpc.StatusCode.ALREADY_EXISTS, f"Submit: {e}")
        except ConfigError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Submit: {e}")

    def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsReply:
        jobs, boards = self.server.snapshot()
        return pb.ListJobsReply(
            jobs=[job_view(j, self.server.runs_dir) for j in jobs], scheduler=self.server.scheduler_name,
            boards=[pb.BoardView(name=b.name, speed=b.speed, link_mbit_per_s=b.mbit_per_s, job=b.job, alive=b.alive,
                                 claimed_speed=b.claimed_speed, measured_speed=b.measured_speed, flag=b.flag)
                    for b in sorted(boards, key=lambda b: b.name)],
            now=self.server.clock(), plan_exact=self.server.plan_exact)

    def Cancel(self, request: pb.CancelRequest, context) -> pb.JobView:
        try:
            return job_view(self.server.cancel(request.id), self.server.runs_dir)
        except KeyError:
            transport.abort(context, grpc.StatusCode.NOT_FOUND, f"Cancel: no job {request.id!r}")
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"Cancel: {e}")

    def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        if request.protocol_version != edgetrain.PROTOCOL_VERSION:
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                            f"Join: protocol version {request.protocol_version}, this server speaks "
                            f"{edgetrain.PROTOCOL_VERSION}", Refusal.PROTOCOL_MISMATCH)
        transport.require_peer(context, request.name, "join the lobby in the name")
        try:
            self.server.join(request.name, request.reference_s, request.link_mbit_per_s)
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Join: {e}")
        return pb.JoinReply(poll_s=self.server.poll_s)

    def NextJob(self, request: pb.NextJobRequest, context) -> pb.JobOffer:
        transport.require_peer(context, request.name, "ask for the next job")
        try:
            job = self.server.next_job(request.name, request.max_wait_s)
        except KeyError:
            transport.abort(context, grpc.StatusCode.NOT_FOUND, f"NextJob: unknown board {request.name!r}: Join first")
        if job is None:
            return pb.JobOffer()
        return pb.JobOffer(job_id=job.id, port=job.port, job_name=job.run_name)

    def Probe(self, request: pb.LobbyProbe, context) -> pb.LobbyProbeAck:
        return pb.LobbyProbeAck()


def serve_jobs(*, bind: str, state_dir: Path, runs_dir: Path, data_dir: Path, scheduler: str = "rolling",
               port_file: str | None = None, stop: threading.Event | None = None, cluster: str = "edgetrain",
               advertise: list[str] | None = None, authority: trust.Authority | None = None,
               pair_bind: str | None = None, dashboard: str | None = None) -> None:
    """Run a job server until `stop` (or SIGTERM in the CLI).

    Under `authority` it serves mutual TLS on `bind` and the pairing port (the next port, or
    `pair_bind`; "none": no pairing), advertises the CA's fingerprint, and its jobs' coordinators
    serve under the same authority; without one (``--insecure``) everything is plaintext. The
    port file gets the fleet address on line 1 and the pairing address, when served, on line 2.
    With `dashboard` ("host:port") it serves the jobs' dashboard there (coordinator.dashboard; its
    URL is logged and written to <state_dir>/dashboard.url).
    """
    stop = stop or threading.Event()
    host = bind.rsplit(":", 1)[0]
    server = JobServer(state_dir=state_dir, runs_dir=runs_dir, data_dir=data_dir,
                       host="0.0.0.0" if host in ("", "[::]") else host, scheduler=scheduler, authority=authority,
                       job_dashboards=dashboard.rsplit(":", 1)[0] if dashboard else None)
    servers = serve_gateway(bind, [(pb_grpc.add_JobServerServicer_to_server, JobServerServicer(server))],
                            authority=authority, pair_bind=pair_bind)
    server.reference_s  # noqa: B018 - measure before boards join, on a quiet machine
    advertiser = advertise_on(cluster, host, servers.port, advertise,
                              ca_fingerprint=authority.fingerprint if authority else "") if advertise else None
    pairing = ""
    if servers.pairing_server is not None:
        pairing = f"{(pair_bind or bind).rsplit(':', 1)[0]}:{servers.pairing_port}"
    if authority is None:
        logger.warning("[JobServer] serving on %s:%d WITHOUT TLS (--insecure): any host that reaches the port can "
                       "submit, cancel and take jobs (scheduler %s, state in %s)", host, servers.port, scheduler,
                       state_dir)
    else:
        logger.info("[JobServer] serving on %s:%d with mutual TLS (fleet CA %s…)%s (scheduler %s, state in %s)", host,
                    servers.port, authority.fingerprint[:16], f"; boards pair on {pairing}" if pairing else "",
                    scheduler, state_dir)
    page = serve_dashboard(dashboard, JobServerView(server).state, Path(state_dir) / "dashboard.url",
                           authority) if dashboard else None
    if port_file:  # last: whoever waits for it finds the dashboard's URL written too
        Path(port_file).write_text("".join(f"{line}\n" for line in (f"{host}:{servers.port}", pairing) if line))
    try:
        server.run(stop)
    finally:
        if page:
            page.close()
        if advertiser:
            advertiser.close()
        servers.stop(grace=1.0)
        server.shutdown()
