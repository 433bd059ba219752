"""Stage state owned by its host: handed over, stepped by the host, taken back — exactly.

A real StagePeer endpoint (gRPC on 127.0.0.1) holds blocks of MobileNetV2 (BatchNorm, so buffers
matter). The coordinator side (`StageOwners`) loads them, the host applies committed steps with
its own SGD, and the pull brings back what the coordinator's own SGD would have computed:
parameters, BatchNorm statistics and momentum. Bad LoadState/PullState calls get precise status
codes and the endpoint keeps serving. The endpoint serves mutual TLS with a board certificate of
the session's fleet and the coordinator side dials it as the gateway, as in a fleet.
"""

from __future__ import annotations

import copy

import grpc
import pytest
import torch
from conftest import board_identity

from coordinator.training.stage_owners import Owner, StageOwners
from edge_client.endpoint import StageEndpoint
from edgetrain import serde, transport, trust
from edgetrain.models import build_model
from edgetrain.streaming import iter_chunks
from edgetrain.tensors import pack
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc

BLOCKS = (0, 3)
LR = 0.1


@pytest.fixture
def endpoint():
    ep = StageEndpoint("127.0.0.1:0", credentials=transport.Credentials(board_identity("stage-host")))
    yield ep
    ep.close()


def _gateway() -> transport.MutualTLS:
    """The coordinator's credentials: the session fleet's gateway certificate."""
    return trust.Authority(trust.default_authority_dir()).gateway_identity().security()


def _stage_forward(model, x):
    out = model.run_blocks(x, *BLOCKS)
    return out.pow(2).mean()


def _grads_on_host(model, x):
    model.train()
    for block in model.block_modules(*BLOCKS):
        for p in block.parameters():
            p.grad = None
    _stage_forward(model, x).backward()


def _reference_step(model, optimizer, x, lr):
    """What the coordinator's own SGD does with the same batch."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    _stage_forward(model, x).backward()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def _stage_prefixes(model):
    return tuple(f"blocks.{k}." for k in list(model.blocks.keys())[BLOCKS[0]:BLOCKS[1]])


def test_owned_stage_steps_on_the_host_equal_the_coordinators_sgd(endpoint):
    # Prepare: the coordinator's master (and a copy stepping as the reference), the host's model
    master = build_model("mobilenet_v2", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    reference = copy.deepcopy(master)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    host = build_model("mobilenet_v2", seed=1)  # different weights: the load must replace them
    endpoint.state.attach(host, "job")
    owners = StageOwners("job", master, optimizer, security=_gateway())
    owner = Owner("h-1", f"127.0.0.1:{endpoint.port}", BLOCKS)
    batches = [torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    state = endpoint.state

    # Execute: hand over; step 0 commits; step 1 attempt 0 fails (its forward moved BN statistics);
    # step 1 attempt 1 commits; step 2 commits; pull at version 3
    losses, failed = owners.place({BLOCKS: owner}, 0, (-1, 0), 0, lambda d: True)
    assert (losses, failed) == ([], {})
    state.begin(0, *BLOCKS, -1, 0, attempt=0)
    _grads_on_host(host, batches[0])
    state.finish(0, 0, LR)
    state.begin(1, *BLOCKS, 0, 0, attempt=0)  # step 0 committed: applied now
    _grads_on_host(host, batches[2])  # a failed attempt: its gradients and BN updates are void
    state.abandon()
    state.begin(1, *BLOCKS, 0, 0, attempt=1)
    _grads_on_host(host, batches[1])
    state.finish(1, 1, LR / 2)
    state.begin(2, *BLOCKS, 1, 1, attempt=0)
    _grads_on_host(host, batches[2])
    state.finish(2, 0, LR / 4)
    master_before = {n: t.clone() for n, t in master.state_dict().items()}
    assert owners.sync(3, (2, 0), lambda d: True) == []
    for x, lr in zip(batches, (LR, LR / 2, LR / 4), strict=True):
        _reference_step(reference, ref_opt, x, lr)

    # Assert: the master's stage equals the reference exactly; the rest of the master is untouched
    prefixes = _stage_prefixes(master)
    ref_state = reference.state_dict()
    for name, tensor in master.state_dict().items():
        if name.startswith(prefixes):
            assert torch.allclose(tensor.float(), ref_state[name].float(), atol=1e-6), name
        else:
            assert torch.equal(tensor, master_before[name]), name
    ref_params = dict(reference.named_parameters())
    for name, p in master.named_parameters():
        if name.startswith(prefixes):
            momentum = optimizer.state[p]["momentum_buffer"]
            assert torch.allclose(momentum, ref_opt.state[ref_params[name]]["momentum_buffer"], atol=1e-6), name
    assert owners.owners == {BLOCKS: owner}  # a sync leaves the stage with its host
    owners.close()


def test_a_dead_owner_leaves_the_last_pulled_copy_and_is_reported(endpoint):
    master = build_model("small_cnn", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR, momentum=0.9)
    endpoint.state.attach(build_model("small_cnn", seed=0), "job")
    owners = StageOwners("job", master, optimizer, timeout_s=10, security=_gateway())
    owner = Owner("h-1", f"127.0.0.1:{endpoint.port}", (0, 2))
    assert owners.place({(0, 2): owner}, 4, (3, 0), 0, lambda d: True) == ([], {})
    before = {n: t.clone() for n, t in master.state_dict().items()}

    losses = owners.sync(9, (8, 0), lambda d: False)  # the board stopped heartbeating

    assert [(x.blocks, x.device_id, x.synced_version) for x in losses] == [((0, 2), "h-1", 4)]
    assert owners.owners == {}
    assert all(torch.equal(t, before[n]) for n, t in master.state_dict().items())
    owners.close()


def test_a_pull_at_a_version_the_host_does_not_hold_is_a_loss_not_a_wrong_copy(endpoint):
    master = build_model("small_cnn", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR)
    endpoint.state.attach(build_model("small_cnn", seed=0), "job")
    owners = StageOwners("job", master, optimizer, timeout_s=10, security=_gateway())
    owner = Owner("h-1", f"127.0.0.1:{endpoint.port}", (0, 2))
    owners.place({(0, 2): owner}, 0, (-1, 0), 0, lambda d: True)

    losses = owners.sync(5, (4, 0), lambda d: True)  # the host never ran steps 0-4

    assert len(losses) == 1 and "FAILED_PRECONDITION" in losses[0].reason and "version 0" in losses[0].reason


def _load_messages(request, tensors, *, truncate=False):
    metas, payload = pack(tensors)
    yield spb.StateMessage(request=request)
    yield spb.StateMessage(header=serde.header_to_proto(metas))
    chunks = list(iter_chunks(payload, chunk_bytes=64 * 1024))
    for chunk in chunks[:-1] if truncate else chunks:
        yield spb.StateMessage(chunk=serde.chunk_to_proto(chunk))


def test_bad_state_calls_get_precise_codes_and_the_endpoint_keeps_serving(endpoint):
    model = build_model("small_cnn", seed=0)
    endpoint.state.attach(model, "job")
    stub = spb_grpc.StagePeerStub(transport.open_channel(f"127.0.0.1:{endpoint.port}",
                                                         _gateway().dialing(trust.BOARD_SERVER_NAME)))
    prefixes = tuple(f"blocks.{k}." for k in list(model.blocks.keys())[0:2])
    good = {n: t.detach().clone() for n, t in model.state_dict().items() if n.startswith(prefixes)}
    request = spb.StateRequest(job_id="job", first_block=0, end_block=2, version=3, momentum=0.9)
    wrong_shape = dict(good)
    name = next(iter(wrong_shape))
    wrong_shape[name] = torch.zeros(3, 3)

    cases = [
        (iter([spb.StateMessage(header=serde.header_to_proto(pack(good)[0]))]), grpc.StatusCode.INVALID_ARGUMENT,
         "must start with a StateRequest"),
        (_load_messages(request, wrong_shape), grpc.StatusCode.FAILED_PRECONDITION, name),
        (_load_messages(spb.StateRequest(job_id="other", first_block=0, end_block=2), good),
         grpc.StatusCode.FAILED_PRECONDITION, "not 'other'"),
        (_load_messages(spb.StateRequest(job_id="job", first_block=0, end_block=99), good),
         grpc.StatusCode.FAILED_PRECONDITION, "not a range"),
        (_load_messages(request, good, truncate=True), grpc.StatusCode.DATA_LOSS, ""),
    ]
    for messages, code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.LoadState(messages, timeout=10)
        assert info.value.code() == code and words in info.value.details(), info.value.details()
    assert not endpoint.state.holds(0, 2)  # nothing half-loaded

    ack = stub.LoadState(_load_messages(request, good), timeout=10)  # still serving: a good load works
    assert ack.received_bytes > 0 and endpoint.state.holds(0, 2)
    for pull, words in [(spb.StateRequest(job_id="job", first_block=1, end_block=2, version=3), "owns blocks [0, 2)"),
                        (spb.StateRequest(job_id="job", first_block=0, end_block=2, version=4), "version 3")]:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PullState(pull, timeout=10))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and words in info.value.details()
    pulled = list(stub.PullState(spb.StateRequest(job_id="job", first_block=0, end_block=2, version=3), timeout=10))
    assert pulled[0].WhichOneof("kind") == "header" and len(pulled) > 1


def test_nan_gradients_void_the_step_and_a_releasing_pull_gives_the_stage_up(endpoint):
    master = build_model("small_cnn", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR, momentum=0.9)
    host = build_model("small_cnn", seed=0)
    endpoint.state.attach(host, "job")
    owners = StageOwners("job", master, optimizer, timeout_s=10, security=_gateway())
    owner = Owner("h-1", f"127.0.0.1:{endpoint.port}", (0, 2))
    owners.place({(0, 2): owner}, 0, (-1, 0), 0, lambda d: True)
    state = endpoint.state
    before = {n: t.clone() for n, t in host.state_dict().items()}

    # Execute: NaN gradients, then a good step 0, then a new plan without owned stages at version 1
    state.begin(0, 0, 2, -1, 0, attempt=0)
    for p in host.block_modules(0, 2)[0].parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(Exception, match="NaN/Inf"):
        state.finish(0, 0, LR)
    voided = {n: t.clone() for n, t in host.state_dict().items()}
    state.begin(0, 0, 2, -1, 0, attempt=1)  # the voided step is redone from the same version
    _grads_on_host(host, torch.randn(4, 3, 32, 32))
    state.finish(0, 1, LR)
    moved = owners.bytes_moved
    losses, failed = owners.place({}, 1, (0, 1), 0, lambda d: True)

    # Assert: the NaN step changed nothing; the good one was applied, pulled, and the stage released
    assert all(torch.equal(t, before[n]) for n, t in voided.items())
    assert (losses, failed) == ([], {}) and owners.owners == {} and owners.bytes_moved > moved
    assert not state.holds(0, 2)
    for name, p in master.named_parameters():
        if name.startswith(("blocks.conv1.", "blocks.conv2.")):
            assert torch.equal(p, dict(host.named_parameters())[name]) and not torch.equal(p, before[name])
    owners.close()


def test_a_re_plan_right_after_a_sync_moves_no_state_twice(endpoint):
    master = build_model("small_cnn", seed=0)
    optimizer = torch.optim.SGD(master.parameters(), lr=LR)
    endpoint.state.attach(build_model("small_cnn", seed=0), "job")
    owners = StageOwners("job", master, optimizer, timeout_s=10, security=_gateway())
    owners.place({(0, 2): Owner("h-1", f"127.0.0.1:{endpoint.port}", (0, 2))}, 0, (-1, 0), 0, lambda d: True)
    assert owners.sync(0, (-1, 0), lambda d: True) == []
    moved = owners.bytes_moved

    assert owners.place({}, 0, (-1, 0), 0, lambda d: True) == ([], {})

    assert owners.owners == {} and owners.bytes_moved == moved  # the master had version 0 already
    owners.close()
