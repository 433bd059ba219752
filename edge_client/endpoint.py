"""A board's StagePeer endpoint: what its pipeline neighbours and the coordinator call on it.

Every board serves `StagePeer` next to its client (edgetrain.transport makes the server and the
channels to peers). Neighbouring stage hosts `Send` activations and their gradients; they wait in
the `Mailbox` until the stage runner (edge_client.stage) takes them. The coordinator hands over
and takes back the stage a board owns (`LoadState`, `PullState`, edge_client.stage_state) and
keeps its replica up to date with each attempt's changes (`PullStep`); an interrupted pull
resumes from the byte it reached. Every bad stream gets a precise status and
nothing is half-loaded.

In a fleet (mutual TLS) only members with a certificate of the fleet CA get through the
handshake; `Send` is then for the boards the plan of this board's current work names (its stage's
hosts and its neighbours, each under its own device id: `Admission`), and `LoadState`,
`PullState` and `PullStep` for the gateway alone. On a plaintext endpoint (`--insecure`) nothing is checked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
import torch

from edge_client.stage_state import StageState, StageStateError
from edgetrain import serde, transport, trust
from edgetrain.board_hardware import LinkShaping
from edgetrain.errors import FailureKind, Refusal
from edgetrain.streaming import TransferError, iter_chunks
from edgetrain.tensors import pack, unpack
from edgetrain.work import Assignment
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc

logger = logging.getLogger(__name__)

SEND_RETRY = transport.RetryPolicy(budget_s=None, max_tries=3, initial_s=0.2)
"""A neighbour briefly unreachable is tried three times in all; the stage timeout bounds each try."""
ADMISSION_WAIT_S = 120.0
"""Longest a `Send` for an attempt this board has not been given yet waits for its work (a
neighbour may start sending before this board's poll for the same attempt has returned)."""
STAGE_ACCESS = {"StagePeer/Send": frozenset({trust.BOARD}),
                "StagePeer/LoadState": frozenset({trust.GATEWAY}),
                "StagePeer/PullState": frozenset({trust.GATEWAY}),
                "StagePeer/PullStep": frozenset({trust.GATEWAY})}
"""Who may call what on a StagePeer: stage tensors come from boards, owned state moves only at
the gateway's (the coordinator's) request. Nothing else is served."""


class StageFailure(Exception):
    """The step cannot complete on this board (a neighbour failed or stalled, the attempt was
    superseded, or the owned state does not fit); `kind` says which, for the coordinator."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class MailKey:
    """What a tensor from a peer is: which attempt, pipeline, micro-batch, direction and rows."""

    step: int
    attempt: int
    pipeline: int
    microbatch: int
    backward: bool
    from_stage: int
    row_begin: int
    row_end: int
    from_device: str
    """The sender's registration: a message from an earlier run of the coordinator never matches."""
    exchange: int = 0
    """0 between neighbouring stages; k > 0 the k-th split-layer exchange of a channel group."""


class Mailbox:
    """Tensors from peers, kept until the stage runner takes them (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[MailKey, torch.Tensor] = {}
        self._floor = (-1, -1)
        self._newest = (-1, -1)

    def put(self, key: MailKey, tensor: torch.Tensor) -> None:
        with self._cond:
            if (key.step, key.attempt) < self._floor:
                return  # for an attempt this board has moved past
            self._items[key] = tensor
            self._cond.notify_all()

    def take(self, key: MailKey, timeout_s: float, what: str, check: Callable[[], None] = lambda: None) -> torch.Tensor:
        """The tensor for `key`; StageFailure after `timeout_s` without it, or as soon as the
        coordinator opened a newer attempt (this one is dead), or when `check` raises."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._items:
                if (key.step, key.attempt) < self._newest:
                    raise StageFailure(FailureKind.SUPERSEDED, f"step {key.step} attempt {key.attempt} was "
                                       f"closed by the coordinator while waiting for {what}")
                check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StageFailure(FailureKind.NEIGHBOUR_TIMEOUT,
                                       f"no {what} within the stage timeout ({timeout_s:g} s)")
                self._cond.wait(min(remaining, 0.5))
            return self._items.pop(key)

    def superseded(self, step: int, attempt: int) -> bool:
        """Whether the coordinator has opened an attempt newer than (step, attempt)."""
        with self._cond:
            return (step, attempt) < self._newest

    def redone(self, step: int, attempt: int) -> bool:
        """Whether the coordinator has opened a later attempt of the same step: this one is over
        (its samples are being redone), so its update would be refused."""
        with self._cond:
            return self._newest[0] == step and self._newest[1] > attempt

    def supersede(self, step: int, attempt: int) -> None:
        """The coordinator's newest attempt: waits for older ones end at once."""
        with self._cond:
            if (step, attempt) > self._newest:
                self._newest = (step, attempt)
                self._cond.notify_all()

    def reset(self) -> None:
        """Forget everything (a new registration: the coordinator may have restarted)."""
        with self._cond:
            self._items.clear()
            self._floor = self._newest = (-1, -1)

    def advance(self, step: int, attempt: int) -> None:
        """Forget everything for attempts before (step, attempt) (a future step's tensors stay)."""
        with self._cond:
            self._floor = max(self._floor, (step, attempt))
            for key in [k for k in self._items if (k.step, k.attempt) < self._floor]:
                del self._items[key]




class Admission:
    """The boards that may `Send` to this board: those the plan of its current work names (the
    stage's hosts and its neighbours), device id -> certificate name, for one step attempt."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._attempt = (-1, -1)
        self._senders: dict[str, str] = {}

    def admit(self, work: Assignment) -> None:
        """This board's work from now on: the boards its plan names may send (none for a shard)."""
        hosts = (*work.stage.hosts, *work.stage.prev_hosts, *work.stage.next_hosts) if work.stage else ()
        with self._cond:
            self._attempt = (work.step, work.attempt)
            self._senders = {h.device_id: h.name for h in hosts}
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget the work (a new registration: the coordinator may count its steps afresh)."""
        with self._cond:
            self._attempt, self._senders = (-1, -1), {}
            self._cond.notify_all()

    def refusal(self, step: int, attempt: int, device_id: str, name: str, wait_s: float) -> str | None:
        """Why board `name`, sending as `device_id` for (step, attempt), is not admitted (None: it
        is). For an attempt newer than this board's work, waits up to `wait_s` for that work."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (step, attempt) > self._attempt:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return (f"{name} sent stage tensors for step {step} attempt {attempt}, for which this board "
                            "has been given no work")
                self._cond.wait(min(remaining, 1.0))
            claimed = self._senders.get(device_id)
            if claimed != name:
                return (f"board {name} (sending as device {device_id!r}) is not a neighbour of this board in the "
                        f"plan of step {self._attempt[0]} attempt {self._attempt[1]}")
            return None


class StagePeerServicer(spb_grpc.StagePeerServicer):
    """Receives stage tensors into the mailbox and moves owned state; bad streams get precise
    status codes."""

    def __init__(self, mailbox: Mailbox, shaper: LinkShaping | None = None, state: StageState | None = None,
                 chunk_bytes: int = transport.DEFAULT_CHUNK_BYTES, admission: Admission | None = None) -> None:
        self.mailbox = mailbox
        self.shaper = shaper
        self.state = state or StageState()
        self.chunk_bytes = chunk_bytes
        self.admission = admission or Admission()
        self._pulled: tuple[tuple, list, memoryview] | None = None
        """The last state pulled (request, metas, payload): an interrupted pull resumes from it;
        kept until the next pull or hand-over."""
        self._pulled_lock = threading.Lock()
        self._stepped: tuple[tuple, list, memoryview] | None = None
        """The last attempt's changes pulled (request, metas, payload): an interrupted PullStep
        resumes from it."""
        self._stepped_lock = threading.Lock()

    def LoadState(self, request_iterator: Iterator[spb.StateMessage], context) -> spb.StageAck:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "request":
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a LoadState stream must start with a StateRequest")
        try:
            request = serde.state_request_from_proto(first.request)
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.mailbox.supersede(request.version, request.supersede_attempt)
        try:
            header = next(request_iterator, None)
            if header is None or header.WhichOneof("kind") != "header":
                raise TransferError("invalid_argument", "the StateRequest must be followed by a BundleHeader")
            metas, total = serde.header_from_proto(header.header)
            payload = transport.read_bundle(request_iterator, total, after="bundle header",
                                            on_chunk=self.shaper.after_receive if self.shaper else None)
            self.state.load(request, unpack(metas, payload))
            with self._pulled_lock:
                self._pulled = None
        except TransferError as e:
            transport.abort(context, _status(e), str(e))
        except StageStateError as e:
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e), Refusal.STAGE_STATE_MISMATCH)
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.info("[Client.Stage] now owns blocks [%d, %d) at version %d", request.first_block, request.end_block,
                    request.version)
        return spb.StageAck(received_bytes=total)

    def PullState(self, message: spb.StateRequest, context) -> Iterator[spb.StateMessage]:
        try:
            request = serde.state_request_from_proto(message)
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.mailbox.supersede(request.version, request.supersede_attempt)
        key = replace(request, offset=0, supersede_attempt=0)  # a resumed pull asks for the same state
        with self._pulled_lock:
            if request.offset:
                if self._pulled is None or self._pulled[0] != key:
                    transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"no pull of blocks "
                                    f"[{request.first_block}, {request.end_block}) version {request.version} "
                                    "to resume", Refusal.STAGE_STATE_MISMATCH)
                _, metas, payload = self._pulled
            else:
                try:
                    metas, payload = pack(self.state.export(request))
                except StageStateError as e:
                    transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e),
                                    Refusal.STAGE_STATE_MISMATCH)
                self._pulled = (key, metas, payload)
        yield from self._state_stream(metas, payload, request.offset, "the state", context)

    def PullStep(self, message: spb.StepRequest, context) -> Iterator[spb.StateMessage]:
        key = (message.job_id, message.first_block, message.end_block, message.step, message.attempt)
        what = f"step {message.step} attempt {message.attempt} of blocks [{message.first_block}, {message.end_block})"
        with self._stepped_lock:
            held = self._stepped if self._stepped is not None and self._stepped[0] == key else None
        if held is None and message.offset:
            transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"no pull of {what} to resume",
                            Refusal.STAGE_STATE_MISMATCH)
        if held is None:
            remaining = context.time_remaining()
            deadline = time.monotonic() + (remaining if remaining is not None else ADMISSION_WAIT_S)

            def gone() -> str | None:
                if not context.is_active():
                    return "the caller left"
                if self.mailbox.superseded(message.step, message.attempt):
                    return "the coordinator opened a newer attempt"
                return None

            try:
                metas, payload = pack(self.state.replica(message.job_id, message.first_block, message.end_block,
                                                         message.step, message.attempt, deadline=deadline,
                                                         gone=gone))
            except StageStateError as e:
                transport.abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e), Refusal.STAGE_STATE_MISMATCH)
            held = (key, metas, payload)
            with self._stepped_lock:
                self._stepped = held
        _, metas, payload = held
        yield from self._state_stream(metas, payload, message.offset, what, context)

    def _state_stream(self, metas, payload, offset: int, what: str, context) -> Iterator[spb.StateMessage]:
        """A state bundle from byte `offset` (a resumed pull): its header, then chunks through the
        board's link."""
        if offset > len(payload):
            transport.abort(context, grpc.StatusCode.OUT_OF_RANGE, f"offset {offset} is past the "
                            f"{len(payload)} bytes of {what}")
        yield spb.StateMessage(header=serde.header_to_proto(metas))
        checksum = not transport.authenticated_channel(context)  # TLS checks every byte already
        for chunk in iter_chunks(payload, start=offset, chunk_bytes=self.chunk_bytes, checksum=checksum):
            if self.shaper:
                self.shaper.before_send(len(chunk.data))
            yield spb.StateMessage(chunk=serde.chunk_to_proto(chunk))

    def Send(self, request_iterator: Iterator[spb.StageMessage], context) -> spb.StageAck:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a stage stream must start with a StageHeader")
        h = first.header
        peer = transport.peer_of(context)
        if peer is not None:  # mutual TLS: the sender must be a board the plan names, as itself
            remaining = context.time_remaining()
            wait_s = min(ADMISSION_WAIT_S, remaining - 1.0 if remaining is not None else ADMISSION_WAIT_S)
            refusal = self.admission.refusal(h.step, h.attempt, h.from_device, peer.name, max(wait_s, 0.0))
            if refusal is not None:
                logger.warning("[Client.Stage] refused a Send: %s", refusal)
                transport.abort(context, grpc.StatusCode.PERMISSION_DENIED, refusal, Refusal.NOT_PERMITTED)
        try:
            metas, total = serde.header_from_proto(h.bundle)
            rows = h.row_end - h.row_begin
            if len(metas) != 1 or metas[0].name != "x" or metas[0].dtype != "float32" or (
                    not metas[0].shape or metas[0].shape[0] != rows):
                raise TransferError("invalid_argument", f"stage tensor must be one float32 'x' with {rows} rows, "
                                    f"got {[(m.name, m.dtype, list(m.shape)) for m in metas]}")
            payload = transport.read_bundle(request_iterator, total, after="stage header",
                                            on_chunk=self.shaper.after_receive if self.shaper else None)
        except TransferError as e:
            transport.abort(context, _status(e), str(e))
        except ValueError as e:
            transport.abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.mailbox.put(MailKey(h.step, h.attempt, h.pipeline, h.microbatch, h.backward, h.from_stage, h.row_begin,
                                 h.row_end, h.from_device, h.exchange), unpack(metas, payload)["x"])
        return spb.StageAck(received_bytes=total)


def _status(e: TransferError) -> grpc.StatusCode:
    return {"data_loss": grpc.StatusCode.DATA_LOSS, "out_of_range": grpc.StatusCode.OUT_OF_RANGE}.get(
        e.kind, grpc.StatusCode.INVALID_ARGUMENT)


def stage_security(credentials: transport.Credentials) -> transport.MutualTLS:
    """How a board serves and dials StagePeer endpoints with its fleet `credentials`: client
    certificates required, and the peer proving it holds a board certificate."""
    return transport.MutualTLS(credentials, server_name=trust.BOARD_SERVER_NAME, require_client_auth=True)


class StageEndpoint:
    """This board's StagePeer server and its channels to peers.

    With `credentials` (the board's fleet identity, renewed in place) it serves and dials mutual
    TLS and admits callers by their certificates (see the module docstring); without, plaintext
    (`--insecure`)."""

    def __init__(self, bind: str = "0.0.0.0:0", *, shaper: LinkShaping | None = None,
                 chunk_bytes: int = transport.DEFAULT_CHUNK_BYTES,
                 credentials: transport.Credentials | None = None) -> None:
        self.mailbox = Mailbox()
        self.admission = Admission()
        """Which boards may send to this one (the plan of its current work)."""
        self.state = StageState()
        """The stage this board owns, if any (edge_client.stage_state)."""
        self.shaper = shaper
        self.chunk_bytes = chunk_bytes
        security = stage_security(credentials) if credentials is not None else transport.INSECURE
        servicer = StagePeerServicer(self.mailbox, shaper, self.state, chunk_bytes, self.admission)
        guard = transport.Guard(STAGE_ACCESS, default=frozenset()) if security.secure else None
        try:
            self._server, self.port = transport.create_server(
                bind, [(spb_grpc.add_StagePeerServicer_to_server, servicer)], max_workers=16, security=security,
                guard=guard)
        except OSError as e:
            raise OSError(f"cannot bind the stage endpoint: {e}") from None
        self._channels = transport.ChannelCache(security)
        self._checksum = not security.secure
        """Whether chunks sent carry crc32s (TLS authenticates every byte already)."""
        self._senders = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="stage-send")

    def expect(self, work: Assignment) -> None:
        """This board starts `work`: what peers sent for earlier attempts is dropped, and the boards
        its plan names may send to it."""
        self.mailbox.advance(work.step, work.attempt)
        self.admission.admit(work)

    def reset(self) -> None:
        """Forget the peers' tensors and the work (a new registration); owned state stays."""
        self.mailbox.reset()
        self.admission.reset()

    def close(self) -> None:
        """Stop serving and close the channels."""
        self._senders.shutdown(wait=False, cancel_futures=True)
        self._server.stop(grace=0.5)
        self._channels.close()

    def send(self, address: str, job_id: str, key: MailKey, tensor: torch.Tensor, timeout_s: float) -> futures.Future:
        """Ship `tensor` (what `key` says it is) to the peer at `address` in the background; the
        future fails with StageFailure."""
        return self._senders.submit(self._send, address, job_id, key, tensor.detach().contiguous(), timeout_s)

    def _send(self, address: str, job_id: str, key: MailKey, tensor: torch.Tensor, timeout_s: float) -> None:
        metas, payload = pack({"x": tensor})
        header = spb.StageHeader(job_id=job_id, step=key.step, attempt=key.attempt, pipeline=key.pipeline,
                                 microbatch=key.microbatch, backward=key.backward, from_stage=key.from_stage,
                                 row_begin=key.row_begin, row_end=key.row_end, from_device=key.from_device,
                                 exchange=key.exchange, bundle=serde.header_to_proto(metas))
        stub = spb_grpc.StagePeerStub(self._channels.get(address))

        def send() -> None:
            if self.shaper:
                self.shaper.rpc_delay()
            stub.Send(self._messages(header, payload), timeout=timeout_s)

        try:
            SEND_RETRY.call(send, f"sending to {header_target(header)} at {address}")
        except (grpc.RpcError, transport.Unreachable) as e:
            raise StageFailure(FailureKind.NEIGHBOUR_UNREACHABLE, f"sending {header_target(header)} to "
                               f"{address} failed: {transport.describe(e)}") from e

    def _messages(self, header: spb.StageHeader, payload) -> Iterator[spb.StageMessage]:
        yield spb.StageMessage(header=header)
        for chunk in iter_chunks(payload, chunk_bytes=self.chunk_bytes, checksum=self._checksum):
            if self.shaper:
                self.shaper.before_send(len(chunk.data))
            yield spb.StageMessage(chunk=serde.chunk_to_proto(chunk))


def header_target(header: spb.StageHeader) -> str:
    """What a stage message carries, for messages: "activations of micro-batch 3"."""
    if header.exchange:
        part = "input gradient" if header.backward else "output channels"
        return f"{part} of split layer {header.exchange} of micro-batch {header.microbatch}"
    direction = "gradients" if header.backward else "activations"
    return f"{direction} of micro-batch {header.microbatch}"
