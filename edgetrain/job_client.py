"""The one client of the job server (`edgetrain coordinator --jobs`): what `edgetrain submit |
jobs | cancel`, the experiment runner and the job benchmark call.

It lives in the core, beside the transport, because the experiment runner above the roles uses
it too (the core never imports a role). Every call retries UNAVAILABLE under a
``transport.RetryPolicy`` (retry only at the client boundary); a Submit carries one idempotency
key for all its retries, so a Submit whose reply was lost does not queue its job twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

import grpc

from edgetrain import transport
from protos import jobs_pb2 as pb
from protos import jobs_pb2_grpc as pb_grpc

T = TypeVar("T")

JOB_CALLS = transport.RetryPolicy(budget_s=10.0, max_s=2.0)
"""A job server restarting comes back within seconds; longer than that is worth telling a user."""
CALL_TIMEOUT_S = 60.0
"""One call's deadline (a Submit warms the job's model on the server first)."""


class JobServerClient:
    """Typed calls to one job server at `address`, dialed with `security`; close it (or use it
    as a context manager) to close its channel."""

    def __init__(self, address: str, security: transport.Security = transport.INSECURE, *,
                 retry: transport.RetryPolicy = JOB_CALLS, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.address, self.retry, self.timeout_s = address, retry, timeout_s
        self._channel = transport.open_channel(address, security)
        self._stub = pb_grpc.JobServerStub(self._channel)

    def __enter__(self) -> JobServerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def submit(self, job_yaml: str, *, key: str | None = None) -> pb.JobView:
        """Queue `job_yaml`; the job queued. `key` (a fresh one when None) names this submit to
        the server: every retry of it, and a later submit with the same key, gets the same job."""
        request = pb.SubmitRequest(job_yaml=job_yaml, idempotency_key=key or uuid.uuid4().hex)
        return self._call(lambda: self._stub.Submit(request, timeout=self.timeout_s), "Submit")

    def list_jobs(self) -> pb.ListJobsReply:
        """Every job and every board the server knows."""
        return self._call(lambda: self._stub.ListJobs(pb.ListJobsRequest(), timeout=self.timeout_s),
                          "ListJobs")

    def job(self, job_id: str) -> pb.JobView | None:
        """Job `job_id` as the server lists it (None: it lists none by that id)."""
        return next((j for j in self.list_jobs().jobs if j.id == job_id), None)

    def cancel(self, job_id: str) -> pb.JobView:
        """Cancel job `job_id`; the job as cancelled."""
        request = pb.CancelRequest(id=job_id)
        return self._call(lambda: self._stub.Cancel(request, timeout=self.timeout_s), "Cancel")

    def boards_joined(self) -> int:
        """Boards in the server's lobby, after one try (0 while it does not answer yet)."""
        try:
            return len(self._stub.ListJobs(pb.ListJobsRequest(), timeout=10).boards)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return 0
            raise

    def _call(self, fn: Callable[[], T], method: str) -> T:
        return self.retry.call(fn, f"JobServer.{method} at {self.address}")
