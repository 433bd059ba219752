"""The coordinator's replica of an owned stage equals the host's state after every committed step.

A real StagePeer endpoint (mutual TLS with a board certificate, gRPC on 127.0.0.1) owns blocks of
MobileNetV2 (BatchNorm: buffers matter) and steps them with its own SGD; `StageOwners`, dialling
as the gateway, pulls each attempt's changes (`PullStep`) while the host computes them and
applies those of the committed attempts to the master. After a failed attempt, a redone one and
several committed steps, the master's stage — parameters, BatchNorm statistics and momenta —
equals, bit for bit, what the host gives back when pulled. Bad PullStep calls get precise codes.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from conftest import board_identity

from coordinator.training.stage_owners import Owner, ReplicaError, StageOwners
from edge_client.endpoint import StageEndpoint
from edgetrain import transport, trust
from edgetrain.models import build_model
from edgetrain.tensors import unpack
from edgetrain.training import MOMENTUM_PREFIX
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc

BLOCKS = (0, 3)
LR = 0.1


@pytest.fixture
def endpoint():
    ep = StageEndpoint("127.0.0.1:0", credentials=transport.Credentials(board_identity("replica-host")))
    yield ep
    ep.close()


def _gateway() -> transport.MutualTLS:
    return trust.Authority(trust.default_authority_dir()).gateway_identity().security()


def _stub(endpoint, security: transport.Security) -> spb_grpc.StagePeerStub:
    return spb_grpc.StagePeerStub(transport.open_channel(f"127.0.0.1:{endpoint.port}",
                                                         security.dialing(trust.BOARD_SERVER_NAME)))


def _compute(model, seed: int) -> None:
    """A stage's backward pass on the host (moves BatchNorm statistics too)."""
    model.train()
    for block in model.block_modules(*BLOCKS):
        for p in block.parameters():
            p.grad = None
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    model.run_blocks(x, *BLOCKS).pow(2).mean().backward()


def _pulled_state(endpoint, version: int, commit: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The host's own state at `version` (PullState, as a re-plan takes it back)."""
    request = spb.StateRequest(job_id="job", first_block=BLOCKS[0], end_block=BLOCKS[1], version=version,
                               commit_step=commit[0], commit_attempt=commit[1])
    messages = list(_stub(endpoint, _gateway()).PullState(request, timeout=30))
    payload = b"".join(m.chunk.data for m in messages[1:])
    from edgetrain import serde
    metas, _ = serde.header_from_proto(messages[0].header)
    return unpack(metas, bytearray(payload))


def test_the_replica_equals_the_hosts_state_after_every_committed_step(endpoint):
    # Prepare: the master (nesterov momentum and weight decay: every term of the update) and a
    # host whose model starts elsewhere (the hand-over must replace it)
    master = build_model("mobilenet_v2", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4, nesterov=True)
    host = build_model("mobilenet_v2", seed=1)
    state = endpoint.state
    state.attach(host, "job")
    owners = StageOwners("job", master, optimizer, timeout_s=30, security=_gateway())
    owner = Owner("h-1", f"127.0.0.1:{endpoint.port}", BLOCKS)
    assert owners.place({BLOCKS: owner}, 0, (-1, 0), 0, lambda d: True) == ([], {})
    untouched = {n: t.clone() for n, t in master.state_dict().items()
                 if not n.startswith(tuple(f"blocks.{k}." for k in list(master.blocks.keys())[:BLOCKS[1]]))}
    # (step, attempt, whether the host finishes it): step 1's first attempt fails on the host
    attempts = [(0, 0, True), (1, 0, False), (1, 1, True), (2, 0, True), (3, 0, True)]
    commit = (-1, 0)

    # Execute: each attempt's pull is opened before the host begins it, as the coordinator does
    failures = []
    for step, attempt, finishes in attempts:
        lr = LR / (step + 1)
        pull = owners.pull_step(owner, step, attempt, timeout_s=30)
        state.begin(step, *BLOCKS, *commit, attempt=attempt)
        _compute(host, seed=10 * step + attempt)
        if not finishes:
            state.abandon()
            with pytest.raises((grpc.RpcError, ReplicaError)) as info:
                pull.result(30)
            failures.append(transport.describe(info.value))
            continue
        state.finish(step, attempt, lr)
        owners.apply_step(BLOCKS, pull.result(30), lr, step)  # the step commits
        commit = (step, attempt)
    host_state = _pulled_state(endpoint, 4, commit)

    # Assert: the failed attempt gave no changes; the master's stage is the host's, bit for bit
    assert len(failures) == 1 and "FAILED_PRECONDITION" in failures[0] and "without a result" in failures[0]
    master_state = master.state_dict()
    params = dict(master.named_parameters())
    stage_names = [n for n in host_state if not n.startswith(MOMENTUM_PREFIX)]
    assert stage_names and any("running_mean" in n for n in stage_names)
    for name in stage_names:
        assert torch.equal(master_state[name], host_state[name]), name
    for name in [n for n in host_state if n.startswith(MOMENTUM_PREFIX)]:
        momentum = optimizer.state[params[name[len(MOMENTUM_PREFIX):]]]["momentum_buffer"]
        assert torch.equal(momentum, host_state[name]), name
    assert len(host_state) - len(stage_names) == sum(1 for n in params if n in stage_names)
    assert all(torch.equal(master_state[n], t) for n, t in untouched.items())
    assert owners.synced[BLOCKS] == 4 and owners.replica_bytes > 0
    assert owners.sync(4, commit, lambda d: True) == [] and owners.bytes_moved < owners.replica_bytes  # nothing to pull
    owners.close()


def test_bad_pull_step_calls_get_precise_codes_and_the_endpoint_keeps_serving(endpoint):
    # Prepare: the host owns blocks [0, 3) at version 0 and has computed step 0 attempt 0
    master = build_model("mobilenet_v2", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR, momentum=0.9)
    state = endpoint.state
    state.attach(build_model("mobilenet_v2", seed=0), "job")
    owners = StageOwners("job", master, optimizer, timeout_s=30, security=_gateway())
    owners.place({BLOCKS: Owner("h-1", f"127.0.0.1:{endpoint.port}", BLOCKS)}, 0, (-1, 0), 0, lambda d: True)
    state.begin(0, *BLOCKS, -1, 0, attempt=0)
    _compute(state.model, seed=0)
    state.finish(0, 0, LR)
    gateway = _stub(endpoint, _gateway())

    def request(**fields) -> spb.StepRequest:
        return spb.StepRequest(**{"job_id": "job", "first_block": 0, "end_block": 3, "step": 0, "attempt": 0,
                                  **fields})

    cases = [
        (gateway, request(end_block=2), grpc.StatusCode.FAILED_PRECONDITION, "not blocks [0, 2)"),
        (gateway, request(job_id="other"), grpc.StatusCode.FAILED_PRECONDITION, "not 'other'"),
        (gateway, request(attempt=1, offset=10), grpc.StatusCode.FAILED_PRECONDITION, "no pull of"),
        (_stub(endpoint, board_identity("a-neighbour").security()), request(), grpc.StatusCode.PERMISSION_DENIED,
         "gateway"),
    ]

    # Execute / Assert: each refused with its code; a newer attempt ends a waiting pull at once
    for stub, message, code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullStep(message, timeout=10))
        assert info.value.code() == code and words in info.value.details(), info.value.details()
    waiting = gateway.PullStep(request(step=0, attempt=1), timeout=60)  # not begun on the host
    endpoint.mailbox.supersede(0, 2)
    with pytest.raises(grpc.RpcError) as info:
        list(waiting)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "newer attempt" in info.value.details()

    whole = list(gateway.PullStep(request(), timeout=10))  # still serving; and a pull resumes mid-way
    resumed = list(gateway.PullStep(request(offset=1000), timeout=10))
    data = b"".join(m.chunk.data for m in whole[1:])
    assert resumed[0].header == whole[0].header and resumed[1].chunk.offset == 1000
    assert b"".join(m.chunk.data for m in resumed[1:]) == data[1000:]
    owners.close()
