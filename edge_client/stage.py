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
from dataclasses import dataclass

import torch
from torch import nn

from edge_client.arriving import Download
from edge_client.endpoint import MailKey, StageEndpoint, StageFailure
from edge_client.shard import Update
from edge_client.stage_exchange import GroupExchange, Outbox
from edge_client.stage_state import StageStateError
from edgetrain.board_hardware import ComputeThrottle
from edgetrain.channels import ChannelSplit, member_slices, split_parameters
from edgetrain.compression import ErrorFeedback, parse_codec
from edgetrain.data import make_batch
from edgetrain.errors import FailureKind
from edgetrain.pipeline import FORWARD, Op, routes, schedule, stage_parameter_prefixes
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
        return StageExecutor(model, work, dataset, endpoint, device_id, job_id, limiter, max_forward_batch).run()
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


class StageExecutor:
    """This board's stage in one pipeline step, run op by op as the schedule orders them
    (edgetrain.pipeline.schedule): each forward and backward of a micro-batch is a method, and
    the exchanges with neighbouring stages (and a channel group's members) go through the
    endpoint. Use once: `run` returns what the stage computed."""

    def __init__(self, model: nn.Module, work: Assignment, dataset, endpoint: StageEndpoint, device_id: str,
                 job_id: str, limiter=None, max_forward_batch: int = 0) -> None:
        st = work.stage
        self.model, self.work, self.stage, self.dataset, self.endpoint = model, work, st, dataset, endpoint
        self.device_id = device_id
        self.max_forward_batch = max_forward_batch
        self.first, self.last = st.stage == 0, st.stage == st.stages - 1
        self.member = next(i for i, h in enumerate(st.hosts) if h.device_id == device_id)
        """This board's index among the stage's hosts."""
        self.host = st.hosts[self.member]
        self.rows = [self.host.rows[m] for m in range(len(st.microbatch_sizes))]
        """This host's [begin, end) rows of each micro-batch."""
        self.working = limiter.working if limiter is not None else contextlib.nullcontext
        """The context of computing (an emulated board's CPU limiter holds the board to its speed)."""
        self.copies = DeviceCopies(model_device(model))
        self.blocks = model.block_modules(st.first_block, st.end_block)
        self.outbox = Outbox(endpoint, job_id, work)
        self.inputs: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        """The inputs and labels of this host's rows from the board's own data (first or last stage)."""
        self.offsets: dict[int, tuple[int, int]] = {}
        """Each micro-batch's [begin, end) rows of `inputs` and `labels`."""
        self.held: dict[int, tuple[torch.Tensor | None, torch.Tensor] | None] = {}
        """What each micro-batch keeps from its forward for its backward: its input (None on the
        first stage) and its output (its loss on the last stage); None when its backward ran with
        it (the whole model here)."""
        self.held_bytes = self.peak_bytes = 0
        """Bytes of activations held for backward now, and the most at any time."""
        self.wait_s = 0.0
        """Seconds waiting for peers."""
        self.loss_sum, self.correct, self.rows_done = 0.0, 0, 0
        """Summed loss, correct predictions and rows of the micro-batches scored here (last stage)."""
        self.exchange: GroupExchange | None = None
        self.split: ChannelSplit | None = None
        if self.host.channels is not None:
            self.exchange = GroupExchange(endpoint, work, device_id, self.member, self.outbox, self.copies)
            self.split = ChannelSplit(self.blocks, [h.channels for h in st.hosts], self.host.channels, self.exchange)

    def run(self) -> StageResult:
        """Run every op of the stage's schedule, wait for the sends to finish, and collect the
        stage's gradients."""
        st = self.stage
        for block in self.blocks:
            for p in block.parameters():
                p.grad = None
        self.model.train()
        self._load_local_batch()
        try:
            with self.split if self.split is not None else contextlib.nullcontext():
                for op in schedule(st.schedule, st.stages, len(st.microbatch_sizes), st.stage):
                    self.run_op(op)
            self.wait_s += self.outbox.drain()
        except BaseException:
            self.outbox.cancel()
            raise
        return self._result()

    def run_op(self, op: Op) -> None:
        """One op of the schedule (nothing for a micro-batch this host has no rows of)."""
        m = op.microbatch
        begin, end = self.rows[m]
        if end == begin:
            return
        if self.split is not None:
            self.split.microbatch = m
        if op.kind == FORWARD and self.first and self.last:
            self.forward_and_backward(m)
        elif op.kind == FORWARD:
            self.forward(m)
        else:
            self.backward(m)

    def forward_and_backward(self, m: int) -> None:
        """The whole model here: micro-batch m's forward and backward at once, in chunks of at most
        `max_forward_batch` rows."""
        begin, end = self.offsets[m]
        bounds = chunk_bounds(begin, end, self.max_forward_batch)
        with self.working():
            for lo, hi in zip(bounds, bounds[1:]):
                out = _forward(self.blocks, self.inputs[lo:hi], self.split, _seed(self.work, m, lo), self.copies.device)
                self._score(out, self.labels[lo:hi]).backward()
                self.peak_bytes = max(self.peak_bytes, _bytes(out))
        self.rows_done += end - begin
        self.held[m] = None

    def forward(self, m: int) -> None:
        """Micro-batch m's forward: its input from the board's data (first stage) or the previous
        stage; its output to the next stage, or scored against the labels (last stage)."""
        if self.first:
            begin, end = self.offsets[m]
            inputs = self.inputs[begin:end]
        else:
            inputs = self._receive(m, backward=False).requires_grad_()
        with self.working():
            out = _forward(self.blocks, inputs, self.split, _seed(self.work, m, 0), self.copies.device)
            if self.last:
                begin, end = self.offsets[m]
                out = self._score(out, self.labels[begin:end])
                self.rows_done += end - begin
            self.held[m] = (None if self.first else inputs, out)
        if not self.last:
            self._send(m, False, out.detach())
        self.held_bytes += _bytes(*self.held[m])
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def backward(self, m: int) -> None:
        """Micro-batch m's backward: the gradient of its output from the next stage (the loss's
        own on the last stage); the gradient of its input to the previous stage."""
        held = self.held.pop(m)
        if held is None:  # done with its forward
            return
        inputs, out = held
        grad = None if self.last else self._receive(m, backward=True)
        with self.working():
            out.backward(grad)
        if not self.first:
            self._send(m, True, inputs.grad)
        self.held_bytes -= _bytes(*held)

    def _score(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of `out` (its summed cross-entropy over the pipeline's samples, so that all
        hosts' gradients add up to the mean loss's), counted into the step's loss and accuracy."""
        samples = self.stage.pipeline_samples
        loss = nn.functional.cross_entropy(out, labels, reduction="sum") / samples
        self.loss_sum += float(loss.detach()) * samples
        self.correct += int((out.detach().argmax(dim=1) == labels).sum())
        return loss

    def _load_local_batch(self) -> None:
        """Inputs and labels of this host's rows from the board's own data (a first or last stage)."""
        st, work = self.stage, self.work
        if not (self.first or self.last) or not any(end > begin for begin, end in self.rows):
            return
        starts = [sum(st.microbatch_sizes[:m]) for m in range(len(st.microbatch_sizes))]
        indices = [int(st.indices[starts[m] + r]) for m, (begin, end) in enumerate(self.rows) for r in range(begin, end)]
        inputs, labels = make_batch(self.dataset, indices, augment=work.augment, seed=work.data_seed, step=work.step)
        self.inputs, self.labels = self.copies.to_device(inputs), self.copies.to_device(labels)
        at = 0
        for m, (begin, end) in enumerate(self.rows):
            self.offsets[m] = (at, at + end - begin)
            at += end - begin

    def _receive(self, m: int, backward: bool) -> torch.Tensor:
        """This host's rows of micro-batch m from the neighbouring stage's hosts: activations from
        the previous stage, or (backward) the gradients of this stage's output from the next."""
        st, work = self.stage, self.work
        peers = st.next_hosts if backward else st.prev_hosts
        started = time.perf_counter()
        pieces = []
        for sender, receiver, begin, end in _routes(peers, st.hosts, m):
            if receiver != self.member:
                continue
            peer = peers[sender]
            key = MailKey(work.step, work.attempt, st.pipeline, m, backward, st.stage + (1 if backward else -1), begin,
                          end, peer.device_id)
            what = (f"{'gradients' if backward else 'activations'} of micro-batch {m} rows {begin}-{end} from "
                    f"stage {key.from_stage} host {peer.device_id}")
            pieces.append((begin, self.endpoint.mailbox.take(key, st.timeout_s, what, self.outbox.check)))
        pieces.sort(key=lambda piece: piece[0])
        received = self.copies.to_device(torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1])
        self.wait_s += time.perf_counter() - started
        return received

    def _send(self, m: int, backward: bool, tensor: torch.Tensor) -> None:
        """Ship this host's rows of micro-batch m to the hosts of the neighbouring stage that need
        them: activations to the next stage, or (backward) input gradients to the previous."""
        st, work = self.stage, self.work
        peers = st.prev_hosts if backward else st.next_hosts
        my_begin = self.rows[m][0]
        tensor = self.copies.to_host(tensor)
        for sender, receiver, begin, end in _routes(st.hosts, peers, m):
            if sender != self.member:
                continue
            key = MailKey(work.step, work.attempt, st.pipeline, m, backward, st.stage, begin, end, self.device_id)
            self.outbox.send(peers[receiver].address, key, tensor[begin - my_begin:end - my_begin])

    def _result(self) -> StageResult:
        """The step's rows, loss, accuracy and the stage's gradients and buffers; a channel group's
        member other than the leader reports only its slices (the leader counts the rest)."""
        st = self.stage
        samples = sum(end - begin for begin, end in self.rows)
        if self.split is not None:
            self.wait_s += self.exchange.wait_s
            if not self.split.leader:  # what every member computed alike counts once: the leader reports it
                for p in self.split.replicated_parameters(self.blocks):
                    p.grad = None
                self.loss_sum, self.correct, samples = 0.0, 0, 0
        prefixes = stage_parameter_prefixes(self.model.block_names, st.first_block, st.end_block)
        tensors = {}
        for name, p in self.model.named_parameters():
            if name.startswith(prefixes):
                grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                tensors[GRAD_PREFIX + name] = self.copies.to_host(grad)
        for name, buf in self.model.named_buffers():
            if name.startswith(prefixes) and buf.is_floating_point():
                tensors[BUFFER_PREFIX + name] = self.copies.to_host(buf.detach())
        loss = self.loss_sum / self.rows_done if self.rows_done else 0.0
        shard = ShardResult(loss=loss, correct=self.correct, samples=samples, tensors=tensors)
        return StageResult(shard, self.wait_s, self.peak_bytes, self.outbox.bytes_sent)


def _bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the tensors that hold activations (not None, not a scalar loss)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.dim())


def _channel_group(hosts: tuple[StageHost, ...]) -> bool:
    return bool(hosts) and hosts[0].channels is not None


def _routes(senders: tuple[StageHost, ...], receivers: tuple[StageHost, ...], m: int) -> list[tuple[int, int, int, int]]:
    """The transfers of micro-batch m's rows from one stage's hosts to the next's
    (edgetrain.pipeline.routes)."""
    return routes([h.rows[m] for h in senders], _channel_group(senders),
                  [h.rows[m] for h in receivers], _channel_group(receivers))


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
