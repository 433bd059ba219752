"""`edgetrain submit | jobs | cancel`: a user's view of a job server (`edgetrain coordinator --jobs`).

A job file is validated here before any server is looked for, so its error names file, key and
value at once (including the job server's rule that a job writes its name, model and length
itself: ``coordinator.jobs.submission``). Every call dials with the `security` the CLI gives: an
operator's certificate (mutual TLS, dialing the gateway's name), or plaintext with --insecure.
Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml

from coordinator.jobs.lobby import far_off
from coordinator.jobs.submission import require_written
from edgetrain import transport
from edgetrain.config import ConfigError, apply_overrides, job_from_dict, load_yaml
from edgetrain.discovery import browse, default_interfaces, serves_jobs
from edgetrain.job_client import JobServerClient
from protos import jobs_pb2 as pb

SERVER_ENV = "EDGETRAIN_SERVER"
COMMAND_CALLS = transport.RetryPolicy(budget_s=5.0, max_s=1.0)
"""A user waits for an answer: a job server unreachable for 5 s is reported, not waited for."""
T = TypeVar("T")


class JobsCommandError(RuntimeError):
    """What the user should read: no server found, or the server's precise answer."""


def find_server(server: str | None, cluster: str | None, interfaces: list[str] | None,
                security: transport.Security = transport.INSECURE) -> str:
    """`server`, else $EDGETRAIN_SERVER, else the job server advertised over mDNS (one of the
    operator's fleet when `security` holds a certificate: its CA's fingerprint is advertised)."""
    if server or os.environ.get(SERVER_ENV):
        return server or os.environ[SERVER_ENV]

    fleet = _fleet_fingerprint(security)
    records = [r for r in browse(interfaces=interfaces or default_interfaces(), timeout_s=5.0)
               if (cluster is None or r.cluster == cluster) and (fleet is None or r.ca_fingerprint == fleet)]
    servers = [r.address for r in records if is_job_server(r.address, security=security)]
    if not servers:
        seen = ", ".join(f"{r.cluster} at {r.address}" for r in records) or "nothing"
        raise JobsCommandError(f"no job server found over mDNS (saw {seen}); pass --server HOST:PORT")
    return servers[0]


def _fleet_fingerprint(security: transport.Security) -> str | None:
    """The fleet CA fingerprint of `security`'s certificate (None: plaintext)."""
    if not isinstance(security, transport.MutualTLS):
        return None
    return security.credentials.identity.ca_fingerprint


def is_job_server(address: str, budget_s: float = 3.0, *,
                  security: transport.Security = transport.INSECURE) -> bool:
    """Whether `address` answers as a job server within `budget_s`. A lone job's coordinator
    answers UNIMPLEMENTED (it serves no JobServer service); an address where nothing answers is
    not one either."""
    try:
        return serves_jobs(address, retry=transport.RetryPolicy(budget_s=budget_s), security=security)
    except (transport.Unreachable, grpc.RpcError):
        return False


def _ask(address: str, security: transport.Security, call: Callable[[JobServerClient], T]) -> T:
    """`call(client)` on a client of the job server at `address`; a failure as a JobsCommandError."""
    with JobServerClient(address, security, retry=COMMAND_CALLS) as client:
        try:
            return call(client)
        except (grpc.RpcError, transport.Unreachable) as e:
            error = e.__cause__ if isinstance(e, transport.Unreachable) else e
            detail = transport.describe(error)
            if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE:
                detail += (" (dialed with mutual TLS and an operator credential: is it a job server of this fleet, "
                           "not one started with --insecure?)" if security.secure else
                           " (dialed without TLS, as --insecure asks: is it a job server started with --insecure?)")
            raise JobsCommandError(detail) from None


def submit_job(path: Path, overrides: list[tuple[str, Any]], *, server: str | None = None,
               cluster: str | None = None, interfaces: list[str] | None = None,
               security: transport.Security = transport.INSECURE) -> str:
    """Queue the job in `path` (with `overrides`) at the job server; a line saying so."""
    try:
        data = load_yaml(path)
    except ConfigError as e:
        raise JobsCommandError(str(e)) from None
    try:
        data = apply_overrides(data, dict(overrides))
    except ConfigError as e:
        raise JobsCommandError(f"{path}: {e}") from None
    try:
        job_from_dict(data, source=str(path))
        require_written(data, source=str(path))
    except ConfigError as e:
        raise JobsCommandError(str(e)) from None
    address = find_server(server, cluster, interfaces, security)
    view = _ask(address, security, lambda client: client.submit(yaml.safe_dump(data)))
    return f"job {view.id} ({view.name}, {view.model}, {view.kind}: {view.request}) submitted to {address}"


def cancel_job(job_id: str, *, server: str | None = None, cluster: str | None = None,
               interfaces: list[str] | None = None, security: transport.Security = transport.INSECURE) -> str:
    """Cancel job `job_id` at the job server; a line saying so."""
    view = _ask(find_server(server, cluster, interfaces, security), security, lambda client: client.cancel(job_id))
    return f"job {view.id} ({view.name}) cancelled"


def _when(t: float, now: float) -> str:
    if not t:
        return "-"
    d = t - now
    return "now" if abs(d) < 1 else (f"in {d:.0f} s" if d > 0 else f"{-d:.0f} s ago")


def jobs_report(*, server: str | None = None, cluster: str | None = None, interfaces: list[str] | None = None,
                as_json: bool = False, security: transport.Security = transport.INSECURE) -> str:
    """The job server's jobs and boards as a table (or JSON); a board whose claimed speed its
    steps contradict, and a job far slower than predicted, are flagged."""
    address = find_server(server, cluster, interfaces, security)
    reply = _ask(address, security, JobServerClient.list_jobs)
    from google.protobuf.json_format import MessageToDict

    if as_json:
        return json.dumps(MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                          indent=1)
    now = reply.now or time.time()
    head = ("id", "name", "model", "request", "state", "boards", "start", "finish", "progress", "note")
    rows = []
    for j in reply.jobs:
        start = j.started if j.state in ("starting", "running", "finished", "failed") else j.planned_start
        finish = j.finished or j.predicted_finish
        overdue = j.state == "waiting" and start and start < now - 1  # its boards' jobs overran their prediction
        rows.append((j.id, j.name, j.model, f"{j.kind}: {j.request}", j.state, ",".join(j.boards) or "-",
                     "when its boards free" if overdue else _when(start, now), ("predicted " if not j.finished and finish else "") + _when(finish, now),
                     f"{j.steps_done}/{j.steps}", _note(j)))
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head) - 1)]
    lines = [f"job server {address}: scheduler {reply.scheduler}"
             + (" (last plan proven optimal)" if reply.plan_exact else "")]
    for r in (head, *rows):
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    lines.append("boards: " + (", ".join(
        f"{b.name} ({b.speed:.2f} core, {b.link_mbit_per_s:.0f} Mbit/s, "
        f"{'job ' + b.job if b.job else 'free' if b.alive else 'gone'})" for b in reply.boards) or "none"))
    lines += [f"flagged: {b.name} {b.flag}; planned at {b.speed:.2f}" for b in reply.boards if b.flag]
    return "\n".join(lines)


def _note(job: pb.JobView) -> str:
    """Why it failed or waits, how often it was launched, and its measured speed when that is
    far off the prediction (its boards' claims were)."""
    notes = [job.message + (f" (launch {job.launches})" if job.launches > 1 else "")]
    measured, predicted = job.measured_samples_per_s, job.predicted_samples_per_s
    if far_off(predicted, measured):
        notes.append(f"measured {measured:.1f} samples/s, predicted {predicted:.1f}")
    return "; ".join(n for n in notes if n)
