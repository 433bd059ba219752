"""The board's connection to the coordinator: every RPC, retries, and resumable transfers.

Calls are retried only on UNAVAILABLE (the coordinator unreachable or restarting), with the
backoff and time budget of edgetrain.transport's RetryPolicy. Tensor transfers resume from the
last byte that arrived intact instead of starting over (edgetrain.transport): downloads ask for
chunks from that offset, uploads ask the coordinator how many bytes it holds and continue there.

With the board's fleet credentials (edge_client.credentials) the channel is mutual TLS: each try
first checks the certificate locally (an expired one stops the client in one line instead of
failing handshakes), a refusal as revoked raises CredentialRevoked (never retried), and the
channel reopens when the certificate was renewed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import psutil

import edgetrain
from edge_client.credentials import BoardCredentials, trusted_calls
from edge_client.telemetry import LinkMeter
from edgetrain import serde, transport
from edgetrain.board_hardware import LinkShaping
from edgetrain.config import ConfigError
from edgetrain.errors import Refusal
from edgetrain.streaming import RawChunk, TensorMeta, TransferError, UploadAbandoned, iter_chunks
from edgetrain.telemetry import TelemetrySample
from edgetrain.work import Assignment, BoardJob, BoardProfile, Finished, StepReport
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # torch stays out of the command line's imports
    from edge_client.streamed import StreamedUpdate

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CoordinatorUnreachable(ConnectionError):
    """The coordinator stayed unavailable for longer than the retry budget."""


CALLS = transport.RetryPolicy(budget_s=10.0, max_s=2.0)
"""A board's call is retried this long on UNAVAILABLE (at most 2 s apart); then the client's outage loop takes over
(edge_client.main.Outage: it keeps trying, and looks over mDNS), so a restarted coordinator is
found again however long it was away."""


class RegistrationRefused(ConfigError):
    """The coordinator refused this board for what it runs (another protocol version, a torch
    older than EdgeTrain supports): one line saying which."""


class CoordinatorConnection:
    """A channel to one coordinator with typed, retrying calls (edgetrain.transport); mutual TLS
    with `credentials` (the board's fleet identity), plaintext without (`--insecure`)."""

    def __init__(self, address: str, *, retry: transport.RetryPolicy = CALLS,
                 transfers: transport.RetryPolicy = transport.TRANSFERS, shaper: LinkShaping | None = None,
                 link: LinkMeter | None = None, credentials: BoardCredentials | None = None) -> None:
        self.address = address
        self.retry = retry
        """Calls are retried on UNAVAILABLE within this policy's budget."""
        self.transfers = transfers
        """Downloads and uploads resume from the last good byte within this policy's budget."""
        self.shaper = shaper
        """Application-level link emulation (rate, delay, loss), or None for the real link."""
        self.link = link or LinkMeter()
        """Bandwidth and RTT measured on this connection."""
        self._rng = random.Random()
        self._active = 0
        self._active_lock = threading.Lock()
        self.credentials = credentials
        """The board's fleet credentials (None: plaintext)."""
        self._security = credentials.gateway() if credentials else transport.INSECURE
        self._checksum = not self._security.secure
        """Whether uploaded chunks carry crc32s (TLS authenticates every byte already)."""
        self._channel_lock = threading.Lock()
        self._generation = self._security.generation
        self._channel = transport.open_channel(address, self._security)
        self._retired: list[grpc.Channel] = []
        self._closed = False
        self._coordinator = pb_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        """Close the channel (and those of earlier certificates)."""
        with self._channel_lock:
            self._closed = True
            for channel in (self._channel, *self._retired):
                channel.close()
            self._retired.clear()

    @property
    def _stub(self) -> pb_grpc.CoordinatorStub:
        """The stub on the current channel: a renewed certificate opens a new one (calls in flight
        finish on the old one, closed with the connection)."""
        with self._channel_lock:
            if self._generation != self._security.generation and not self._closed:
                self._retired.append(self._channel)
                self._generation = self._security.generation
                self._channel = transport.open_channel(self.address, self._security)
                self._coordinator = pb_grpc.CoordinatorStub(self._channel)
            return self._coordinator

    def _check(self) -> None:
        """Before each try of a call: the certificate must still hold."""
        if self.credentials is not None:
            self.credentials.check()

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

    def _retrying(self, call: Callable[[], T], what: str) -> T:
        def attempt() -> T:
            self._check()
            return call()

        try:
            with trusted_calls(self.credentials):
                return self.retry.call(attempt, f"{what} at {self.address}")
        except transport.Unreachable as e:
            raise CoordinatorUnreachable(str(e)) from e

    def register(self, name: str, emulated_speed: float | None, stage_address: str) -> tuple[str, BoardJob]:
        """Join the coordinator's job as board `name`; returns the device id and the job."""
        request = registration(name, emulated_speed, stage_address)
        try:
            reply = self._retrying(lambda: self._stub.Register(request, timeout=30), "Register")
        except grpc.RpcError as e:
            if transport.error_reason(e) in (Refusal.PROTOCOL_MISMATCH, Refusal.SOFTWARE_UNSUPPORTED):
                raise RegistrationRefused(f"the coordinator at {self.address} refused this board: {e.details()}") \
                    from None
            raise
        if self.credentials is not None and self.credentials.pair_started is not None:
            logger.info("[Client] %s registered with the coordinator %.2f s after it started pairing", name,
                        time.perf_counter() - self.credentials.pair_started)
            self.credentials.pair_started = None
        return reply.device_id, serde.board_job_from_proto(reply.job)

    def report_profile(self, device_id: str, profile: BoardProfile) -> None:
        """Send the join-time profile."""
        report = serde.profile_to_proto(device_id, profile)
        self._retrying(lambda: self._stub.ReportProfile(report, timeout=30), "ReportProfile")

    def heartbeat(self, device_id: str, telemetry: TelemetrySample | None = None) -> tuple[int, int] | None:
        """One liveness ping with a telemetry sample (no retry: the next one follows soon); returns
        the coordinator's newest (step, attempt), if it opened one."""
        started = time.perf_counter()
        self._delay()
        request = pb.HeartbeatRequest(device_id=device_id,
                                      telemetry=serde.telemetry_to_proto(telemetry) if telemetry else None)
        with trusted_calls(self.credentials):
            reply = self._stub.Heartbeat(request, timeout=10)
        self.link.observe_rtt(time.perf_counter() - started)
        return (reply.newest_step, reply.newest_attempt) if reply.HasField("newest_step") else None

    def attach(self, device_id: str):
        """Open the board's presence stream: an iterator of (newest step, attempt) or None, which
        ends when the coordinator drops the board or finishes; `.cancel()` closes it. While it is
        open, the coordinator notices at once when this process or its connection dies."""
        with trusted_calls(self.credentials):
            call = self._stub.Attach(pb.AttachRequest(device_id=device_id))
        return call

    def probe(self, device_id: str, payload: bytes) -> None:
        """Send `payload` to the coordinator and wait for the acknowledgement (a link probe)."""
        self._delay()
        if self.shaper:
            self.shaper.before_send(len(payload))
        with trusted_calls(self.credentials):
            self._stub.Probe(pb.ProbeRequest(device_id=device_id, payload=payload), timeout=60)

    def list_devices(self) -> pb.ListDevicesReply:
        """The coordinator's view of its boards."""
        return self._retrying(lambda: self._stub.ListDevices(pb.ListDevicesRequest(), timeout=10), "ListDevices")

    def _delay(self) -> None:
        if self.shaper:
            self.shaper.rpc_delay()

    def get_work(self, device_id: str, max_wait_s: float) -> Assignment | Finished | None:
        """Long-poll for work: an assignment, the end of the job, or None (nothing yet)."""
        request = pb.WorkRequest(device_id=device_id, max_wait_s=max_wait_s)
        return serde.work_from_proto(self._retrying(lambda: self._stub.GetWork(request, timeout=max_wait_s + 30),
                                                    "GetWork"))

    def report_failure(self, device_id: str, step: int, attempt: int, kind: int, reason: str) -> None:
        """Tell the coordinator this board cannot complete (step, attempt), and why."""
        self._retrying(lambda: self._stub.ReportFailure(pb.FailureReport(
            device_id=device_id, step=step, attempt=attempt, kind=int(kind), reason=reason), timeout=30),
            "ReportFailure")

    def download_parameters(self, device_id: str, version: int, base_version: int | None = None,
                            prefixes: Sequence[str] = (),
                            channels: tuple[float, float] | None = None,
                            on_progress: Callable[[list[TensorMeta], bytearray, int], None] | None = None,
                            ) -> tuple[list[TensorMeta], bytearray]:
        """Parameters of `version` (or the deltas since `base_version`, or only the tensors named
        with `prefixes`, and of split layers only the rows of a channel group member's share
        `channels`), resuming an interrupted stream from the last good byte; `on_progress` is
        told as the bytes arrive (transport.receive_bundle)."""
        begin, end = channels if channels is not None else (0.0, 0.0)

        def open_stream(offset: int) -> Iterator[pb.ParameterMessage]:
            self._check()
            self._delay()
            return self._stub.DownloadParameters(pb.ParameterRequest(
                device_id=device_id, version=version, offset=offset, base_version=base_version,
                prefixes=list(prefixes), channel_split=channels is not None, channel_begin=begin,
                channel_end=end), timeout=600)

        with self._transfer():
            started = time.perf_counter()
            try:
                with trusted_calls(self.credentials):
                    metas, payload = transport.receive_bundle(open_stream, f"download of version {version}",
                                                              retry=self.transfers, on_chunk=self._receive_chunk,
                                                              on_progress=on_progress)
            except transport.Unreachable as e:
                raise CoordinatorUnreachable(str(e)) from e
            self.link.observe_transfer(len(payload), time.perf_counter() - started)
            return metas, payload

    def upload(self, device_id: str, work: Assignment, metas: Sequence[TensorMeta], payload: memoryview,
               report: StepReport, chunk_bytes: int) -> None:
        """Upload one step's tensors and report, resuming from what the coordinator already holds."""
        self._send_update(device_id, work, metas, report, len(payload), lambda start: iter_chunks(
            payload, start=start, chunk_bytes=chunk_bytes, checksum=self._checksum))

    def upload_streamed(self, device_id: str, work: Assignment, update: StreamedUpdate, chunk_bytes: int) -> None:
        """Upload an update while it is being computed: the header now, each chunk once backward
        made it final, the report last (edge_client.streamed); resumes like `upload`.
        UploadAbandoned when the update is abandoned."""
        self._send_update(device_id, work, update.metas, None, update.nbytes,
                          lambda start: update.chunks(start, chunk_bytes, checksum=self._checksum), update)

    def _send_update(self, device_id: str, work: Assignment, metas: Sequence[TensorMeta], report: StepReport | None,
                     nbytes: int, chunks: Callable[[int], Iterator[RawChunk]],
                     streamed: StreamedUpdate | None = None) -> None:
        header = serde.upload_header_to_proto(device_id, work.step, work.attempt, metas, report)
        status = pb.UploadStatusRequest(device_id=device_id, step=work.step, attempt=work.attempt)
        started, sent_from = time.perf_counter(), [0]

        def send_from(start: int) -> None:
            if streamed is not None and streamed.abandoned:
                raise UploadAbandoned()
            self._check()
            self._delay()
            header.resume_offset, sent_from[0] = start, start
            # a streamed upload is open while the board computes: its deadline covers that too
            self._stub.UploadGradient(self._upload_messages(header, chunks(start), streamed),
                                      timeout=600 if streamed is None else 3600)

        def held() -> int:
            return self._retrying(lambda: self._stub.GetUploadStatus(status, timeout=30), "GetUploadStatus"
                                  ).received_bytes

        with self._transfer():
            try:
                with trusted_calls(self.credentials):
                    transport.send_bundle(send_from, held, f"upload for step {header.step}", retry=self.transfers)
            except transport.Unreachable as e:
                raise CoordinatorUnreachable(str(e)) from e
            if streamed is None:  # a streamed upload's time is mostly compute's: it says nothing of the link
                self.link.observe_transfer(nbytes - sent_from[0], time.perf_counter() - started)

    def _receive_chunk(self, chunk) -> None:
        if self.shaper:
            self.shaper.after_receive(len(chunk.data))
            if self.shaper.lost(self._rng):
                raise TransferError("data_loss", f"emulated loss of the chunk at byte {chunk.offset}")

    def _upload_messages(self, header: pb.UploadHeader, chunks: Iterator[RawChunk],
                         streamed: StreamedUpdate | None) -> Iterator[pb.UploadMessage]:
        yield pb.UploadMessage(header=header)
        try:
            for chunk in chunks:
                if self.shaper:
                    self.shaper.before_send(len(chunk.data))
                    if self.shaper.lost(self._rng):  # the stream breaks; the retry resumes from the last good byte
                        return
                yield pb.UploadMessage(chunk=serde.chunk_to_proto(chunk))
            if streamed is not None:
                yield pb.UploadMessage(report=serde.step_report_to_proto(streamed.report()))
        except UploadAbandoned:  # the stream ends short, without a report: nothing is accepted
            return


def registration(name: str, emulated_speed: float | None, stage_address: str) -> pb.RegisterRequest:
    """This board's registration: description, software and protocol version."""
    return pb.RegisterRequest(stage_address=stage_address,
        device=pb.DeviceInfo(name=name, hostname=socket.gethostname(), arch=platform.machine(),
                             os=platform.platform(), cpu_count=os.cpu_count() or 0,
                             memory_total_bytes=psutil.virtual_memory().total,
                             emulated_speed=emulated_speed or 0.0),
        versions=pb.SoftwareVersions(edgetrain=edgetrain.__version__, python=sys.version.split()[0],
                                     torch=_torch_version(), grpcio=grpc.__version__),
        protocol_version=edgetrain.PROTOCOL_VERSION)


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return ""
