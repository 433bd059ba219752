"""The job server's client (edgetrain.job_client): typed calls, retries that keep a Submit's key."""

from __future__ import annotations

import grpc
import pytest
from test_job_server import in_process, job_yaml, operator_security  # noqa: F401

from edgetrain import transport
from edgetrain.job_client import JobServerClient
from protos import jobs_pb2 as pb

pytestmark = pytest.mark.timeout(120)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"


class _FlakyStub:
    """Loses the reply of the first Submit (as a broken connection does), answers the second."""

    def __init__(self) -> None:
        self.requests: list[pb.SubmitRequest] = []

    def Submit(self, request: pb.SubmitRequest, timeout: float) -> pb.JobView:  # noqa: N802
        self.requests.append(request)
        if len(self.requests) == 1:
            raise _Unavailable()
        return pb.JobView(id="j1")


def test_a_retried_submit_keeps_its_idempotency_key():
    # Prepare
    client = JobServerClient("127.0.0.1:1", retry=transport.RetryPolicy(budget_s=5, sleep=lambda s: None))
    client._stub = stub = _FlakyStub()
    try:
        # Execute
        view = client.submit("name: x\n")
        client.submit("name: x\n")
    finally:
        client.close()
    # Assert: both tries of the first submit share one key; the next submit has its own
    first, retry, second = (r.idempotency_key for r in stub.requests)
    assert view.id == "j1"
    assert first and first == retry and second != first


def test_the_client_submits_lists_and_cancels(in_process):  # noqa: F811
    server = in_process()
    with JobServerClient(server.address, operator_security()) as client:
        view = client.submit(job_yaml("a", 5, {"kind": "soft"}), key="k")
        again = client.submit(job_yaml("a", 5, {"kind": "soft"}), key="k")
        assert (view.id, again.id, view.state) == ("j1", "j1", "waiting")
        assert [j.id for j in client.list_jobs().jobs] == ["j1"]
        assert client.boards_joined() == 0
        assert client.cancel("j1").state == "cancelled"
        assert client.job("j1").state == "cancelled" and client.job("j9") is None
        with pytest.raises(grpc.RpcError) as refused:
            client.cancel("j9")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_unreachable_job_server_is_reported_after_the_budget():
    with JobServerClient("127.0.0.1:1", retry=transport.RetryPolicy(budget_s=0.5, max_s=0.1)) as client:
        with pytest.raises(transport.Unreachable, match="JobServer.ListJobs at 127.0.0.1:1"):
            client.list_jobs()
