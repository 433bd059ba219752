"""The board's connection to the coordinator: every RPC, retries, and resumable transfers.

Retries happen only here, only on UNAVAILABLE (the coordinator unreachable or restarting), with
exponential backoff. Tensor transfers resume from the last byte that arrived intact instead of
starting over: downloads ask for chunks from that offset, uploads ask the coordinator how many
bytes it holds and continue from there.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from edge_client.telemetry import LinkMeter
from edgetrain import serde
from edgetrain.emulator.shaping import LinkShaper
from edgetrain.tensors import ChunkAssembler, TensorMeta, TransferError, iter_chunks
from edgetrain.transport import CHANNEL_OPTIONS
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")

TRANSFER_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.DEADLINE_EXCEEDED)
"""A transfer failing with these is resumed from the last good byte."""


class CoordinatorUnreachable(ConnectionError):
    """The coordinator stayed unavailable for longer than the retry budget."""


class CoordinatorConnection:
    """A channel to one coordinator with typed, retrying calls."""

    def __init__(self, address: str, *, retry_budget_s: float = 60.0, transfer_attempts: int = 5,
                 shaper: LinkShaper | None = None, link: LinkMeter | None = None) -> None:
        self.address = address
        self.retry_budget_s = retry_budget_s
        self.transfer_attempts = transfer_attempts
        self.shaper = shaper
        """Application-level link emulation (rate, delay, loss), or None for the real link."""
        self.link = link or LinkMeter()
        """Bandwidth and RTT measured on this connection."""
        self._rng = random.Random()
        self._active = 0
        self._active_lock = threading.Lock()
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    @property
    def transferring(self) -> bool:
        """Whether a parameter download or update upload is under way (it measures the link itself;
        a probe now would only queue behind it on a slow link)."""
        with self._active_lock:
            return self._active > 0

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[None]:
        with self._active_lock:
            self._active += 1
        try:
            yield
        finally:
            with self._active_lock:
                self._active -= 1

    def _retrying(self, call: Callable[[], T]) -> T:
        delay, deadline = 0.2, time.monotonic() + self.retry_budget_s
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        raise CoordinatorUnreachable(f"{self.address}: {e.details()}") from e
                    raise
                logger.debug("[Client.Connection] %s unavailable; retrying in %.1f s", self.address, delay,
                             exc_info=True)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def register(self, request: pb.RegisterRequest) -> pb.RegisterReply:
        """Join the coordinator's job."""
        return self._retrying(lambda: self._stub.Register(request, timeout=30))

    def report_profile(self, report: pb.ProfileReport) -> None:
        """Send the join-time profile."""
        self._retrying(lambda: self._stub.ReportProfile(report, timeout=30))

    def heartbeat(self, device_id: str, telemetry: pb.Telemetry | None = None) -> pb.HeartbeatReply:
        """One liveness ping with a telemetry sample (no retry: the next one follows soon)."""
        started = time.perf_counter()
        self._delay()
        reply = self._stub.Heartbeat(pb.HeartbeatRequest(device_id=device_id, telemetry=telemetry), timeout=10)
        self.link.observe_rtt(time.perf_counter() - started)
        return reply

    def probe(self, device_id: str, payload: bytes) -> None:
        """Send `payload` to the coordinator and wait for the acknowledgement (a link probe)."""
        self._delay()
        if self.shaper:
            self.shaper.before_send(len(payload))
        self._stub.Probe(pb.ProbeRequest(device_id=device_id, payload=payload), timeout=60)

    def list_devices(self) -> pb.ListDevicesReply:
        """The coordinator's view of its boards."""
        return self._retrying(lambda: self._stub.ListDevices(pb.ListDevicesRequest(), timeout=10))

    def _delay(self) -> None:
        if self.shaper:
            self.shaper.rpc_delay()

    def get_work(self, device_id: str, max_wait_s: float) -> pb.WorkAssignment:
        """Long-poll for work."""
        request = pb.WorkRequest(device_id=device_id, max_wait_s=max_wait_s)
        return self._retrying(lambda: self._stub.GetWork(request, timeout=max_wait_s + 30))

    def download_parameters(self, device_id: str, version: int, base_version: int | None = None,
                            prefixes: Sequence[str] = ()) -> tuple[list[TensorMeta], bytearray]:
        """Parameters of `version` (or the deltas since `base_version`, or only the tensors named
        with `prefixes`), resuming an interrupted stream from the last good byte."""
        with self._transfer():
            return self._download(device_id, version, base_version, list(prefixes))

    def report_failure(self, device_id: str, step: int, attempt: int, reason: str) -> None:
        """Tell the coordinator this board cannot complete (step, attempt)."""
        self._retrying(lambda: self._stub.ReportFailure(pb.FailureReport(
            device_id=device_id, step=step, attempt=attempt, reason=reason), timeout=30))

    def _download(self, device_id: str, version: int, base_version: int | None,
                  prefixes: list[str]) -> tuple[list[TensorMeta], bytearray]:
        assembler: ChunkAssembler | None = None
        metas: list[TensorMeta] = []
        started, failures, progress = time.perf_counter(), 0, -1
        while failures < self.transfer_attempts:
            offset = assembler.received if assembler else 0
            failures = 0 if offset > progress else failures  # an interruption after progress is not a failure
            progress = offset
            request = pb.ParameterRequest(device_id=device_id, version=version, offset=offset,
                                          base_version=base_version, prefixes=prefixes)
            try:
                self._delay()
                for message in self._stub.DownloadParameters(request, timeout=600):
                    if message.WhichOneof("kind") == "header":
                        metas, total = serde.header_from_proto(message.header)
                        assembler = assembler or ChunkAssembler(total)
                    else:
                        self._receive_chunk(assembler, message.chunk)
                payload = assembler.payload()
                self.link.observe_transfer(len(payload), time.perf_counter() - started)
                return metas, payload
            except (grpc.RpcError, TransferError) as e:
                if isinstance(e, grpc.RpcError) and e.code() not in TRANSFER_RETRY_CODES:
                    raise
                logger.info("[Client.Download] version %d interrupted at byte %d (%s); resuming", version,
                            assembler.received if assembler else 0, e)
                failures += 1
                time.sleep(min(0.2 * 2**failures, 5.0))
        raise CoordinatorUnreachable(f"download of version {version} failed {self.transfer_attempts} times")

    def upload_gradient(self, header: pb.UploadHeader, payload: memoryview, chunk_bytes: int) -> None:
        """Upload one step's tensors, resuming from what the coordinator already holds."""
        with self._transfer():
            self._upload(header, payload, chunk_bytes)

    def _upload(self, header: pb.UploadHeader, payload: memoryview, chunk_bytes: int) -> None:
        status_request = pb.UploadStatusRequest(device_id=header.device_id, step=header.step,
                                                attempt=header.attempt)
        start, started, failures, progress = 0, time.perf_counter(), 0, 0
        while failures < self.transfer_attempts:
            failures = 0 if start > progress else failures  # an interruption after progress is not a failure
            progress = start
            header.resume_offset = start
            try:
                self._delay()
                self._stub.UploadGradient(self._upload_messages(header, payload, start, chunk_bytes), timeout=600)
                self.link.observe_transfer(len(payload) - start, time.perf_counter() - started)
                return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS and failures:
                    return  # an earlier try was accepted and only its reply was lost
                if e.code() not in TRANSFER_RETRY_CODES:
                    raise
                logger.info("[Client.Upload] step %d interrupted (%s); resuming", header.step, e.details())
                failures += 1
                time.sleep(min(0.2 * 2**failures, 5.0))
                try:
                    start = self._retrying(lambda: self._stub.GetUploadStatus(status_request, timeout=30)).received_bytes
                except grpc.RpcError as status_error:
                    if status_error.code() == grpc.StatusCode.ALREADY_EXISTS:
                        return  # the interrupted try was accepted; only its reply was lost
                    raise
                started = time.perf_counter()
        raise CoordinatorUnreachable(f"upload for step {header.step} failed {self.transfer_attempts} times")

    def _receive_chunk(self, assembler: ChunkAssembler, chunk) -> None:
        if self.shaper:
            self.shaper.after_receive(len(chunk.data))
            if self.shaper.lost(self._rng):
                raise TransferError("data_loss", f"emulated loss of the chunk at byte {chunk.offset}")
        assembler.add(chunk.offset, chunk.data, chunk.crc32)

    def _upload_messages(self, header: pb.UploadHeader, payload: memoryview, start: int,
                         chunk_bytes: int) -> Iterator[pb.UploadMessage]:
        yield pb.UploadMessage(header=header)
        for chunk in iter_chunks(payload, start=start, chunk_bytes=chunk_bytes):
            if self.shaper:
                self.shaper.before_send(len(chunk.data))
                if self.shaper.lost(self._rng):  # the stream breaks; the retry resumes from the last good byte
                    return
            yield pb.UploadMessage(chunk=serde.chunk_to_proto(chunk))


def upload_header(device_id: str, step: int, attempt: int, metas: Sequence[TensorMeta],
                  report: pb.StepReport) -> pb.UploadHeader:
    """Header of a gradient upload."""
    return pb.UploadHeader(device_id=device_id, step=step, attempt=attempt,
                           bundle=serde.header_to_proto(metas), report=report)
