"""A board's part of a pipeline: its peer endpoint, and running its stage for one step.

Every board serves `StagePeer` next to its client. When it hosts a stage, activations of each
micro-batch arrive from the previous stage's hosts and leave for the next stage's hosts, and the
gradients of those activations travel back the same way — directly board to board, chunked and
checksummed like every other tensor stream; the coordinator only hands out the plan (which
blocks, which rows of each micro-batch, the neighbours' addresses) and collects each host's
stage gradients at the end of the step.

A stage hosted by a group of boards splits every micro-batch by rows; a sender ships each
receiver exactly the rows they share (`edgetrain.pipeline.overlaps`), so groups of any size sit
next to each other. The loss of a micro-batch is its summed cross-entropy divided by the
pipeline's samples, so the gradients of all hosts and micro-batches add up to the gradient of
the mean loss — the coordinator sums a pipeline's partial gradients and obtains exactly what
single-device training computes.

Every wait on a peer is bounded: a neighbour that died or stalled ends the step with
`StageFailure` naming it, within the stage timeout; so does the coordinator opening a newer
attempt (heard with the heartbeat), so the hosts of a failed attempt are free again at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from torch import nn

from edge_client.stage_state import StageState, StageStateError
from edgetrain import serde
from edgetrain.data import make_batch
from edgetrain.emulator.shaping import LinkShaper
from edgetrain.pipeline import overlaps, schedule, stage_parameter_prefixes
from edgetrain.tensors import TransferError, iter_chunks, pack
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX, ShardResult, chunk_bounds
from edgetrain.transport import CHANNEL_OPTIONS, SERVER_OPTIONS
from protos import coordinator_pb2 as pb
from protos import stage_pb2 as spb
from protos import stage_pb2_grpc as spb_grpc

logger = logging.getLogger(__name__)

SEND_ATTEMPTS = 3


class StageFailure(Exception):
    """The step cannot complete on this board (a neighbour failed or stalled)."""


@dataclass(frozen=True)
class _Key:
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


class Mailbox:
    """Tensors from peers, kept until the stage runner takes them (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[_Key, torch.Tensor] = {}
        self._floor = (-1, -1)
        self._newest = (-1, -1)

    def put(self, key: _Key, tensor: torch.Tensor) -> None:
        with self._cond:
            if (key.step, key.attempt) < self._floor:
                return  # for an attempt this board has moved past
            self._items[key] = tensor
            self._cond.notify_all()

    def take(self, key: _Key, timeout_s: float, what: str, check: Callable[[], None] = lambda: None) -> torch.Tensor:
        """The tensor for `key`; StageFailure after `timeout_s` without it, or as soon as the
        coordinator opened a newer attempt (this one is dead), or when `check` raises."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._items:
                if (key.step, key.attempt) < self._newest:
                    raise StageFailure(f"step {key.step} attempt {key.attempt} was closed by the coordinator "
                                       f"while waiting for {what}")
                check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StageFailure(f"no {what} within the stage timeout ({timeout_s:g} s)")
                self._cond.wait(min(remaining, 0.5))
            return self._items.pop(key)

    def superseded(self, step: int, attempt: int) -> bool:
        """Whether the coordinator has opened an attempt newer than (step, attempt)."""
        with self._cond:
            return (step, attempt) < self._newest

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


class StagePeerServicer(spb_grpc.StagePeerServicer):
    """Receives stage tensors into the mailbox; bad streams get precise status codes."""

    def __init__(self, mailbox: Mailbox, shaper: LinkShaper | None = None, state: StageState | None = None) -> None:
        self.mailbox = mailbox
        self.shaper = shaper
        self.state = state or StageState()

    def LoadState(self, request_iterator: Iterator[spb.StateMessage], context) -> spb.StageAck:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "request":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a LoadState stream must start with a StateRequest")
        request = first.request
        self.mailbox.supersede(request.version, request.supersede_attempt)
        try:
            bundle = next(request_iterator, None)
            if bundle is None or bundle.WhichOneof("kind") != "bundle":
                raise TransferError("invalid_argument", "the StateRequest must be followed by a BundleHeader")
            metas, total = serde.header_from_proto(bundle.bundle)
            tensors = serde.read_bundle(request_iterator, metas, total, after="bundle header",
                                        on_chunk=self.shaper.after_receive if self.shaper else None)
            self.state.load(request, tensors)
        except TransferError as e:
            context.abort(_status(e), str(e))
        except StageStateError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.info("[Client.Stage] now owns blocks [%d, %d) at version %d", request.first_block, request.end_block,
                    request.version)
        return spb.StageAck(received_bytes=total)

    def PullState(self, request: spb.StateRequest, context) -> Iterator[spb.StateMessage]:
        self.mailbox.supersede(request.version, request.supersede_attempt)
        try:
            tensors = self.state.export(request)
        except StageStateError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        metas, payload = pack(tensors)
        yield spb.StateMessage(bundle=serde.header_to_proto(metas))
        for chunk in iter_chunks(payload, chunk_bytes=512 * 1024):
            if self.shaper:
                self.shaper.before_send(len(chunk.data))
            yield spb.StateMessage(chunk=serde.chunk_to_proto(chunk))

    def Send(self, request_iterator: Iterator[spb.StageMessage], context) -> spb.StageAck:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a stage stream must start with a StageHeader")
        h = first.header
        try:
            metas, total = serde.header_from_proto(h.bundle)
            rows = h.row_end - h.row_begin
            if len(metas) != 1 or metas[0].name != "x" or metas[0].dtype != "float32" or (
                    not metas[0].shape or metas[0].shape[0] != rows):
                raise TransferError("invalid_argument", f"stage tensor must be one float32 'x' with {rows} rows, "
                                    f"got {[(m.name, m.dtype, list(m.shape)) for m in metas]}")
            tensor = serde.read_bundle(request_iterator, metas, total, after="stage header",
                                       on_chunk=self.shaper.after_receive if self.shaper else None)["x"]
        except TransferError as e:
            context.abort(_status(e), str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.mailbox.put(_Key(h.step, h.attempt, h.pipeline, h.microbatch, h.backward, h.from_stage, h.row_begin,
                              h.row_end, h.from_device), tensor)
        return spb.StageAck(received_bytes=total)


def _status(e: TransferError) -> grpc.StatusCode:
    return {"data_loss": grpc.StatusCode.DATA_LOSS, "out_of_range": grpc.StatusCode.OUT_OF_RANGE}.get(
        e.kind, grpc.StatusCode.INVALID_ARGUMENT)


class StageEndpoint:
    """This board's StagePeer server and its channels to peers."""

    def __init__(self, bind: str = "0.0.0.0:0", *, shaper: LinkShaper | None = None,
                 chunk_bytes: int = 512 * 1024) -> None:
        self.mailbox = Mailbox()
        self.state = StageState()
        """The stage this board owns, if any (edge_client.stage_state)."""
        self.shaper = shaper
        self.chunk_bytes = chunk_bytes
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=SERVER_OPTIONS)
        spb_grpc.add_StagePeerServicer_to_server(StagePeerServicer(self.mailbox, shaper, self.state), self._server)
        self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"cannot bind the stage endpoint to {bind}")
        self._server.start()
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._senders = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="stage-send")

    def close(self) -> None:
        """Stop serving and close the channels."""
        self._senders.shutdown(wait=False, cancel_futures=True)
        self._server.stop(grace=0.5)
        with self._lock:
            for channel in self._channels.values():
                channel.close()

    def send(self, address: str, header: spb.StageHeader, tensor: torch.Tensor, timeout_s: float) -> futures.Future:
        """Ship `tensor` to the peer at `address` in the background; the future fails with StageFailure."""
        return self._senders.submit(self._send, address, header, tensor.detach().contiguous(), timeout_s)

    def _send(self, address: str, header: spb.StageHeader, tensor: torch.Tensor, timeout_s: float) -> None:
        metas, payload = pack({"x": tensor})
        header.bundle.CopyFrom(serde.header_to_proto(metas))
        stub = spb_grpc.StagePeerStub(self._channel(address))
        for attempt in range(SEND_ATTEMPTS):
            try:
                if self.shaper:
                    self.shaper.rpc_delay()
                stub.Send(self._messages(header, payload), timeout=timeout_s)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == SEND_ATTEMPTS - 1:
                    raise StageFailure(f"sending to {header_target(header)} at {address} failed: "
                                       f"{e.code().name} {e.details()}") from e
                time.sleep(0.2 * 2**attempt)

    def _messages(self, header: spb.StageHeader, payload) -> Iterator[spb.StageMessage]:
        yield spb.StageMessage(header=header)
        for chunk in iter_chunks(payload, chunk_bytes=self.chunk_bytes):
            if self.shaper:
                self.shaper.before_send(len(chunk.data))
            yield spb.StageMessage(chunk=serde.chunk_to_proto(chunk))

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            return self._channels[address]


def header_target(header: spb.StageHeader) -> str:
    direction = "gradients" if header.backward else "activations"
    return f"{direction} of micro-batch {header.microbatch}"


@dataclass
class StageResult:
    """What a stage host computed in one step."""

    shard: ShardResult
    wait_s: float
    """Seconds spent waiting for peers (pipeline bubble plus transfer time)."""
    peak_activation_bytes: int
    """Most bytes of activations held for backward at any time."""
    peer_bytes: int = 0
    """Bytes of activations and gradients sent to neighbouring stages."""


def _rows(host: pb.StageHost, m: int) -> tuple[int, int]:
    return host.row_begin[m], host.row_end[m]


def run_stage(model: nn.Module, work: pb.StepWork, dataset, endpoint: StageEndpoint, device_id: str,
              job_id: str, limiter=None, max_forward_batch: int = 0) -> StageResult:
    """Run this board's stage of one pipeline step (see the module docstring).

    A stage that is the whole pipeline (first and last: a board hosting the whole model) runs each
    micro-batch's forward and backward at once, in chunks of at most `max_forward_batch` samples
    (as a DP shard is computed; 0: whole micro-batches).

    Any error (a neighbour failing, a malformed tensor from a peer) becomes StageFailure, so the
    board reports it and stays available.
    """
    try:
        return _run_stage(model, work, dataset, endpoint, device_id, job_id, limiter, max_forward_batch)
    except StageFailure:
        raise
    except Exception as e:  # a peer's tensor that does not fit, or a bug: the board must survive it
        logger.exception("[Client.Stage] step %d failed", work.step)
        raise StageFailure(f"{type(e).__name__}: {e}") from e


def _run_stage(model: nn.Module, work: pb.StepWork, dataset, endpoint: StageEndpoint, device_id: str,
               job_id: str, limiter, max_forward_batch: int) -> StageResult:
    st = work.stage
    s, stages, m_count = st.stage, st.stages, len(st.microbatch_sizes)
    first, last = s == 0, s == stages - 1
    me = next(i for i, h in enumerate(st.hosts) if h.device_id == device_id)
    mine = st.hosts[me]
    group = st.hosts
    starts = [sum(st.microbatch_sizes[:m]) for m in range(m_count)]
    working = limiter.working if limiter is not None else contextlib.nullcontext
    blocks = model.block_modules(st.first_block, st.end_block)
    for block in blocks:
        for p in block.parameters():
            p.grad = None
    model.train()

    local_x, local_y, offsets = None, None, {}
    rows = [(m, *_rows(mine, m)) for m in range(m_count)]
    if (first or last) and any(e > b for _, b, e in rows):  # inputs and labels from the board's own data
        idx = [int(st.indices[starts[m] + r]) for m, b, e in rows for r in range(b, e)]
        local_x, local_y = make_batch(dataset, idx, augment=work.augment, seed=work.data_seed, step=work.step)
        at = 0
        for m, b, e in rows:
            offsets[m] = (at, at + e - b)
            at += e - b

    def header(m: int, backward: bool, begin: int, end: int) -> spb.StageHeader:
        return spb.StageHeader(job_id=job_id, step=work.step, attempt=work.attempt, pipeline=st.pipeline,
                               microbatch=m, backward=backward, from_stage=s, row_begin=begin, row_end=end,
                               from_device=device_id)

    sends: list[futures.Future] = []
    shipped = [0]

    def check_sends() -> None:
        for future in sends:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def receive(m: int, backward: bool, peers) -> torch.Tensor:
        pieces = []
        for sender, receiver, begin, end in overlaps([_rows(h, m) for h in peers], [_rows(h, m) for h in group]):
            if receiver != me:
                continue
            peer = peers[sender]
            key = _Key(work.step, work.attempt, st.pipeline, m, backward, s + (1 if backward else -1), begin, end,
                       peer.device_id)
            what = (f"{'gradients' if backward else 'activations'} of micro-batch {m} rows {begin}-{end} from "
                    f"stage {key.from_stage} host {peer.device_id}")
            pieces.append((begin, endpoint.mailbox.take(key, st.timeout_s, what, check_sends)))
        pieces.sort(key=lambda piece: piece[0])
        return torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1]

    def ship(m: int, backward: bool, tensor: torch.Tensor, peers) -> None:
        my_begin, _ = _rows(mine, m)
        for sender, receiver, begin, end in overlaps([_rows(h, m) for h in group], [_rows(h, m) for h in peers]):
            if sender != me:
                continue
            peer = peers[receiver]
            shipped[0] += (end - begin) * tensor[0].numel() * tensor.element_size()
            sends.append(endpoint.send(peer.address, header(m, backward, begin, end),
                                       tensor[begin - my_begin:end - my_begin], st.timeout_s))

    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    held = peak = 0
    wait_s = 0.0
    loss_sum, correct, rows_done = 0.0, 0, 0
    try:
        for op in schedule(st.schedule, stages, m_count, s):
            m = op.microbatch
            b, e = _rows(mine, m)
            if e == b:
                continue  # this host has no rows of this micro-batch
            if op.kind == "F" and first and last:  # the whole model here: forward and backward now, in chunks
                bounds = chunk_bounds(*offsets[m], max_forward_batch)
                with working():
                    for c_lo, c_hi in zip(bounds, bounds[1:]):
                        out = _forward(blocks, local_x[c_lo:c_hi])
                        y = local_y[c_lo:c_hi]
                        loss = nn.functional.cross_entropy(out, y, reduction="sum") / st.pipeline_samples
                        loss.backward()
                        loss_sum += float(loss.detach()) * st.pipeline_samples
                        correct += int((out.detach().argmax(dim=1) == y).sum())
                        peak = max(peak, out.numel() * out.element_size())
                rows_done += e - b
                saved[m] = None
            elif op.kind == "F":
                if first:
                    lo, hi = offsets[m]
                    inp = local_x[lo:hi]
                else:
                    started = time.perf_counter()
                    inp = receive(m, False, st.prev_hosts).requires_grad_()
                    wait_s += time.perf_counter() - started
                with working():
                    out = _forward(blocks, inp)
                    if last:
                        lo, hi = offsets[m]
                        y = local_y[lo:hi]
                        loss = nn.functional.cross_entropy(out, y, reduction="sum") / st.pipeline_samples
                        loss_sum += float(loss.detach()) * st.pipeline_samples
                        correct += int((out.detach().argmax(dim=1) == y).sum())
                        rows_done += e - b
                        saved[m] = (None if first else inp, loss)
                    else:
                        saved[m] = (None if first else inp, out)
                if not last:
                    ship(m, False, out.detach(), st.next_hosts)
                held += sum(t.numel() * t.element_size() for t in saved[m] if t is not None and t.dim())
                peak = max(peak, held)
            elif saved[m] is None:  # done with its forward
                del saved[m]
            else:
                inp, out = saved.pop(m)
                grad = None
                if not last:
                    started = time.perf_counter()
                    grad = receive(m, True, st.next_hosts)
                    wait_s += time.perf_counter() - started
                with working():
                    out.backward(grad)
                if not first:
                    ship(m, True, inp.grad, st.prev_hosts)
                held -= sum(t.numel() * t.element_size() for t in (inp, out) if t is not None and t.dim())
        started = time.perf_counter()
        deadline = started + st.timeout_s
        for future in sends:  # drain the sends, giving up at the timeout or when the attempt is closed
            while True:
                try:
                    future.result(timeout=0.5)
                    break
                except futures.TimeoutError:
                    if endpoint.mailbox.superseded(work.step, work.attempt):
                        raise StageFailure(f"step {work.step} attempt {work.attempt} was closed by the "
                                           "coordinator while sending to a neighbouring stage") from None
                    if time.perf_counter() > deadline:
                        raise StageFailure(f"sending to a neighbouring stage did not finish within "
                                           f"{st.timeout_s:g} s") from None
        wait_s += time.perf_counter() - started
    except BaseException:
        for future in sends:
            future.cancel()
        raise
    prefixes = stage_parameter_prefixes(model.block_names, st.first_block, st.end_block)
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            tensors[GRAD_PREFIX + name] = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
    for name, buf in model.named_buffers():
        if name.startswith(prefixes) and buf.is_floating_point():
            tensors[BUFFER_PREFIX + name] = buf.detach()
    samples = sum(e - b for _, b, e in rows)
    shard = ShardResult(loss=loss_sum / rows_done if rows_done else 0.0, correct=correct, samples=samples,
                        tensors=tensors)
    return StageResult(shard, wait_s, peak, shipped[0])


def _forward(blocks, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x
