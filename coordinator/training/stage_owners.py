"""Stages whose host owns their state: handing the state over, and taking it back.

With `pipeline.stage_state: hosts` a stage with a single host (and no DP shards beside the
pipeline) keeps its parameters, buffers and SGD momentum on that host, which applies each
committed step itself (edge_client.stage_state). The coordinator's master copy of those blocks
is then only as new as the last pull. `StageOwners` keeps track of who owns which blocks and
moves the state over each board's StagePeer endpoint — the coordinator is the client here:

- `place`: before an attempt, the plan's owned stages must be held by their planned hosts.
  Owners the plan no longer wants give their state back first (a pull); a host that does not
  hold its stage yet gets it from the master (a load).
- `pull_step` / `apply_step` (`pipeline.replicate`, the default): the master is each owned
  stage's replica. For every attempt the coordinator pulls what the attempt will change on the
  host (`StagePeer.PullStep`: the gradients the host will apply and the buffers after its
  forward passes) while the attempt runs, counts the attempt only once every owner's changes
  arrived, and applies them when the step commits, with the host's arithmetic (the same
  per-tensor SGD on the same parameters, momenta and gradients, the same learning rate). The
  master's copy then equals the host's state after every committed step, bit for bit, so a dead
  host loses nothing and neither `sync` nor a re-plan has anything to pull.
- `sync`: pull every owner's state the master does not have yet into the master (to evaluate,
  checkpoint, or every `sync_every` steps without replication); owners keep their stages.

Without replication an owner that died cannot give its state back: its blocks restart from the
master's copy of the last pull (logged, and reported as the steps lost), so `sync_every: 1`
loses nothing at the cost of moving the owned parameters and momenta every step (twice the
bytes of a replica's gradients).

In a fleet the coordinator dials each StagePeer with the gateway's certificate (`security`), and
the endpoint must prove it holds a board certificate of the fleet; a board's endpoint admits
LoadState, PullState and PullStep from the gateway only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
import torch
from torch import nn

from edgetrain import serde, transport, trust
from edgetrain.pipeline import stage_parameter_prefixes
from edgetrain.streaming import TransferError, check_metas, iter_chunks
from edgetrain.tensors import bundle_metas, check_finite, pack, unpack
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX, MOMENTUM_PREFIX
from edgetrain.work import StateRequest
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc

logger = logging.getLogger(__name__)

GONE_PULL_TIMEOUT_S = 5.0
"""How long a pull from a board the registry considers gone may take."""


@dataclass(frozen=True)
class Owner:
    """A board that holds the state of blocks [first, end)."""

    device_id: str
    address: str
    blocks: tuple[int, int]


@dataclass(frozen=True)
class Loss:
    """Owned blocks whose newest state died with their host."""

    blocks: tuple[int, int]
    device_id: str
    synced_version: int
    """The version the blocks restart from (the last pull)."""
    reason: str


class ReplicaError(Exception):
    """An owner's changes in an attempt did not arrive (the pull was cancelled or ran out of time)."""


class StepPull:
    """One owner's changes in one attempt, pulled in the background (`StageOwners.pull_step`)."""

    def __init__(self, owner: Owner, step: int, attempt: int, deadline: float) -> None:
        self.owner, self.step, self.attempt, self.deadline = owner, step, attempt, deadline
        self.future: futures.Future | None = None
        self.nbytes = 0
        """Payload bytes received."""
        self._lock = threading.Lock()
        self._call = None
        self._cancelled = False

    def open(self, stub: spb_grpc.StagePeerStub, request: spb.StepRequest):
        """The PullStep stream for `request` (ReplicaError once cancelled or past the deadline)."""
        with self._lock:
            remaining = self.deadline - time.monotonic()
            if self._cancelled or remaining <= 0:
                raise ReplicaError("cancelled" if self._cancelled else "no time left")
            self._call = stub.PullStep(request, timeout=remaining)
            return self._call

    def cancel(self) -> None:
        """Give the pull up (the attempt failed elsewhere); the host's wait ends with the call."""
        with self._lock:
            self._cancelled = True
            if self._call is not None:
                self._call.cancel()
        if self.future is not None:
            self.future.cancel()

    def result(self, timeout_s: float) -> dict[str, torch.Tensor]:
        """The changes (gradients "grad.<name>", buffers "buf.<name>"), waiting up to `timeout_s`;
        raises what the pull raised (ReplicaError when it is not done in time)."""
        try:
            return self.future.result(timeout=timeout_s)
        except futures.TimeoutError:
            self.cancel()
            raise ReplicaError(f"not received within {timeout_s:g} s of the attempt's end") from None


REPLICA_ERRORS = (grpc.RpcError, TransferError, transport.Unreachable, ReplicaError, futures.CancelledError)
"""How a replica pull fails."""


class StageOwners:
    """Who owns which blocks of one job's model, and moving state to and from them."""

    def __init__(self, job_id: str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 chunk_bytes: int = 512 * 1024, timeout_s: float = 120.0,
                 count_bytes: Callable[..., None] | None = None,
                 security: transport.Security = transport.INSECURE) -> None:
        """`security`: how to dial the boards' StagePeer endpoints (the gateway's identity in a
        fleet; plaintext for an `--insecure` coordinator)."""
        self.job_id = job_id
        self.model = model
        self.optimizer = optimizer
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.owners: dict[tuple[int, int], Owner] = {}
        self.synced: dict[tuple[int, int], int] = {}
        """Version of the master's copy of each owned range (its last pull or load)."""
        if isinstance(security, transport.MutualTLS):  # whatever it dials by default, a StagePeer is a board
            security = security.dialing(trust.BOARD_SERVER_NAME)
        self._channels = transport.ChannelCache(security)
        self._checksum = not security.secure
        """Whether chunks sent carry crc32s (TLS authenticates every byte already)."""
        self._count_bytes = count_bytes or (lambda device_id, *, down=0, up=0: None)
        """Called with the bytes each load (down) and pull (up) moved over a board's link."""
        self.bytes_moved = 0
        """Bytes of stage state loaded and pulled so far."""
        self.master_changed = False
        """Set when a pull updated the master (the trainer then serves the new parameters)."""
        self.replica_bytes = 0
        """Bytes of owners' step changes pulled so far (replication)."""
        self._count_lock = threading.Lock()
        self._pullers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="replica-pull")

    def close(self) -> None:
        """Stop the replica pulls and close the channels to the hosts."""
        self._pullers.shutdown(wait=False, cancel_futures=True)
        self._channels.close()

    def pull_step(self, owner: Owner, step: int, attempt: int, timeout_s: float) -> StepPull:
        """Start pulling what attempt (step, attempt) changes on `owner`'s stage (it may not have
        begun there yet: the host answers once it has computed it), within `timeout_s`."""
        pull = StepPull(owner, step, attempt, time.monotonic() + timeout_s)
        pull.future = self._pullers.submit(self._pull_step, pull)
        return pull

    @torch.no_grad()
    def apply_step(self, blocks: tuple[int, int], changes: Mapping[str, torch.Tensor], lr: float,
                   step: int) -> None:
        """Step committed: apply an owner's changes in it to the master's copy of `blocks`, as
        the host does (edge_client.stage_state.StageState.settle); the copy is then version
        step + 1. The master optimizer's momentum buffers are the ones stepped."""
        params, buffers = self._stage(blocks)
        group = self.optimizer.param_groups[0]
        sgd = torch.optim.SGD(list(params.values()), lr=lr, momentum=group["momentum"],
                              weight_decay=group["weight_decay"], nesterov=group["nesterov"], foreach=False)
        for name, p in params.items():
            sgd.state[p] = self.optimizer.state[p]  # the same dict: the master's momentum moves
            p.grad = changes[GRAD_PREFIX + name]
        sgd.step()
        for p in params.values():
            p.grad = None
        for name, b in buffers.items():
            b.copy_(changes[BUFFER_PREFIX + name])
        self.synced[blocks] = step + 1

    def place(self, wanted: Mapping[tuple[int, int], Owner], version: int, commit: tuple[int, int], attempt: int,
              is_alive: Callable[[str], bool]) -> tuple[list[Loss], dict[str, str]]:
        """Make `wanted` the owners of their blocks at `version` (see the module docstring).

        Returns the blocks whose state was lost, and the planned hosts the state could not be
        given to (device id -> reason: the attempt cannot run)."""
        losses = []
        for blocks, owner in list(self.owners.items()):
            if wanted.get(blocks) != owner:
                if self.synced.get(blocks) == version:  # the master already has this version (a sync just ran):
                    del self.owners[blocks]              # the board drops the stage with its next other work
                    continue
                loss = self._take_back(owner, version, commit, attempt, is_alive, release=True)
                if loss:
                    losses.append(loss)
                del self.owners[blocks]
        failed = {}
        for blocks, owner in wanted.items():
            if blocks in self.owners:
                continue
            try:
                self._load(owner, version, commit, attempt)
                self.owners[blocks] = owner
                self.synced[blocks] = version
            except (grpc.RpcError, TransferError, transport.Unreachable) as e:
                failed[owner.device_id] = f"could not take over blocks [{blocks[0]}, {blocks[1]}): {transport.describe(e)}"
        return losses, failed

    def sync(self, version: int, commit: tuple[int, int], is_alive: Callable[[str], bool]) -> list[Loss]:
        """Pull every owner's state (at `version`, after `commit`) into the master, unless the
        master has that version already (a replica); owners whose state is gone are dropped
        (their blocks keep the master's copy)."""
        losses = []
        for blocks, owner in list(self.owners.items()):
            if self.synced.get(blocks) == version:
                continue
            loss = self._take_back(owner, version, commit, 0, is_alive, release=False)
            if loss:
                losses.append(loss)
                del self.owners[blocks]
        return losses

    # --- internals -----------------------------------------------------------------------
    def _take_back(self, owner: Owner, version: int, commit: tuple[int, int], attempt: int,
                   is_alive: Callable[[str], bool], release: bool) -> Loss | None:
        """Pull an owner's state into the master; a board the registry gave up on is still asked
        (briefly: a missed heartbeat is not a lost state)."""
        alive = is_alive(owner.device_id)
        try:
            self._pull(owner, version, commit, attempt, release, self.timeout_s if alive else GONE_PULL_TIMEOUT_S)
            self.synced[owner.blocks] = version
            return None
        except (grpc.RpcError, TransferError, transport.Unreachable) as e:
            return self._lost(owner, transport.describe(e) if alive else f"the board is gone ({transport.describe(e)})")

    def _lost(self, owner: Owner, reason: str) -> Loss:
        synced = self.synced.get(owner.blocks, -1)
        logger.error("[Coordinator.Stages] the state of blocks [%d, %d) on %s is lost (%s); they go on from "
                     "the last pull, version %d", owner.blocks[0], owner.blocks[1], owner.device_id, reason, synced)
        return Loss(owner.blocks, owner.device_id, synced, reason)

    def _request(self, owner: Owner, version: int, commit: tuple[int, int], attempt: int,
                 release: bool = False) -> StateRequest:
        group = self.optimizer.param_groups[0]
        return StateRequest(job_id=self.job_id, first_block=owner.blocks[0], end_block=owner.blocks[1],
                            version=version, commit_step=commit[0], commit_attempt=commit[1],
                            supersede_attempt=attempt, momentum=group["momentum"],
                            weight_decay=group["weight_decay"], nesterov=group["nesterov"], release=release)

    def _stage(self, blocks: tuple[int, int]) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
        prefixes = stage_parameter_prefixes(self.model.block_names, *blocks)
        return ({n: p for n, p in self.model.named_parameters() if n.startswith(prefixes)},
                {n: b for n, b in self.model.named_buffers() if n.startswith(prefixes)})

    def _load(self, owner: Owner, version: int, commit: tuple[int, int], attempt: int) -> None:
        params, buffers = self._stage(owner.blocks)
        tensors = {n: p.detach() for n, p in params.items()}
        tensors.update(buffers)
        for name, p in params.items():
            momentum = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if momentum is not None:
                tensors[MOMENTUM_PREFIX + name] = momentum
        metas, payload = pack(tensors)
        request = self._request(owner, version, commit, attempt)

        def messages() -> Iterator[spb.StateMessage]:
            yield spb.StateMessage(request=serde.state_request_to_proto(request))
            yield spb.StateMessage(header=serde.header_to_proto(metas))
            for chunk in iter_chunks(payload, chunk_bytes=self.chunk_bytes, checksum=self._checksum):
                yield spb.StateMessage(chunk=serde.chunk_to_proto(chunk))

        self._stub(owner.address).LoadState(messages(), timeout=self.timeout_s)
        self.bytes_moved += len(payload)
        self._count_bytes(owner.device_id, down=len(payload))
        logger.info("[Coordinator.Stages] %s owns blocks [%d, %d) from version %d (%.1f MB handed over)",
                    owner.device_id, owner.blocks[0], owner.blocks[1], version, len(payload) / 1e6)

    @torch.no_grad()
    def _pull(self, owner: Owner, version: int, commit: tuple[int, int], attempt: int, release: bool,
              timeout_s: float) -> None:
        params, buffers = self._stage(owner.blocks)
        request = self._request(owner, version, commit, attempt, release)
        stub = self._stub(owner.address)

        def open_stream(offset: int):
            return stub.PullState(serde.state_request_to_proto(replace(request, offset=offset)), timeout=timeout_s)

        retry = replace(transport.TRANSFERS, budget_s=min(transport.TRANSFERS.budget_s, timeout_s))
        metas, payload = transport.receive_bundle(open_stream, f"state of blocks {list(owner.blocks)} from "
                                                  f"{owner.device_id}", retry=retry)
        total = len(payload)
        templates = {}
        for m in metas:  # every tensor must be one of the stage's, with its dtype and shape
            base = m.name[len(MOMENTUM_PREFIX):] if m.name.startswith(MOMENTUM_PREFIX) else None
            target = params.get(base) if base is not None else params.get(m.name, buffers.get(m.name))
            if target is None:
                raise TransferError("invalid_argument", f"state of blocks {list(owner.blocks)}: unexpected "
                                    f"tensor {m.name!r}")
            templates[m.name] = target.detach()
        check_metas(metas, bundle_metas(templates), f"state of blocks {list(owner.blocks)}")
        tensors = unpack(metas, payload)
        missing = sorted((set(params) | set(buffers)) - set(tensors))
        if missing:
            raise TransferError("invalid_argument", f"state of blocks {list(owner.blocks)} lacks {missing[:4]}")
        check_finite(tensors, f"state of blocks {list(owner.blocks)}")
        for name, p in params.items():
            p.copy_(tensors[name])
            momentum = tensors.get(MOMENTUM_PREFIX + name)
            if momentum is not None:
                self.optimizer.state[p]["momentum_buffer"] = momentum.clone()
        for name, b in buffers.items():
            b.copy_(tensors[name])
        self.bytes_moved += total
        self._count_bytes(owner.device_id, up=total)
        self.master_changed = True

    def _pull_step(self, pull: StepPull) -> dict[str, torch.Tensor]:
        owner = pull.owner
        params, buffers = self._stage(owner.blocks)
        templates = {GRAD_PREFIX + n: p.detach() for n, p in params.items()}
        templates.update({BUFFER_PREFIX + n: b for n, b in buffers.items()})
        what = f"step {pull.step} attempt {pull.attempt} of blocks {list(owner.blocks)} from {owner.device_id}"
        stub = self._stub(owner.address)

        def open_stream(offset: int):
            return pull.open(stub, spb.StepRequest(job_id=self.job_id, first_block=owner.blocks[0],
                                                   end_block=owner.blocks[1], step=pull.step,
                                                   attempt=pull.attempt, offset=offset))

        metas, payload = transport.receive_bundle(open_stream, what, retry=transport.TRANSFERS)
        check_metas(metas, bundle_metas(templates), what)
        changes = unpack(metas, payload)
        check_finite(changes, what)
        pull.nbytes = len(payload)
        with self._count_lock:
            self.replica_bytes += len(payload)
        self._count_bytes(owner.device_id, up=len(payload))
        return changes

    def _stub(self, address: str) -> spb_grpc.StagePeerStub:
        return spb_grpc.StagePeerStub(self._channels.get(address))
