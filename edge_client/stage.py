"""A board's part of a pipeline: running its stage for one step.

When a board hosts a stage, activations of each
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
import time
from concurrent import futures
from dataclasses import dataclass

import torch
from torch import nn

from edge_client.endpoint import MailKey, StageEndpoint, StageFailure
from edgetrain.data import make_batch
from edgetrain.errors import FailureKind
from edgetrain.pipeline import overlaps, schedule, stage_parameter_prefixes
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX, ShardResult, chunk_bounds
from protos import coordinator_pb2 as pb
from protos import stage_pb2 as spb

logger = logging.getLogger(__name__)


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
        raise StageFailure(FailureKind.INTERNAL, f"{type(e).__name__}: {e}") from e


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
            key = MailKey(work.step, work.attempt, st.pipeline, m, backward, s + (1 if backward else -1), begin, end,
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
                        raise StageFailure(FailureKind.SUPERSEDED, f"step {work.step} attempt {work.attempt} was closed by the "
                                           "coordinator while sending to a neighbouring stage") from None
                    if time.perf_counter() > deadline:
                        raise StageFailure(FailureKind.NEIGHBOUR_TIMEOUT, f"sending to a neighbouring stage did not finish within "
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
