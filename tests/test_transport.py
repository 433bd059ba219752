"""The one transport: typed refusals, the retry policy, resumable bundle transfers (real gRPC on 127.0.0.1)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from edge_client.endpoint import StageEndpoint
from edgetrain import serde, transport
from edgetrain.errors import FailureKind, Refusal
from edgetrain.streaming import TransferError, iter_chunks
from edgetrain.tensors import pack, unpack
from protos import coordinator_pb2 as pb
from protos import errors_pb2 as epb
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc


def test_typed_reasons_mirror_the_wire_enums_value_for_value():
    assert {r.name: r.value for r in Refusal} == {
        ("UNSPECIFIED" if n == "ERROR_REASON_UNSPECIFIED" else n): v for n, v in epb.ErrorReason.items()}
    assert {k.name: k.value for k in FailureKind} == {
        ("UNSPECIFIED" if n == "FAILURE_KIND_UNSPECIFIED" else n): v for n, v in pb.FailureKind.items()}


class _FlakyPeer(spb_grpc.StagePeerServicer):
    """A StagePeer whose PullState streams a fixed payload and breaks the first `breaks` streams
    half-way (it ends them early, as a dropped connection does)."""

    def __init__(self, tensors: dict[str, torch.Tensor], breaks: int, chunk_bytes: int = 4096) -> None:
        self.metas, self.payload = pack(tensors)
        self.breaks = breaks
        self.chunk_bytes = chunk_bytes
        self.offsets: list[int] = []

    def PullState(self, request: spb.StateRequest, context) -> Iterator[spb.StateMessage]:
        self.offsets.append(request.offset)
        if request.job_id == "refuse":
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, "not this job", Refusal.STAGE_STATE_MISMATCH)
        yield spb.StateMessage(header=serde.header_to_proto(self.metas))
        chunks = list(iter_chunks(self.payload, start=request.offset, chunk_bytes=self.chunk_bytes))
        broken = self.breaks > 0
        self.breaks -= 1
        for i, chunk in enumerate(chunks):
            if broken and i == len(chunks) // 2:
                return
            yield spb.StateMessage(chunk=serde.chunk_to_proto(chunk))


@pytest.fixture
def flaky_peer():
    peers = []

    def start(breaks: int):
        peer = _FlakyPeer({"w": torch.arange(20_000, dtype=torch.float32), "b": torch.ones(7)}, breaks)
        server, port = transport.create_server("127.0.0.1:0", [(spb_grpc.add_StagePeerServicer_to_server, peer)])
        channel = transport.open_channel(f"127.0.0.1:{port}")
        peers.append((server, channel))
        return peer, spb_grpc.StagePeerStub(channel)

    yield start
    for server, channel in peers:
        channel.close()
        server.stop(0)


def _open(stub, job_id: str = "job"):
    def open_stream(offset: int):
        return stub.PullState(spb.StateRequest(job_id=job_id, offset=offset), timeout=10)
    return open_stream


def test_a_broken_stream_resumes_from_the_last_good_byte_and_arrives_whole(flaky_peer):
    # Prepare: the first two streams break half-way
    peer, stub = flaky_peer(breaks=2)

    # Execute
    metas, payload = transport.receive_bundle(_open(stub), "pull", retry=transport.RetryPolicy(
        budget_s=10, initial_s=0.01, retry_on=transport.TRANSFER_RETRY_CODES))

    # Assert: three streams, each resuming where the last one stopped, and the exact bytes
    assert peer.offsets[0] == 0 and peer.offsets[1] > 0 and peer.offsets[2] > peer.offsets[1]
    assert len(peer.offsets) == 3
    assert bytes(payload) == bytes(peer.payload)
    assert torch.equal(unpack(metas, payload)["w"], torch.arange(20_000, dtype=torch.float32))


def test_a_refusal_carries_its_typed_reason_and_is_not_retried(flaky_peer):
    peer, stub = flaky_peer(breaks=0)
    with pytest.raises(grpc.RpcError) as info:
        transport.receive_bundle(_open(stub, "refuse"), "pull")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert transport.error_reason(info.value) == Refusal.STAGE_STATE_MISMATCH
    assert peer.offsets == [0]  # an answer, not an outage: one try


def test_a_stream_that_keeps_breaking_ends_with_unreachable_once_its_budget_is_spent(flaky_peer):
    peer, stub = flaky_peer(breaks=10**6)
    peer.chunk_bytes = 1 << 20  # one chunk per stream: a broken stream makes no progress
    started = time.monotonic()
    with pytest.raises(transport.Unreachable):
        transport.receive_bundle(_open(stub), "pull", retry=transport.RetryPolicy(
            budget_s=0.5, initial_s=0.05, retry_on=transport.TRANSFER_RETRY_CODES))
    assert time.monotonic() - started < 5 and len(peer.offsets) >= 2


def test_calls_to_a_port_nobody_serves_are_retried_until_the_budget_then_unreachable():
    server, port = transport.create_server("127.0.0.1:0", [])
    server.stop(0).wait()  # the port is free now: nothing answers there
    channel = transport.open_channel(f"127.0.0.1:{port}")
    stub = spb_grpc.StagePeerStub(channel)
    tries = []

    def call():
        tries.append(1)
        return stub.Send(iter(()), timeout=2)

    with pytest.raises(transport.Unreachable):
        transport.RetryPolicy(budget_s=0.6, initial_s=0.05).call(call, "send")
    channel.close()
    assert len(tries) >= 2


def test_only_retryable_errors_are_retried():
    policy = transport.RetryPolicy(budget_s=5, initial_s=0.01)
    calls = []

    def refuse():
        calls.append(1)
        raise TransferError("invalid_argument", "bad header")

    with pytest.raises(TransferError):
        policy.call(refuse, "call")
    assert calls == [1]  # a refusal is an answer
    broken = transport.RetryPolicy(budget_s=5, initial_s=0.01, retry_on=transport.TRANSFER_RETRY_CODES)
    assert broken.retryable(TransferError("data_loss", "crc"))
    assert not transport.CALLS.retryable(TransferError("data_loss", "crc"))


def test_progress_starts_the_budget_afresh():
    backoff = transport.RetryPolicy(budget_s=0.3, initial_s=0.1, max_s=0.1, sleep=lambda s: None).start("op")
    error = TransferError("data_loss", "broken")
    backoff.wait(error)
    time.sleep(0.35)
    with pytest.raises(transport.Unreachable):
        backoff.wait(error)
    backoff.reset()
    backoff.wait(error)  # progress: a fresh budget


def test_send_bundle_resumes_from_what_the_receiver_holds_and_treats_a_late_accept_as_done():
    starts, held = [], [0]

    class Broken(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return self._code.name

    def send_from(start: int) -> None:
        starts.append(start)
        if len(starts) == 1:
            held[0] = 300
            raise Broken(grpc.StatusCode.UNAVAILABLE)
        raise Broken(grpc.StatusCode.ALREADY_EXISTS)  # the second try's reply was lost after it was accepted

    transport.send_bundle(send_from, lambda: held[0], "upload",
                          retry=transport.RetryPolicy(budget_s=5, initial_s=0.01, retry_on=transport.TRANSFER_RETRY_CODES))
    assert starts == [0, 300]


def test_a_server_refuses_a_second_bind_of_its_port():
    server, port = transport.create_server("127.0.0.1:0", [])
    try:
        with pytest.raises(OSError):
            transport.create_server(f"127.0.0.1:{port}", [])
    finally:
        server.stop(0)


def test_the_stage_endpoint_resumes_an_interrupted_pull_from_its_cache():
    # Prepare: an endpoint owning a stage of the small CNN
    from edgetrain.models import build_model

    endpoint = StageEndpoint("127.0.0.1:0")
    model = build_model("small_cnn", seed=0)
    endpoint.state.attach(model, "job")
    stage = endpoint.state.expected(0, 2)
    metas, payload = pack(stage)
    channel = transport.open_channel(f"127.0.0.1:{endpoint.port}")
    stub = spb_grpc.StagePeerStub(channel)
    load = spb.StateRequest(job_id="job", first_block=0, end_block=2, version=5, momentum=0.9)

    def messages():
        yield spb.StateMessage(request=load)
        yield spb.StateMessage(header=serde.header_to_proto(metas))
        for chunk in iter_chunks(payload, chunk_bytes=4096):
            yield spb.StateMessage(chunk=serde.chunk_to_proto(chunk))

    try:
        stub.LoadState(messages(), timeout=10)
        pull = spb.StateRequest(job_id="job", first_block=0, end_block=2, version=5, commit_step=-1, release=True)
        first = list(stub.PullState(pull, timeout=10))  # the whole state; the board releases the stage
        whole = b"".join(m.chunk.data for m in first[1:])

        # Execute: a resumed pull of the same version after the release still gets the rest
        pull.offset = 1000
        rest = list(stub.PullState(pull, timeout=10))

        # Assert
        assert rest[0].WhichOneof("kind") == "header" and rest[1].chunk.offset == 1000
        assert b"".join(m.chunk.data for m in rest[1:]) == whole[1000:]
        pull.version, pull.offset = 6, 1000  # nothing to resume for another version
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullState(pull, timeout=10))
        assert transport.error_reason(info.value) == Refusal.STAGE_STATE_MISMATCH
    finally:
        channel.close()
        endpoint.close()


def test_a_channel_cache_gives_one_channel_per_address_and_closes_them():
    cache = transport.ChannelCache()
    a, b = cache.get("127.0.0.1:1"), cache.get("127.0.0.1:1")
    assert a is b and cache.get("127.0.0.1:2") is not a
    cache.close()
    assert cache.get("127.0.0.1:1") is not a  # closed channels are not handed out again


def test_a_retry_budget_of_none_retries_until_it_works():
    attempts = []

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "down"

    def flaky():
        attempts.append(1)
        if len(attempts) < 5:
            raise Down()
        return "up"

    assert transport.RetryPolicy(budget_s=None, initial_s=0.001, max_s=0.002).call(flaky, "call") == "up"
    assert len(attempts) == 5


def test_a_policy_with_a_most_tries_count_gives_up_after_that_many_however_quick():
    calls = []

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "down"

    def down():
        calls.append(1)
        raise Down()

    with pytest.raises(transport.Unreachable):
        transport.RetryPolicy(budget_s=None, max_tries=3, initial_s=0.001).call(down, "send")
    assert len(calls) == 3
