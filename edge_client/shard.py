"""A data-parallel shard on the board: fetch the parameters it needs, compute the update, encode it.

An update is the gradient of the assigned samples (or, in a federated round, the parameter
change of local training), encoded with the codec the coordinator chose for this board's link;
with a lossy codec, what was not sent is kept (error feedback) and added to the next update once
the upload succeeded. Parameters arrive in full, or as the compressed deltas since the version
the board holds; either way the board keeps the coordinator's served view exactly. An
uncompressed gradient update can go on the wire while backward produces it (edge_client.streamed),
and a full download can run while the forward pass starts on what has arrived (edge_client.arriving).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from edge_client.arriving import ArrivingParameters, Download
from edge_client.streamed import StreamChoice, StreamedUpdate
from edgetrain import transport
from edgetrain.board_hardware import ComputeThrottle
from edgetrain.compression import ErrorFeedback, parse_codec
from edgetrain.data import make_batch
from edgetrain.errors import Refusal
from edgetrain.models import BlockModel
from edgetrain.streaming import TensorMeta, TransferError, check_metas
from edgetrain.tensors import pack, unpack
from edgetrain.training import (
    GRAD_PREFIX,
    compute_shard,
    load_state_tensors,
    local_train,
    shard_tensor_names,
    state_tensors,
)
from edgetrain.updates import DeltaFormat, UpdateFormats
from edgetrain.work import Assignment, BoardJob, StepReport

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """What a board uploads for one step, and what to do once the upload was accepted."""

    metas: list[TensorMeta]
    payload: memoryview
    report: StepReport
    commit: Callable[[], None]
    """Called after a successful upload (error feedback and momentum masks advance then)."""
    streamed: StreamedUpdate | None = None
    """The update when it is already on its way (started during compute): send it its report
    and wait for it instead of uploading `payload`."""


class ShardRunner:
    """The board's copy of the served parameters and what the model currently holds."""

    def __init__(self, model: torch.nn.Module, dataset, job: BoardJob, limiter: ComputeThrottle) -> None:
        self.model = model
        self.dataset = dataset
        self.job = job
        self.limiter = limiter
        self.formats = UpdateFormats(shard_tensor_names(model))
        self._version = -1
        self._view: dict[str, torch.Tensor] = {}
        self._loaded = -1
        self._deltas: dict[str, DeltaFormat] = {}
        self._feedback = ErrorFeedback()
        self._velocity: dict[str, torch.Tensor] = {}
        cores = limiter.fraction or len(os.sched_getaffinity(0))
        self.stream_choice = StreamChoice(job.stream_upload, cores)
        """Whether uncompressed updates stream (the worker tells it how each upload went)."""
        self.download_choice = StreamChoice(job.stream_download, cores, key="stream_download")
        """Whether full downloads run under the compute (timed here when they do not)."""

    def forget(self) -> None:
        """Hold nothing (the coordinator may have restarted: what this board holds may not be its view)."""
        self._version, self._loaded, self._view, self._feedback, self._velocity = -1, -1, {}, ErrorFeedback(), {}

    def invalidate(self) -> None:
        """The model's parameters were overwritten (a pipeline stage ran on it): load the view again."""
        self._version, self._loaded, self._view = -1, -1, {}

    def compute(self, work: Assignment, download: Download,
                send_streamed: Callable[[StreamedUpdate], None] | None = None) -> Update:
        """Fetch parameters if needed, compute the update, encode it. With `send_streamed` (the
        upload of a streamed update) an update that can stream is on its way during compute."""
        started, cpu_started = time.perf_counter(), time.process_time()
        full = self._full_download(work)
        arriving = None
        if full and self.download_choice.stream():
            arriving = ArrivingParameters(self.model, download, work.param_version)
        if arriving is None:
            self._fetch(work, download)
            if full:
                self.download_choice.observe(streamed=False, wall_s=time.perf_counter() - started,
                                             cpu_s=time.process_time() - cpu_started)
            if self._loaded != self._version:  # also after a forward pass moved BN running stats
                load_state_tensors(self.model, self._view)
                self._loaded = self._version
        else:
            self.download_choice.observe(streamed=True, wall_s=0.0, cpu_s=0.0)
            self._version, self._view = -1, {}  # until the download is in, the board holds no view
        download_s = time.perf_counter() - started
        streamed = None
        if send_streamed is not None and self._can_stream(work):
            streamed = StreamedUpdate(self.model, self.formats(work.codec).metas())
            streamed.start(send_streamed)
        started = time.perf_counter()
        try:
            with self.limiter.working():
                x, y = make_batch(self.dataset, list(work.indices), augment=work.augment, seed=work.data_seed,
                                  step=work.step)
                if arriving is not None:
                    arriving.start()
                if work.local is not None:
                    local = work.local
                    result = local_train(self.model, x, y, steps=local.steps, batch_size=local.batch_size,
                                         lr=local.lr, momentum=local.momentum, weight_decay=local.weight_decay,
                                         prox_mu=local.prox_mu)
                else:
                    result = compute_shard(self.model, x, y, self.job.max_forward_batch,
                                           before_last_backward=streamed.arm if streamed else None)
                if arriving is not None:
                    metas, payload = arriving.finish()
                    self._view, self._version = unpack(metas, payload), work.param_version
                if streamed is not None:
                    streamed.complete(result.tensors)
        except BaseException:
            self._loaded = -1  # a pass that did not finish may have moved BN statistics or loaded a newer version
            if arriving is not None:
                arriving.close()
            if streamed is not None:
                streamed.abandon()
            raise
        compute_s = time.perf_counter() - started
        overlap_s = 0.0
        if arriving is not None:  # the time the compute stood waiting for bytes is the download's
            compute_s -= arriving.waited_s
            download_s += arriving.waited_s
            overlap_s = max(0.0, arriving.seconds - download_s)
            self._loaded = self._version
        if work.local is not None or _has_running_stats(self.model):
            self._loaded = -1
        if streamed is not None:
            report = StepReport(samples=result.samples, loss=result.loss, correct=result.correct,
                                compute_s=compute_s, download_s=download_s, download_overlap_s=overlap_s,
                                download_streamed=arriving is not None)
            return Update(streamed.metas, memoryview(b""), report, lambda: None, streamed)
        started = time.perf_counter()
        tensors = self._with_momentum(result.tensors)
        if self.job.error_feedback:
            self._feedback.begin(work.step)
        wire, commit_feedback = self.formats(work.codec).encode(
            tensors, self._feedback if self.job.error_feedback else None)

        def commit() -> None:
            commit_feedback()
            self._mask_sent_momentum(wire)

        metas, payload = pack(wire)
        report = StepReport(samples=result.samples, loss=result.loss, correct=result.correct, compute_s=compute_s,
                            download_s=download_s, encode_s=time.perf_counter() - started,
                            download_overlap_s=overlap_s, download_streamed=arriving is not None)
        return Update(metas, payload, report, commit)

    def _full_download(self, work: Assignment) -> bool:
        """Whether this step brings a full download the compute could run under: a data-parallel
        gradient shard whose board holds another version and would not fetch deltas."""
        version = work.param_version
        return (work.local is None and version != self._version and isinstance(self.model, BlockModel)
                and not (work.delta_codec and 0 <= self._version < version))

    def _can_stream(self, work: Assignment) -> bool:
        """Whether this step's update can go on the wire during backward: a gradient shard
        (not a federated round) sent uncompressed, with nothing added to the gradients after
        backward (board momentum, or a residual an earlier lossy codec left to send)."""
        return (work.local is None and parse_codec(work.codec or "none").name == "none"
                and not self.job.board_momentum and not (self.job.error_feedback and self._feedback.norm())
                and self.stream_choice.stream())

    def _with_momentum(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Momentum correction: u <- m u + g per gradient, sent in place of g (when the job asks)."""
        m = self.job.board_momentum
        if not m:
            return tensors
        out = dict(tensors)
        for name, grad in tensors.items():
            if name.startswith(GRAD_PREFIX):
                u = self._velocity.get(name)
                self._velocity[name] = u = grad.clone() if u is None else u.mul_(m).add_(grad)
                out[name] = u.clone()
        return out

    def _mask_sent_momentum(self, wire: dict[str, torch.Tensor]) -> None:
        """DGC momentum factor masking: a coordinate top-k sent starts its momentum afresh."""
        for name, u in self._velocity.items():
            idx = wire.get(name + ":idx")
            if idx is not None:
                u.view(-1)[idx.long()] = 0.0

    def _fetch(self, work: Assignment, download: Download) -> None:
        """Bring the served view to `work.param_version`: deltas when offered and possible, else full."""
        version = work.param_version
        if version == self._version:
            return
        if work.delta_codec and 0 <= self._version < version:
            deltas = self._deltas.get(work.delta_codec)
            if deltas is None:
                deltas = self._deltas[work.delta_codec] = DeltaFormat(state_tensors(self.model), work.delta_codec)
            try:
                metas, payload = download(version, base_version=self._version)
                check_metas(metas, deltas.chain_metas(self._version, version), f"deltas to version {version}")
                deltas.apply_chain(self._view, self._version, version, unpack(metas, payload))
                self._version = version
                return
            except grpc.RpcError as e:
                if transport.error_reason(e) not in (Refusal.DELTAS_NOT_KEPT, Refusal.VERSION_NOT_SERVED):
                    raise
                logger.info("[Client.Download] no deltas from version %d (%s); downloading in full",
                            self._version, e.details())
            except (TransferError, ValueError) as e:
                logger.warning("[Client.Download] bad deltas (%s); downloading in full", e)
        metas, payload = download(version)
        self._view = unpack(metas, payload)
        self._version = version


def _has_running_stats(model: torch.nn.Module) -> bool:
    return any(b.is_floating_point() for b in model.buffers())
