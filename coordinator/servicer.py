"""The Coordinator gRPC service: thin handlers whose failures become precise status codes.

On a mutual-TLS server a board is its certificate: it registers under the certificate's name
(an empty name takes it; another one is refused), and every call naming a device id is refused
(PERMISSION_DENIED, NOT_PERMITTED) unless that device registered under the caller's name — so a
board cannot heartbeat, fetch work, upload, report a failure or ask anything for another board.
Which roles may call what is `coordinator.pairing.trust_guard`'s (before a handler runs). On a
plaintext (`--insecure`) server there is no certificate and nothing to check.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import torch

import edgetrain
from coordinator.registry import DeviceRecord, DeviceRegistry, UnknownDevice
from coordinator.training.parameters import ParameterStore
from coordinator.training.steps import StepBoard, StepError
from edgetrain import serde, transport
from edgetrain.config import JobConfig
from edgetrain.errors import FailureKind, Refusal
from edgetrain.streaming import TransferError, iter_chunks
from edgetrain.versions import mixed_note, torch_refusal
from edgetrain.work import BoardJob, BoardProfile, StepReport
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

OWN_TORCH = torch.__version__
"""The coordinator's torch: boards on another release are told apart in the log."""
_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "data_loss": grpc.StatusCode.DATA_LOSS,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
}
MAX_POLL_S = 30.0
PRESENCE_TICK_S = 2.0
"""A presence stream sends at least this often (and re-checks its device), so a stream to a
dropped board ends promptly and an idle one keeps traffic on the connection."""


def _abort(context: grpc.ServicerContext, rpc: str, code: grpc.StatusCode, message: str,
           reason: Refusal = Refusal.UNSPECIFIED) -> None:
    logger.warning("[Coordinator.%s] %s: %s", rpc, code.name, message)
    transport.abort(context, code, message, reason)


def _guarded(rpc: str):
    """Turn the domain's exceptions into status codes and typed reasons (the handler stays linear)."""
    def wrap(handler):
        def run(self, request, context):
            try:
                return handler(self, request, context)
            except UnknownDevice as e:
                _abort(context, rpc, grpc.StatusCode.NOT_FOUND, str(e), Refusal.UNKNOWN_DEVICE)
            except StepError as e:
                _abort(context, rpc, _CODES[e.kind], str(e), e.refusal)
            except TransferError as e:
                _abort(context, rpc, _CODES[e.kind], str(e))
            except ValueError as e:
                _abort(context, rpc, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        run.__name__ = handler.__name__
        return run
    return wrap


def _device_view(record: DeviceRecord, now: float) -> pb.DeviceView:
    stats = record.stats
    view = pb.DeviceView(
        device_id=record.device_id, info=pb.DeviceInfo(**record.info), state=record.state,
        left_reason=record.left_reason, seconds_since_seen=now - record.last_seen, samples_done=stats["samples"],
        samples_per_s=record.speed.samples_per_s if record.speed else None,
        energy_per_sample_j=stats["energy_j"] / stats["energy_samples"] if stats["energy_samples"] else None,
        codec=record.codec, rejected_updates=len(record.rejections), speed_claim=record.claim_note)
    if record.latest_telemetry is not None:
        view.telemetry.CopyFrom(serde.telemetry_to_proto(record.latest_telemetry))
    return view


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Admits devices and serves the data-parallel training loop's work and transfers."""

    def __init__(self, job: JobConfig, board_job: BoardJob, registry: DeviceRegistry, board: StepBoard,
                 store: ParameterStore, *, cluster: str = "edgetrain") -> None:
        self._job = job
        self._cluster = cluster
        self._registry = registry
        self._board = board
        self._store = store
        self._cache_lock = threading.Lock()
        self._cache: dict[tuple[int, int, int, bool], list[pb.ParameterMessage]] = {}
        self._board_job = board_job
        self._job_spec = serde.board_job_to_proto(board_job)

    def _own(self, context, rpc: str, device_id: str) -> DeviceRecord:
        """The live record of `device_id`, if the caller is the board it registered as (else
        PERMISSION_DENIED; UnknownDevice when there is no such live device)."""
        record = self._registry.get(device_id)
        peer = transport.peer_of(context)
        if peer is not None and peer.name != record.name:
            _abort(context, rpc, grpc.StatusCode.PERMISSION_DENIED,
                   f"{peer.role} {peer.name} cannot call {rpc} for device {device_id} of board {record.name}",
                   Refusal.NOT_PERMITTED)
        return record

    @_guarded("Register")
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:
        if request.protocol_version != edgetrain.PROTOCOL_VERSION:
            _abort(context, "Register", grpc.StatusCode.FAILED_PRECONDITION,
                   f"protocol version {request.protocol_version} not supported; "
                   f"this coordinator speaks {edgetrain.PROTOCOL_VERSION}", Refusal.PROTOCOL_MISMATCH)
        peer = transport.peer_of(context)
        name = request.device.name or (peer.name if peer else "")
        if not name:
            raise ValueError("device.name is required")
        if peer is not None and name != peer.name:
            _abort(context, "Register", grpc.StatusCode.PERMISSION_DENIED,
                   f"{peer.role} {peer.name} cannot take another board's name ({name}); a board registers "
                   "under the name in its certificate", Refusal.NOT_PERMITTED)
        info = {**{f.name: v for f, v in request.device.ListFields()}, "name": name}
        versions = {f.name: v for f, v in request.versions.ListFields()}
        refusal = torch_refusal(versions.get("torch", ""))
        if refusal:
            _abort(context, "Register", grpc.StatusCode.FAILED_PRECONDITION, f"board {name}: {refusal}",
                   Refusal.SOFTWARE_UNSUPPORTED)
        record = self._registry.register(name, info, versions, request.stage_address)
        logger.info("[Coordinator.Register] %s joined (%s, %s cores, speed %s, torch %s)", record.device_id,
                    info.get("arch", "?"), info.get("cpu_count", "?"), info.get("emulated_speed", "native"),
                    versions.get("torch") or "?")
        note = mixed_note(name, versions.get("torch", ""), OWN_TORCH)
        if note:
            logger.warning("[Coordinator.Register] %s", note)
        return pb.RegisterReply(device_id=record.device_id, job=self._job_spec)

    @_guarded("ReportProfile")
    def ReportProfile(self, request: pb.ProfileReport, context) -> pb.ProfileAck:
        self._own(context, "ReportProfile", request.device_id)
        profile = self._own_data(serde.profile_from_proto(request), context)
        speed = self._registry.set_profile(request.device_id, profile)
        logger.info("[Coordinator.ReportProfile] %s: %.1f samples/s + %.3f s/step", request.device_id,
                    speed.samples_per_s, speed.overhead_s)
        own = self._registry.get(request.device_id).own_data(self._board_job.class_names)
        if own:
            logger.info("[Coordinator.ReportProfile] %s trains on its own %d samples (class counts: %s)",
                        request.device_id, own["samples"], own["class_counts"] or "not shared")
        return pb.ProfileAck()

    def _own_data(self, profile: BoardProfile, context) -> BoardProfile:
        """The profile, its own-data figures checked: class counts that add up to its samples (kept
        only when the job asks boards to share them); a hand-made pipeline refuses such a board."""
        if not profile.local_samples:
            if profile.local_class_counts:
                raise ValueError("class counts without own samples (local_samples is 0)")
            return profile
        if self._job.pipeline.enabled:
            _abort(context, "ReportProfile", grpc.StatusCode.FAILED_PRECONDITION,
                   f"job {self._job.name} trains as a hand-made pipeline, whose first stage needs every sample it "
                   "trains on: a board that trains only on its own images cannot take part (run it in a data-"
                   "parallel, federated or planner job)")
        counts = profile.local_class_counts
        if counts and (len(counts) != len(self._board_job.class_names) or sum(counts) != profile.local_samples):
            raise ValueError(f"own-data class counts must give each of the job's {len(self._board_job.class_names)} "
                             f"classes and add up to the {profile.local_samples} samples, got {len(counts)} "
                             f"adding up to {sum(counts)}")
        return profile if self._board_job.share_class_counts else replace(profile, local_class_counts=())

    @_guarded("Heartbeat")
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        self._own(context, "Heartbeat", request.device_id)
        sample = serde.telemetry_from_proto(request.telemetry) if request.HasField("telemetry") else None
        self._registry.heartbeat(request.device_id, sample)
        newest = self._board.newest()
        return pb.HeartbeatReply(newest_step=newest[0], newest_attempt=newest[1]) if newest else pb.HeartbeatReply()

    @_guarded("Attach")
    def Attach(self, request: pb.AttachRequest, context) -> Iterator[pb.AttachEvent]:
        self._own(context, "Attach", request.device_id)
        device_id, ended_here = request.device_id, threading.Event()

        def on_termination() -> None:  # in a gRPC thread, as soon as the stream is over
            if not ended_here.is_set() and not self._board.finished:
                self._registry.drop(device_id, "its connection to the coordinator broke")
                self._board.wake()

        context.add_callback(on_termination)
        return self._presence(device_id, context, ended_here)

    def _presence(self, device_id: str, context, ended: threading.Event) -> Iterator[pb.AttachEvent]:
        """Push the newest step attempt while the board stays registered; end (without marking it
        lost) when the coordinator dropped it or the job finished."""
        seen: tuple[int, int] | None = None
        sent_at = 0.0
        try:
            while context.is_active():
                newest = self._board.wait_newer(seen, PRESENCE_TICK_S)
                if not self._registry.is_alive(device_id) or self._board.finished:
                    break
                if newest != seen or time.monotonic() - sent_at >= PRESENCE_TICK_S:
                    seen, sent_at = newest, time.monotonic()
                    yield pb.AttachEvent(newest_step=newest[0], newest_attempt=newest[1]) if newest \
                        else pb.AttachEvent()
        finally:
            if context.is_active():
                ended.set()  # the coordinator ends the stream: not a broken connection

    @_guarded("Probe")
    def Probe(self, request: pb.ProbeRequest, context) -> pb.ProbeReply:
        self._own(context, "Probe", request.device_id)
        return pb.ProbeReply(received_bytes=len(request.payload))

    @_guarded("ListDevices")
    def ListDevices(self, request: pb.ListDevicesRequest, context) -> pb.ListDevicesReply:
        now = time.monotonic()
        return pb.ListDevicesReply(job_id=self._job.name, cluster=self._cluster,
                                   devices=[_device_view(r, now) for r in self._registry.snapshot()])

    @_guarded("GetWork")
    def GetWork(self, request: pb.WorkRequest, context) -> pb.WorkAssignment:
        self._own(context, "GetWork", request.device_id)
        self._registry.heartbeat(request.device_id)
        if not math.isfinite(request.max_wait_s):
            raise ValueError(f"max_wait_s must be a finite number of seconds, got {request.max_wait_s}")
        wait = min(max(request.max_wait_s, 0.0), MAX_POLL_S)
        work = self._board.next_work(request.device_id, wait)
        self._registry.get(request.device_id)  # it may have been dropped while waiting
        return serde.work_to_proto(work)

    @_guarded("ReportFailure")
    def ReportFailure(self, request: pb.FailureReport, context) -> pb.FailureAck:
        self._own(context, "ReportFailure", request.device_id)
        if not request.reason:
            raise ValueError("a failure report needs a reason")
        kind = serde.failure_kind_from_proto(request.kind)
        if kind == FailureKind.OUT_OF_MEMORY:
            self._registry.note_out_of_memory(request.device_id)
        if kind == FailureKind.LOCAL_DATA:  # the board leaves the job: the others go on without it
            self._registry.drop(request.device_id, f"its own data is gone: {request.reason[:500]}")
            self._board.wake()
        self._board.fail(request.device_id, request.step, request.attempt, kind, request.reason[:2000])
        return pb.FailureAck()

    @_guarded("DownloadParameters")
    def DownloadParameters(self, request: pb.ParameterRequest, context) -> Iterator[pb.ParameterMessage]:
        self._own(context, "DownloadParameters", request.device_id)
        base = request.base_version if request.HasField("base_version") else -1
        checksum = not transport.authenticated_channel(context)  # TLS checks every byte already
        prefixes = tuple(request.prefixes)
        if prefixes and base >= 0:
            raise ValueError("a download is either deltas (base_version) or a part (prefixes), not both")
        share = None
        if request.channel_split:  # a channel group member: its rows of the split layers
            if not (prefixes and 0.0 <= request.channel_begin < request.channel_end <= 1.0):
                raise ValueError(f"a channel share [{request.channel_begin}, {request.channel_end}) must be within "
                                 "[0, 1) and come with the stage's prefixes")
            share = (request.channel_begin, request.channel_end)
        if prefixes:  # a pipeline stage's parameters: small, served as they are
            metas, payload = self._store.part(request.version, prefixes, share)
            if request.offset > len(payload):
                raise TransferError("out_of_range", f"offset {request.offset} is past the {len(payload)} bytes")
            chunks = iter_chunks(payload, start=request.offset, chunk_bytes=self._job.training.chunk_bytes,
                                 checksum=checksum)
            return self._counted(request.device_id, serde.parameter_stream(metas, chunks))
        messages = self._parameter_messages(base, request.version, checksum)
        total = messages[0].header.total_bytes
        if request.offset > total:
            raise TransferError("out_of_range", f"offset {request.offset} is past the {total} bytes")
        if request.offset % self._job.training.chunk_bytes == 0:  # a fresh or chunk-aligned resume
            first = 1 + request.offset // self._job.training.chunk_bytes
            return self._counted(request.device_id, [messages[0], *messages[first:]])
        metas, payload = self._bundle(base, request.version)
        chunks = iter_chunks(payload, start=request.offset, chunk_bytes=self._job.training.chunk_bytes,
                             checksum=checksum)
        return self._counted(request.device_id, serde.parameter_stream(metas, chunks))

    def _counted(self, device_id: str, messages) -> Iterator[pb.ParameterMessage]:
        """Stream `messages`, counting the payload bytes that left for the device."""
        sent = 0
        try:
            for message in messages:
                if message.WhichOneof("kind") == "chunk":
                    sent += len(message.chunk.data)
                yield message
        finally:
            self._registry.count_bytes(device_id, down=sent)

    def _bundle(self, base: int, version: int):
        """Full parameters of `version` (base -1) or the deltas since `base`."""
        return self._store.full(version) if base < 0 else self._store.deltas(base, version)

    def _parameter_messages(self, base: int, version: int, checksum: bool) -> list[pb.ParameterMessage]:
        """The header and chunk messages of a download (with crc32s or without), encoded once per
        publication and served to every device."""
        publication = self._store.publication
        metas, payload = self._bundle(base, version)  # refuses a version no longer served
        with self._cache_lock:
            key = (publication, base, version, checksum)
            if key not in self._cache:
                if any(k[0] != publication or k[2] != version for k in self._cache):
                    self._cache.clear()
                chunks = iter_chunks(payload, chunk_bytes=self._job.training.chunk_bytes, checksum=checksum)
                self._cache[key] = list(serde.parameter_stream(metas, chunks))
            return self._cache[key]

    @_guarded("UploadGradient")
    def UploadGradient(self, request_iterator: Iterator[pb.UploadMessage], context) -> pb.UploadReply:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise ValueError("an upload must start with an UploadHeader message")
        header = first.header
        self._own(context, "UploadGradient", header.device_id)
        metas, _ = serde.header_from_proto(header.bundle)
        streamed = not header.HasField("report")  # sent during the board's backward: the report comes last
        report = None if streamed else self._report(header, header.report)
        assembler = self._board.begin_upload(header.device_id, header.step, header.attempt, metas,
                                             report, header.resume_offset)
        closing = None
        for message in request_iterator:
            kind = message.WhichOneof("kind")
            if closing is not None:
                raise ValueError(f"a {kind} message after the step report that closes a streamed upload")
            if kind == "chunk":
                chunk = message.chunk
                assembler.add(chunk.offset, chunk.data, serde.chunk_crc32(chunk))
                self._registry.count_bytes(header.device_id, up=len(chunk.data))
            elif kind == "report" and streamed:
                closing = self._report(header, message.report)
            elif streamed:
                raise ValueError(f"a {kind} message in a streamed upload: only chunks, then the step report, "
                                 "may follow its header")
            else:
                raise ValueError("only chunks may follow the upload header")
        self._board.complete_upload(header.device_id, header.step, header.attempt, closing)
        return pb.UploadReply(received_bytes=assembler.received)

    def _report(self, header: pb.UploadHeader, message: pb.StepReport) -> StepReport:
        """A board's step report; one nothing can use refuses the update."""
        try:
            return serde.step_report_from_proto(message)
        except ValueError as e:
            self._board.refuse(header.device_id, header.step, header.attempt, f"bad step report: {e}")
            raise

    @_guarded("GetUploadStatus")
    def GetUploadStatus(self, request: pb.UploadStatusRequest, context) -> pb.UploadStatus:
        self._own(context, "GetUploadStatus", request.device_id)
        held, total = self._board.upload_status(request.device_id, request.step, request.attempt)
        return pb.UploadStatus(received_bytes=held, total_bytes=total)


def coordinator_service(servicer: CoordinatorServicer) -> list:
    """The (add_to_server, servicer) pair to serve (coordinator.pairing.serve_gateway)."""
    return [(pb_grpc.add_CoordinatorServicer_to_server, servicer)]
