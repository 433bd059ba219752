"""Pure conversions between the core's plain data and the wire messages (protos/).

Every wire message a role handles goes through a ``*_to_proto`` / ``*_from_proto`` pair here;
beyond this module, the servicers and the client connection, code speaks core dataclasses
(edgetrain.work, edgetrain.telemetry, edgetrain.streaming). A message that cannot be turned into
a valid core object raises ValueError (or TransferError for bundles), which servers answer with
INVALID_ARGUMENT.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

from edgetrain.catalog import DatasetSpec
from edgetrain.errors import FailureKind
from edgetrain.pipeline import check_shares
from edgetrain.streaming import DTYPE_BYTES, WIRE_DTYPES, RawChunk, TensorMeta, TransferError
from edgetrain.telemetry import TelemetrySample
from edgetrain.work import (
    STREAM_MODES,
    Assignment,
    BoardJob,
    BoardProfile,
    Finished,
    LocalWork,
    StageHost,
    StageWork,
    StateRequest,
    StepReport,
)
from protos import coordinator_pb2 as pb
from protos import stage_pb2 as spb
from protos import tensor_pb2 as tpb

_DTYPE_TO_PROTO = {
    "float32": tpb.FLOAT32, "float16": tpb.FLOAT16, "bfloat16": tpb.BFLOAT16, "int64": tpb.INT64,
    "int32": tpb.INT32, "int8": tpb.INT8, "uint8": tpb.UINT8,
}
_DTYPE_FROM_PROTO = {v: k for k, v in _DTYPE_TO_PROTO.items()}
assert set(_DTYPE_TO_PROTO) == set(WIRE_DTYPES)


def header_to_proto(metas: Sequence[TensorMeta]) -> tpb.BundleHeader:
    """Bundle header message for `metas`."""
    return tpb.BundleHeader(
        tensors=[tpb.TensorSpec(name=m.name, dtype=_DTYPE_TO_PROTO[m.dtype], shape=list(m.shape),
                                offset=m.offset, nbytes=m.nbytes) for m in metas],
        total_bytes=sum(m.nbytes for m in metas),
    )


def header_from_proto(msg: tpb.BundleHeader) -> tuple[list[TensorMeta], int]:
    """Metas and declared total size; TransferError(invalid_argument) if inconsistent.

    A model's headers repeat every step (hundreds of tensors: ~5 ms to check): the last few
    checked are remembered by their bytes."""
    metas, total = _checked_header(msg.SerializeToString(deterministic=True))
    return list(metas), total


@functools.lru_cache(maxsize=16)
def _checked_header(serialized: bytes) -> tuple[tuple[TensorMeta, ...], int]:
    msg = tpb.BundleHeader.FromString(serialized)
    metas, offset = [], 0
    for spec in msg.tensors:
        if spec.dtype not in _DTYPE_FROM_PROTO:
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: unknown dtype {spec.dtype}")
        dtype = _DTYPE_FROM_PROTO[spec.dtype]
        if any(d < 0 for d in spec.shape):
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: negative dimension")
        if spec.nbytes != math.prod(spec.shape) * DTYPE_BYTES[dtype]:
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: {spec.nbytes} bytes do not hold a "
                                f"{dtype} tensor of shape {list(spec.shape)}")
        metas.append(TensorMeta(spec.name, dtype, tuple(spec.shape), spec.offset, spec.nbytes))
        if spec.offset != offset:
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: offset {spec.offset}, expected {offset}")
        offset += spec.nbytes
    if offset != msg.total_bytes:
        raise TransferError("invalid_argument", f"bundle declares {msg.total_bytes} bytes, tensors cover {offset}")
    return tuple(metas), msg.total_bytes


def chunk_to_proto(chunk: RawChunk) -> tpb.Chunk:
    """Chunk message (without crc32 when the chunk has none)."""
    return tpb.Chunk(offset=chunk.offset, data=chunk.data, crc32=chunk.crc32)


def chunk_crc32(msg: tpb.Chunk) -> int | None:
    """The chunk's crc32, None when the sender left it out (a TLS channel)."""
    return msg.crc32 if msg.HasField("crc32") else None


def parameter_stream(metas: Sequence[TensorMeta], chunks: Iterator[RawChunk]) -> Iterator[pb.ParameterMessage]:
    """A parameter download: the header, then the chunks."""
    yield pb.ParameterMessage(header=header_to_proto(metas))
    for chunk in chunks:
        yield pb.ParameterMessage(chunk=chunk_to_proto(chunk))


def dataset_to_proto(spec: DatasetSpec) -> pb.DatasetSpec:
    """Dataset description sent to clients (the data directory stays each board's own)."""
    return pb.DatasetSpec(name=spec.name, seed=spec.seed, train_size=spec.train_size or 0,
                          test_size=spec.test_size or 0, augment=spec.augment)


def dataset_from_proto(msg: pb.DatasetSpec) -> DatasetSpec:
    """The job's dataset (each board reads it from its own data directory: the default until set)."""
    return DatasetSpec(name=msg.name, seed=msg.seed, train_size=msg.train_size or None,
                       test_size=msg.test_size or None, augment=msg.augment)


def telemetry_to_proto(sample: TelemetrySample) -> pb.Telemetry:
    """Telemetry message; unknown values stay unset."""
    return pb.Telemetry(**sample.known())


def telemetry_from_proto(msg: pb.Telemetry) -> TelemetrySample:
    """Telemetry sample; unset fields become None (unknown)."""
    known = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
             if f.name != "timestamp" and msg.HasField(f.name)}
    return TelemetrySample(timestamp=msg.timestamp, **known)


def failure_kind_from_proto(value: int) -> FailureKind:
    """The kind of a board's failure report; ValueError for a value this side does not know."""
    try:
        return FailureKind(value)
    except ValueError:
        raise ValueError(f"unknown failure kind {value}") from None


# --- work -----------------------------------------------------------------------------------------

def _host_to_proto(host: StageHost) -> pb.StageHost:
    split = host.channels is not None
    begin, end = host.channels if split else (0.0, 0.0)
    return pb.StageHost(device_id=host.device_id, address=host.address, row_begin=[b for b, _ in host.rows],
                        row_end=[e for _, e in host.rows], name=host.name, channel_split=split,
                        channel_begin=begin, channel_end=end)


def _host_from_proto(msg: pb.StageHost, microbatches: int) -> StageHost:
    if len(msg.row_begin) != microbatches or len(msg.row_end) != microbatches:
        raise ValueError(f"stage host {msg.device_id!r}: rows for {len(msg.row_begin)} micro-batches, "
                         f"the stage has {microbatches}")
    channels = None
    if msg.channel_split:
        if not 0.0 <= msg.channel_begin < msg.channel_end <= 1.0:
            raise ValueError(f"stage host {msg.device_id!r}: channel share [{msg.channel_begin}, {msg.channel_end}) "
                             "is not a share of [0, 1)")
        channels = (msg.channel_begin, msg.channel_end)
    return StageHost(msg.device_id, msg.address, tuple(zip(msg.row_begin, msg.row_end)), msg.name, channels)


def _check_group(group: tuple[StageHost, ...], sizes: tuple[int, ...], key: str) -> None:
    """ValueError unless a stage's hosts are all sample-split hosts, or all members of one channel
    group: shares tiling [0, 1) in host order (the first leads), each holding every row."""
    split = [h.channels is not None for h in group]
    if not any(split):
        return
    if not all(split):
        raise ValueError(f"{key}: a stage's hosts are either all channel group members or none")
    try:
        check_shares([h.channels for h in group])
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    every = tuple((0, size) for size in sizes)
    if any(h.rows != every for h in group):
        raise ValueError(f"{key}: a channel group member computes every row of every micro-batch")


def stage_work_to_proto(stage: StageWork) -> pb.StageWork:
    """A pipeline stage's work message."""
    return pb.StageWork(
        pipeline=stage.pipeline, stage=stage.stage, stages=stage.stages, first_block=stage.first_block,
        end_block=stage.end_block, schedule=stage.schedule, indices=stage.indices,
        microbatch_sizes=stage.microbatch_sizes, hosts=[_host_to_proto(h) for h in stage.hosts],
        prev_hosts=[_host_to_proto(h) for h in stage.prev_hosts],
        next_hosts=[_host_to_proto(h) for h in stage.next_hosts], pipeline_samples=stage.pipeline_samples,
        timeout_s=stage.timeout_s, owned=stage.owned, lr=stage.lr, commit_step=stage.commit_step,
        commit_attempt=stage.commit_attempt)


def stage_work_from_proto(msg: pb.StageWork) -> StageWork:
    """A pipeline stage's work; ValueError when it does not describe one."""
    m = len(msg.microbatch_sizes)
    if not (msg.stage < msg.stages and msg.first_block < msg.end_block and m and msg.hosts):
        raise ValueError(f"stage work {msg.stage}/{msg.stages}, blocks [{msg.first_block}, {msg.end_block}), "
                         f"{m} micro-batches, {len(msg.hosts)} hosts does not describe a stage")
    groups = {key: tuple(_host_from_proto(h, m) for h in getattr(msg, key)) for key in ("hosts", "prev_hosts",
                                                                                       "next_hosts")}
    for key, group in groups.items():
        _check_group(group, tuple(msg.microbatch_sizes), key)
    return StageWork(
        pipeline=msg.pipeline, stage=msg.stage, stages=msg.stages, first_block=msg.first_block,
        end_block=msg.end_block, schedule=msg.schedule, indices=tuple(msg.indices),
        microbatch_sizes=tuple(msg.microbatch_sizes), hosts=groups["hosts"],
        prev_hosts=groups["prev_hosts"], next_hosts=groups["next_hosts"], pipeline_samples=msg.pipeline_samples,
        timeout_s=msg.timeout_s, owned=msg.owned, lr=msg.lr, commit_step=msg.commit_step,
        commit_attempt=msg.commit_attempt)


def work_to_proto(work: Assignment | Finished | None) -> pb.WorkAssignment:
    """The answer to a work poll: a step's assignment, the end of the job, or nothing yet (idle)."""
    if isinstance(work, Finished):
        return pb.WorkAssignment(finished=pb.Finished(reason=work.reason))
    if work is None:
        return pb.WorkAssignment(idle=pb.Idle())
    step = pb.StepWork(step=work.step, attempt=work.attempt, param_version=work.param_version,
                       indices=work.indices, augment=work.augment, data_seed=work.data_seed, codec=work.codec,
                       delta_codec=work.delta_codec)
    if work.local is not None:
        step.local.CopyFrom(pb.LocalTraining(**vars(work.local)))
    if work.stage is not None:
        step.stage.CopyFrom(stage_work_to_proto(work.stage))
    return pb.WorkAssignment(step=step)


def work_from_proto(msg: pb.WorkAssignment) -> Assignment | Finished | None:
    """The assignment, Finished, or None (idle) a work poll answered."""
    kind = msg.WhichOneof("work")
    if kind == "finished":
        return Finished(msg.finished.reason)
    if kind != "step":
        return None
    w = msg.step
    local = None
    if w.HasField("local"):
        local = LocalWork(steps=w.local.steps, batch_size=w.local.batch_size, lr=w.local.lr,
                          momentum=w.local.momentum, weight_decay=w.local.weight_decay, prox_mu=w.local.prox_mu)
    return Assignment(step=w.step, attempt=w.attempt, param_version=w.param_version, indices=tuple(w.indices),
                      augment=w.augment, data_seed=w.data_seed, codec=w.codec, delta_codec=w.delta_codec,
                      local=local, stage=stage_work_from_proto(w.stage) if w.HasField("stage") else None)


def step_report_to_proto(report: StepReport) -> pb.StepReport:
    """A board's report on its update (energy unset when unknown)."""
    return pb.StepReport(samples=report.samples, loss=report.loss, correct=report.correct,
                         compute_s=report.compute_s, download_s=report.download_s, encode_s=report.encode_s,
                         energy_j=report.energy_j, wait_s=report.wait_s,
                         peak_activation_bytes=report.peak_activation_bytes, peer_bytes=report.peer_bytes,
                         upload_exposed_s=report.upload_exposed_s, download_overlap_s=report.download_overlap_s,
                         download_streamed=report.download_streamed)


def step_report_from_proto(msg: pb.StepReport) -> StepReport:
    """A board's report; ValueError for a figure that is not finite, or a negative duration."""
    report = StepReport(samples=msg.samples, loss=msg.loss, correct=msg.correct, compute_s=msg.compute_s,
                        download_s=msg.download_s, encode_s=msg.encode_s,
                        energy_j=msg.energy_j if msg.HasField("energy_j") else None, wait_s=msg.wait_s,
                        peak_activation_bytes=msg.peak_activation_bytes, peer_bytes=msg.peer_bytes,
                        upload_exposed_s=msg.upload_exposed_s, download_overlap_s=msg.download_overlap_s,
                        download_streamed=msg.download_streamed)
    report.check()
    return report


def upload_header_to_proto(device_id: str, step: int, attempt: int, metas: Sequence[TensorMeta],
                           report: StepReport | None, resume_offset: int = 0) -> pb.UploadHeader:
    """The first message of an update upload (without a report: a streamed upload, whose report
    comes last)."""
    return pb.UploadHeader(device_id=device_id, step=step, attempt=attempt, bundle=header_to_proto(metas),
                           report=None if report is None else step_report_to_proto(report),
                           resume_offset=resume_offset)


def board_job_to_proto(job: BoardJob) -> pb.JobSpec:
    """The job as boards get it when they register."""
    return pb.JobSpec(job_id=job.job_id, model=job.model, num_classes=job.num_classes,
                      dataset=dataset_to_proto(job.dataset), profile_batch_sizes=job.profile_batch_sizes,
                      heartbeat_interval_s=job.heartbeat_interval_s, chunk_bytes=job.chunk_bytes,
                      max_forward_batch=job.max_forward_batch, error_feedback=job.error_feedback,
                      board_momentum=job.board_momentum, device=job.device, stream_upload=job.stream_upload,
                      stream_download=job.stream_download, class_names=job.class_names,
                      share_class_counts=job.share_class_counts)


def board_job_from_proto(msg: pb.JobSpec) -> BoardJob:
    """The job a board registered for (its dataset's data directory is the board's to set)."""
    return BoardJob(job_id=msg.job_id, model=msg.model, num_classes=msg.num_classes,
                    dataset=dataset_from_proto(msg.dataset),
                    profile_batch_sizes=tuple(msg.profile_batch_sizes), heartbeat_interval_s=msg.heartbeat_interval_s,
                    chunk_bytes=msg.chunk_bytes, max_forward_batch=msg.max_forward_batch,
                    error_feedback=msg.error_feedback, board_momentum=msg.board_momentum, device=msg.device or "cpu",
                    stream_upload=msg.stream_upload if msg.stream_upload in STREAM_MODES else "off",
                    stream_download=msg.stream_download if msg.stream_download in STREAM_MODES else "off",
                    class_names=tuple(msg.class_names), share_class_counts=msg.share_class_counts)


def state_request_to_proto(request: StateRequest) -> spb.StateRequest:
    """A stage-state hand-over or pull request."""
    return spb.StateRequest(**vars(request))


def state_request_from_proto(msg: spb.StateRequest) -> StateRequest:
    """A stage-state request; ValueError when its block range is empty."""
    if msg.first_block >= msg.end_block:
        raise ValueError(f"blocks [{msg.first_block}, {msg.end_block}) are an empty range")
    return StateRequest(job_id=msg.job_id, first_block=msg.first_block, end_block=msg.end_block,
                        version=msg.version, commit_step=msg.commit_step, commit_attempt=msg.commit_attempt,
                        supersede_attempt=msg.supersede_attempt, momentum=msg.momentum,
                        weight_decay=msg.weight_decay, nesterov=msg.nesterov, release=msg.release,
                        offset=msg.offset)


def profile_to_proto(device_id: str, profile: BoardProfile) -> pb.ProfileReport:
    """A board's join-time profile."""
    return pb.ProfileReport(device_id=device_id, timings=[pb.BatchTiming(batch_size=b, seconds=t)
                                                          for b, t in profile.timings],
                            memory_total_bytes=profile.memory_total_bytes,
                            memory_available_bytes=profile.memory_available_bytes,
                            peak_rss_bytes=profile.peak_rss_bytes, local_samples=profile.local_samples,
                            local_class_counts=profile.local_class_counts, device=profile.device,
                            device_memory_bytes=profile.device_memory_bytes, copy_s_per_byte=profile.copy_s_per_byte)


def profile_from_proto(msg: pb.ProfileReport) -> BoardProfile:
    """A board's profile; ValueError for timings that are not positive and finite."""
    return BoardProfile(tuple((t.batch_size, t.seconds) for t in msg.timings), msg.memory_total_bytes,
                        msg.memory_available_bytes, msg.peak_rss_bytes, msg.local_samples,
                        tuple(msg.local_class_counts), msg.device or "cpu", msg.device_memory_bytes,
                        msg.copy_s_per_byte if math.isfinite(msg.copy_s_per_byte) and msg.copy_s_per_byte > 0 else 0.0)
