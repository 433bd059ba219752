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

A stage hosted by a channel group (edgetrain.channels) runs every row on every member, each
computing its share of the split layers' output channels and exchanging slices and partial
input gradients with the other members through the same endpoints; its leader alone sends the
stage's outputs and input gradients on, and reports the rows, loss and the gradients of the
layers every member computed alike (the others report zero samples and only their slices).

Every wait on a peer is bounded: a neighbour that died or stalled ends the step with
`StageFailure` naming it, within the stage timeout; so does the coordinator opening a newer
attempt (heard with the heartbeat), so the hosts of a failed attempt are free again at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from concurrent import futures
from dataclasses import dataclass

import torch
from torch import nn

from edge_client.arriving import Download
from edge_client.endpoint import MailKey, StageEndpoint, StageFailure
from edge_client.shard import Update
from edge_client.stage_state import StageStateError
from edgetrain.board_hardware import ComputeThrottle
from edgetrain.channels import ChannelSplit, member_slices, split_parameters
from edgetrain.compression import ErrorFeedback, parse_codec
from edgetrain.data import make_batch
from edgetrain.errors import FailureKind
from edgetrain.pipeline import routes, schedule, stage_parameter_prefixes
from edgetrain.tensors import pack, unpack
from edgetrain.training import (
    BUFFER_PREFIX,
    GRAD_PREFIX,
    DeviceCopies,
    ShardResult,
    chunk_bounds,
    load_state_tensors,
    model_device,
    shard_tensor_names,
)
from edgetrain.updates import UpdateFormats
from edgetrain.work import Assignment, BoardJob, StageHost, StepReport

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
    compute_s: float = 0.0
    """Seconds computing (set by the runner: the step's time less the waits)."""
    download_s: float = 0.0
    """Seconds fetching the stage's parameters (a stage its host does not own)."""


class StageRunner:
    """Runs this board's pipeline stages, keeping track of what the model holds for them.

    An owned stage (StageWork.owned) runs on the state this board holds and uploads no
    gradients with its result (the coordinator's replica, if any, pulls them: StagePeer.PullStep);
    otherwise the stage's parameters are downloaded and their gradients uploaded."""

    def __init__(self, model: nn.Module, dataset, job: BoardJob, endpoint: StageEndpoint, limiter: ComputeThrottle) -> None:
        self.model = model
        self.dataset = dataset
        self.job = job
        self.endpoint = endpoint
        self.limiter = limiter
        self.split = split_parameters(model)
        """The parameters a channel group splits (a member moves only its rows of them)."""
        self.formats = UpdateFormats(shard_tensor_names(model), self.split)
        self._feedback: tuple[tuple, ErrorFeedback] | None = None
        """What a lossy uplink codec did not send of this board's stage gradients, for the stage
        (blocks, channel share, codec) it was kept for: another stage starts from nothing."""
        self._loaded: tuple | None = None
        """(version, first block, end block, channel share) of stage parameters the model holds
        (un-owned stages)."""

    def invalidate(self) -> None:
        """The model's parameters were overwritten (a shard ran on it)."""
        self._loaded = None

    def compute(self, work: Assignment, device_id: str, download: Download) -> Update:
        """Run this board's stage for the step and encode what goes up."""
        st = work.stage
        result = self._run_owned(work, device_id) if st.owned else self._run_downloaded(work, device_id, download)
        started = time.perf_counter()
        prefixes = () if st.owned else stage_parameter_prefixes(self.model.block_names, st.first_block, st.end_block)
        member = st.host(device_id).member
        wire, commit = self.formats(work.codec, prefixes, member).encode(
            {} if st.owned else result.shard.tensors, self._stage_feedback(work, member))
        metas, payload = pack(wire)
        shard = result.shard
        report = StepReport(samples=shard.samples, loss=shard.loss, correct=shard.correct, compute_s=result.compute_s,
                            download_s=result.download_s, encode_s=time.perf_counter() - started, wait_s=result.wait_s,
                            peak_activation_bytes=result.peak_activation_bytes, peer_bytes=result.peer_bytes)
        return Update(metas, payload, report, commit)

    def _stage_feedback(self, work: Assignment, member) -> ErrorFeedback | None:
        """The error feedback of this stage's uploads with a lossy codec (None: nothing to keep)."""
        st = work.stage
        if st.owned or not self.job.error_feedback or not parse_codec(work.codec or "none").lossy:
            return None
        key = (st.first_block, st.end_block, member, work.codec)
        if self._feedback is None or self._feedback[0] != key:
            self._feedback = (key, ErrorFeedback())
        self._feedback[1].begin(work.step)
        return self._feedback[1]

    def _run_owned(self, work: Assignment, device_id: str) -> StageResult:
        st, state = work.stage, self.endpoint.state
        started = time.perf_counter()
        with state.lock:
            try:
                state.begin(work.step, st.first_block, st.end_block, st.commit_step, st.commit_attempt,
                            attempt=work.attempt)
            except StageStateError as e:
                raise StageFailure(FailureKind.STAGE_STATE, str(e)) from None
            self._loaded = None
            try:
                result = run_stage(self.model, work, self.dataset, self.endpoint, device_id, self.job.job_id,
                                   self.limiter, self.job.max_forward_batch)
            except BaseException:
                state.abandon()
                raise
            try:
                state.finish(work.step, work.attempt, st.lr)
            except StageStateError as e:
                raise StageFailure(FailureKind.STAGE_STATE, str(e)) from None
        result.compute_s = time.perf_counter() - started - result.wait_s
        return result

    def _run_downloaded(self, work: Assignment, device_id: str, download: Download) -> StageResult:
        st = work.stage
        started = time.perf_counter()
        self.endpoint.state.drop()
        share = st.host(device_id).channels
        loaded = (work.param_version, st.first_block, st.end_block, share)
        if self._loaded != loaded:
            prefixes = stage_parameter_prefixes(self.model.block_names, st.first_block, st.end_block)
            tensors = unpack(*download(work.param_version, prefixes=list(prefixes), channels=share))
            if share is not None:  # a channel group member: its rows of the split layers
                params = dict(self.model.named_parameters())
                with torch.no_grad():
                    for name, (begin, end) in member_slices(self.split, share).items():
                        if name in tensors:
                            params[name][begin:end].copy_(tensors.pop(name))
            load_state_tensors(self.model, tensors)
            self._loaded = loaded
        download_s = time.perf_counter() - started
        started = time.perf_counter()
        result = run_stage(self.model, work, self.dataset, self.endpoint, device_id, self.job.job_id, self.limiter,
                           self.job.max_forward_batch)
        result.compute_s, result.download_s = time.perf_counter() - started - result.wait_s, download_s
        if any(b.is_floating_point() for b in self.model.buffers()):  # the forward passes moved BN statistics
            self._loaded = None
        return result


def _rows(host: StageHost, m: int) -> tuple[int, int]:
    return host.rows[m]


def run_stage(model: nn.Module, work: Assignment, dataset, endpoint: StageEndpoint, device_id: str,
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
    except torch.cuda.OutOfMemoryError as e:  # the GPU's memory: the board stays, the planner re-plans
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()
        st = work.stage
        raise StageFailure(FailureKind.OUT_OF_MEMORY, f"blocks [{st.first_block}, {st.end_block}) do not fit the "
                           f"memory of {model_device(model)}: {str(e).splitlines()[0][:300]}") from None
    except Exception as e:  # a peer's tensor that does not fit, or a bug: the board must survive it
        logger.exception("[Client.Stage] step %d failed", work.step)
        raise StageFailure(FailureKind.INTERNAL, f"{type(e).__name__}: {e}") from e


def _run_stage(model: nn.Module, work: Assignment, dataset, endpoint: StageEndpoint, device_id: str,
               job_id: str, limiter, max_forward_batch: int) -> StageResult:
    st = work.stage
    s, stages, m_count = st.stage, st.stages, len(st.microbatch_sizes)
    first, last = s == 0, s == stages - 1
    me = next(i for i, h in enumerate(st.hosts) if h.device_id == device_id)
    mine = st.hosts[me]
    group = st.hosts
    starts = [sum(st.microbatch_sizes[:m]) for m in range(m_count)]
    working = limiter.working if limiter is not None else contextlib.nullcontext
    copies = DeviceCopies(model_device(model))
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
        local_x, local_y = copies.to_device(local_x), copies.to_device(local_y)
        at = 0
        for m, b, e in rows:
            offsets[m] = (at, at + e - b)
            at += e - b

    def key(m: int, backward: bool, begin: int, end: int) -> MailKey:
        return MailKey(work.step, work.attempt, st.pipeline, m, backward, s, begin, end, device_id)

    sends: list[futures.Future] = []
    shipped = [0]

    def check_sends() -> None:
        for future in sends:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def routes_between(senders, receivers, m: int):
        return routes([_rows(h, m) for h in senders], _channel_group(senders),
                      [_rows(h, m) for h in receivers], _channel_group(receivers))

    def receive(m: int, backward: bool, peers) -> torch.Tensor:
        pieces = []
        for sender, receiver, begin, end in routes_between(peers, group, m):
            if receiver != me:
                continue
            peer = peers[sender]
            key = MailKey(work.step, work.attempt, st.pipeline, m, backward, s + (1 if backward else -1), begin, end,
                       peer.device_id)
            what = (f"{'gradients' if backward else 'activations'} of micro-batch {m} rows {begin}-{end} from "
                    f"stage {key.from_stage} host {peer.device_id}")
            pieces.append((begin, endpoint.mailbox.take(key, st.timeout_s, what, check_sends)))
        pieces.sort(key=lambda piece: piece[0])
        return copies.to_device(torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1])

    def ship(m: int, backward: bool, tensor: torch.Tensor, peers) -> None:
        my_begin, _ = _rows(mine, m)
        tensor = copies.to_host(tensor)
        for sender, receiver, begin, end in routes_between(group, peers, m):
            if sender != me:
                continue
            peer = peers[receiver]
            shipped[0] += (end - begin) * tensor[0].numel() * tensor.element_size()
            sends.append(endpoint.send(peer.address, job_id, key(m, backward, begin, end),
                                       tensor[begin - my_begin:end - my_begin], st.timeout_s))

    split = None
    if mine.channels is not None:
        exchange = _GroupExchange(endpoint, work, job_id, device_id, me, sends, shipped, check_sends, copies)
        split = ChannelSplit(blocks, [h.channels for h in group], mine.channels, exchange)

    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    held = peak = 0
    wait_s = 0.0
    loss_sum, correct, rows_done = 0.0, 0, 0
    try:
        with split if split is not None else contextlib.nullcontext():
            for op in schedule(st.schedule, stages, m_count, s):
                m = op.microbatch
                b, e = _rows(mine, m)
                if e == b:
                    continue  # this host has no rows of this micro-batch
                if split is not None:
                    split.microbatch = m
                if op.kind == "F" and first and last:  # the whole model here: forward and backward now, in chunks
                    bounds = chunk_bounds(*offsets[m], max_forward_batch)
                    with working():
                        for c_lo, c_hi in zip(bounds, bounds[1:]):
                            out = _forward(blocks, local_x[c_lo:c_hi], split, _seed(work, m, c_lo), copies.device)
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
                        out = _forward(blocks, inp, split, _seed(work, m, 0), copies.device)
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
    if split is not None:
        wait_s += exchange.wait_s
        if not split.leader:  # what every member computed alike counts once: the leader reports it
            for p in split.replicated_parameters(blocks):
                p.grad = None
            loss_sum, correct, rows = 0.0, 0, []
    prefixes = stage_parameter_prefixes(model.block_names, st.first_block, st.end_block)
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            tensors[GRAD_PREFIX + name] = copies.to_host(p.grad.detach() if p.grad is not None else torch.zeros_like(p))
    for name, buf in model.named_buffers():
        if name.startswith(prefixes) and buf.is_floating_point():
            tensors[BUFFER_PREFIX + name] = copies.to_host(buf.detach())
    samples = sum(e - b for _, b, e in rows)
    shard = ShardResult(loss=loss_sum / rows_done if rows_done else 0.0, correct=correct, samples=samples,
                        tensors=tensors)
    return StageResult(shard, wait_s, peak, shipped[0])


def _channel_group(hosts) -> bool:
    return bool(hosts) and hosts[0].channels is not None


class _GroupExchange:
    """A channel group's exchanges (edgetrain.channels.Exchange) through the members' StagePeer
    endpoints: each message goes to every other member, keyed by the split-layer call it belongs to."""

    def __init__(self, endpoint: StageEndpoint, work: Assignment, job_id: str, device_id: str, me: int,
                 sends: list, shipped: list, check_sends, copies: DeviceCopies) -> None:
        self.endpoint, self.work, self.job_id, self.device_id, self.me = endpoint, work, job_id, device_id, me
        self.copies = copies
        self.group = work.stage.hosts
        self.sends, self.shipped, self.check_sends = sends, shipped, check_sends
        self.wait_s = 0.0
        """Seconds spent waiting for the other members' tensors."""

    def _key(self, m: int, tag: int, backward: bool, rows: int, device_id: str) -> MailKey:
        st = self.work.stage
        return MailKey(self.work.step, self.work.attempt, st.pipeline, m, backward, st.stage, 0, rows, device_id, tag)

    def _send(self, m: int, tag: int, backward: bool, tensor: torch.Tensor, to: list[int]) -> None:
        key = self._key(m, tag, backward, tensor.shape[0], self.device_id)
        tensor = self.copies.to_host(tensor)
        for j in to:
            self.shipped[0] += tensor.numel() * tensor.element_size()
            self.sends.append(self.endpoint.send(self.group[j].address, self.job_id, key, tensor,
                                                 self.work.stage.timeout_s))

    def _take(self, m: int, tag: int, backward: bool, rows: int, j: int) -> torch.Tensor:
        started = time.perf_counter()
        host = self.group[j]
        what = (f"{'input gradient' if backward else 'output channels'} of split layer {tag} of micro-batch {m} "
                f"from channel group member {host.name or host.device_id}")
        try:
            return self.copies.to_device(self.endpoint.mailbox.take(self._key(m, tag, backward, rows, host.device_id),
                                                                    self.work.stage.timeout_s, what, self.check_sends))
        finally:
            self.wait_s += time.perf_counter() - started

    def gather(self, microbatch: int, tag: int, local: torch.Tensor, bounds, dim: int) -> torch.Tensor:
        if bounds[self.me][1] > bounds[self.me][0]:
            self._send(microbatch, tag, False, local, [j for j in range(len(self.group)) if j != self.me])
        parts = []
        for j, (lo, hi) in enumerate(bounds):
            if hi <= lo:
                continue
            part = local if j == self.me else self._take(microbatch, tag, False, local.shape[0], j)
            want = list(local.shape)
            want[dim] = hi - lo
            if list(part.shape) != want:
                raise ValueError(f"output channels of split layer {tag} from channel group member "
                                 f"{self.group[j].name or self.group[j].device_id}: shape {list(part.shape)}, "
                                 f"expected {want}")
            parts.append(part)
        return torch.cat(parts, dim=dim)

    def all_reduce(self, microbatch: int, tag: int, partial: torch.Tensor) -> torch.Tensor:
        self._send(microbatch, tag, True, partial, [j for j in range(len(self.group)) if j != self.me])
        parts = [partial if j == self.me else self._take(microbatch, tag, True, partial.shape[0], j)
                 for j in range(len(self.group))]
        for j, part in enumerate(parts):
            if part.shape != partial.shape:
                raise ValueError(f"input gradient of split layer {tag} from channel group member "
                                 f"{self.group[j].name or self.group[j].device_id}: shape {list(part.shape)}, "
                                 f"expected {list(partial.shape)}")
        total = parts[0].clone()  # the same order on every member: the same sum, bit for bit
        for part in parts[1:]:
            total += part
        return total


def _forward(blocks, x: torch.Tensor, split: ChannelSplit | None = None, seed: int = 0,
             device: torch.device | None = None) -> torch.Tensor:
    """The blocks' forward; in a channel group with the same random numbers on every member (the
    replicated layers' dropout must agree, on whichever device each runs)."""
    if split is None:
        for block in blocks:
            x = block(x)
        return x
    with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
        torch.manual_seed(seed)
        for block in blocks:
            x = block(x)
    return x


def _seed(work: Assignment, microbatch: int, row: int) -> int:
    """The random seed of a channel group's forward pass: the same on every member, different for
    every step, attempt, pipeline, stage, micro-batch and chunk."""
    st = work.stage
    key = (work.data_seed, work.step, work.attempt, st.pipeline, st.stage, microbatch, row)
    return zlib.crc32(repr(key).encode()) | (work.data_seed % 2**31) << 32
