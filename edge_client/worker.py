"""The data-parallel shard runtime: join, profile, then compute updates for assigned samples.

An update is the gradient of the assigned samples (or, in a federated round, the parameter
change of local training), encoded with the codec the coordinator chose for this board's link;
with a lossy codec, what was not sent is kept (error feedback) and added to the next update
once the upload succeeded. Parameters arrive in full, or as the compressed deltas since the
version the board holds; either way the board keeps the coordinator's served view exactly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import psutil
import torch

import edgetrain
from edge_client.connection import CoordinatorConnection, upload_header
from edge_client.emulation import BoardEmulation
from edge_client.endpoint import StageEndpoint, StageFailure
from edge_client.profiler import profile_device
from edge_client.stage import run_stage
from edge_client.stage_state import StageStateError
from edge_client.telemetry import TelemetryCollector, probe_link
from edgetrain import serde, transport
from edgetrain.compression import ErrorFeedback
from edgetrain.data import load_dataset, make_batch
from edgetrain.emulator.throttle import CpuLimiter
from edgetrain.errors import FailureKind, Refusal
from edgetrain.models import build_model
from edgetrain.pipeline import stage_parameter_prefixes
from edgetrain.streaming import TransferError, check_metas
from edgetrain.tensors import pack, unpack
from edgetrain.training import (
    GRAD_PREFIX,
    compute_shard,
    freeze_heap,
    load_state_tensors,
    local_train,
    shard_tensor_names,
    state_tensors,
)
from edgetrain.updates import DeltaFormat, UpdateFormats
from protos import coordinator_pb2 as pb

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(kw_only=True, frozen=True)
class ClientOptions:
    """How this board joins and where it keeps its data."""

    name: str
    """Device name shown by the coordinator (unique per board)."""
    data_dir: str = "data"
    """Where the local copy of the dataset lives."""
    download: bool = False
    """Download the dataset if missing (needs internet)."""
    emulated_speed: float | None = None
    """Fraction of one core this board emulates (None: a real board at full speed)."""
    poll_s: float = 10.0
    """Longest a work poll waits on the coordinator."""
    board_file: str | None = None
    """Board file of an emulated board (speed, link, battery), written by `edgetrain fleet`."""
    probe_interval_s: float = 30.0
    """How often the link is probed when no large transfer measured it recently."""
    power_w: tuple[float, float] | None = None
    """(idle, busy) power draw in watts, for energy accounting on a real board."""
    stage_bind: str = "0.0.0.0:0"
    """Where the board serves pipeline traffic from its neighbours (port 0: any free port)."""


class BatteryEmpty(Exception):
    """The emulated battery is flat."""


class Rejoin(Exception):
    """The coordinator no longer knows this device: register and profile again."""


BATTERY_EMPTY = "battery empty"
"""What `run` returns when the emulated battery ran flat and the board shut down."""


def stage_address(coordinator: str, port: int) -> str:
    """host:port where neighbours reach this board: the local address on the route to the coordinator."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            local = probe.getsockname()[0]
        except OSError:
            local = "127.0.0.1"
    return f"{local}:{port}"


def device_info(options: ClientOptions, stage: str = "") -> pb.RegisterRequest:
    """This board's registration: description, software and protocol version."""
    return pb.RegisterRequest(stage_address=stage,
        device=pb.DeviceInfo(name=options.name, hostname=socket.gethostname(), arch=platform.machine(),
                             os=platform.platform(), cpu_count=os.cpu_count() or 0,
                             memory_total_bytes=psutil.virtual_memory().total,
                             emulated_speed=options.emulated_speed or 0.0),
        versions=pb.SoftwareVersions(edgetrain=edgetrain.__version__, python=sys.version.split()[0],
                                     torch=torch.__version__, grpcio=grpc.__version__),
        protocol_version=edgetrain.PROTOCOL_VERSION)


def _rejoin_if_forgotten(call: Callable[[], T]) -> T:
    """Run an RPC; a refusal as an unknown device (the coordinator dropped it) becomes Rejoin."""
    try:
        return call()
    except grpc.RpcError as e:
        if transport.error_reason(e) == Refusal.UNKNOWN_DEVICE:
            raise Rejoin() from e
        raise


class EdgeWorker:
    """Runs one board's part of a job — data-parallel shards, federated rounds, pipeline stages —
    until the coordinator says it is finished."""

    def __init__(self, conn: CoordinatorConnection, options: ClientOptions, limiter: CpuLimiter,
                 emulation: BoardEmulation) -> None:
        self.conn = conn
        self.options = options
        self.limiter = limiter
        self.emulation = emulation
        self.telemetry = TelemetryCollector(link=conn.link, emulated_speed=options.emulated_speed,
                                            battery=emulation.read_battery, energy_j=emulation.energy.energy_j,
                                            power_w=emulation.energy.power_w)
        self.device_id = ""
        self._job: pb.JobSpec | None = None
        self._model: torch.nn.Module | None = None
        self._dataset = None
        self._version = -1
        self._view: dict[str, torch.Tensor] = {}
        self._loaded = -1
        self._formats: UpdateFormats | None = None
        self._deltas: dict[str, DeltaFormat] = {}
        self._feedback = ErrorFeedback()
        self._velocity: dict[str, torch.Tensor] = {}
        self._abandoned: tuple[int, int] | None = None
        self.endpoint: StageEndpoint | None = None
        """This board's pipeline peer endpoint (started on the first run)."""
        self._stage_loaded: tuple[int, int, int] | None = None
        self._lost = threading.Event()
        self._energy_mark: float | None = None
        self._timings: tuple[tuple[int, float], ...] = ()

    def run(self) -> str:
        """Work until the job finishes; returns the coordinator's reason."""
        if self.endpoint is None:
            self.endpoint = StageEndpoint(self.options.stage_bind, shaper=self.conn.shaper)
        while True:
            reply = self.conn.register(device_info(self.options, stage_address(self.conn.address, self.endpoint.port)))
            self.device_id, self._lost = reply.device_id, threading.Event()
            stop_beat = threading.Event()
            threading.Thread(target=self._heartbeats, daemon=True,
                             args=(reply.job.heartbeat_interval_s, stop_beat, self._lost)).start()
            try:
                self._prepare(reply.job)
                return self._work_loop()
            except BatteryEmpty:
                logger.error("[Client] %s: battery empty; the board shuts down", self.device_id)
                return BATTERY_EMPTY
            except Rejoin:
                logger.warning("[Client] coordinator forgot %s; joining again", self.device_id)
                # the coordinator may have restarted: what this board holds may not be its view
                self._version, self._loaded, self._view, self._feedback = -1, -1, {}, ErrorFeedback()
                self._velocity = {}
                self._stage_loaded = None
                self.endpoint.mailbox.reset()  # owned stage state stays: the coordinator may pull it
            finally:
                stop_beat.set()

    def _prepare(self, job: pb.JobSpec) -> None:
        """Set up the job's model and data (once per job), profile, and report the profile."""
        if self._job is None or self._job.SerializeToString() != job.SerializeToString():
            self._setup(job)
        report = pb.ProfileReport(device_id=self.device_id, timings=[
            pb.BatchTiming(batch_size=b, seconds=s) for b, s in self._timings])
        report.memory_total_bytes, report.memory_available_bytes, report.peak_rss_bytes = self._memory
        _rejoin_if_forgotten(lambda: self.conn.report_profile(report))
        logger.info("[Client] %s joined job %s (%s); profile %s", self.device_id, job.job_id, job.model,
                    ", ".join(f"b={b}: {s * 1000:.0f} ms" for b, s in self._timings))

    def _setup(self, job: pb.JobSpec) -> None:
        self._job, self._version, self._loaded, self._view = job, -1, -1, {}
        self._stage_loaded = None
        if self.endpoint is not None:
            self.endpoint.mailbox.reset()
        self._deltas, self._feedback, self._velocity = {}, ErrorFeedback(), {}
        spec = serde.dataset_from_proto(job.dataset, data_dir=self.options.data_dir,
                                        download=self.options.download)
        self._dataset = load_dataset(spec, train=True)
        self._model = build_model(job.model, num_classes=job.num_classes)
        self._formats = UpdateFormats(shard_tensor_names(self._model))
        profile = profile_device(self._model, self._dataset, list(job.profile_batch_sizes), self.limiter,
                                 max_forward_batch=job.max_forward_batch)
        self._timings = profile.timings
        self._memory = (profile.memory_total_bytes, profile.memory_available_bytes, profile.peak_rss_bytes)
        if self.endpoint is not None:
            self.endpoint.state.attach(self._model, job.job_id)
        freeze_heap()

    def _heartbeats(self, interval_s: float, stop: threading.Event, lost: threading.Event) -> None:
        """Heartbeats with telemetry for one registration; `lost` is set when it is forgotten."""
        beat = threading.Event()
        threading.Thread(target=self._probes, args=(beat, stop, lost), daemon=True).start()
        while not stop.wait(interval_s):
            try:
                self.emulation.refresh()
                reply = self.conn.heartbeat(self.device_id, serde.telemetry_to_proto(self.telemetry.sample()))
                beat.set()  # a probe, if one is due, runs now: between heartbeats, not across one
                if reply.HasField("newest_step") and self.endpoint is not None:
                    self.endpoint.mailbox.supersede(reply.newest_step, reply.newest_attempt)
            except grpc.RpcError as e:
                if transport.error_reason(e) == Refusal.UNKNOWN_DEVICE:
                    lost.set()
                    return
                logger.debug("[Client.Heartbeat] failed", exc_info=True)

    def _probes(self, beat: threading.Event, stop: threading.Event, lost: threading.Event) -> None:
        """Link probes when no large transfer measured the link lately, each started just after a
        heartbeat; in their own thread, so a probe over a slow link (seconds) never holds a
        heartbeat back."""
        last_probe = 0.0
        while not stop.is_set() and not lost.is_set():
            if not beat.wait(1.0):
                continue
            beat.clear()
            if self.conn.link.age_s() > self.options.probe_interval_s and not self.conn.transferring and (
                    time.monotonic() - last_probe > self.options.probe_interval_s):
                try:
                    probe_link(lambda payload: self.conn.probe(self.device_id, payload), self.conn.link)
                except grpc.RpcError:
                    logger.debug("[Client.Probe] failed", exc_info=True)
                last_probe = time.monotonic()

    def _work_loop(self) -> str:
        while True:
            if self._lost.is_set():
                raise Rejoin()
            if self.emulation.battery_empty:
                raise BatteryEmpty()
            work = _rejoin_if_forgotten(lambda: self.conn.get_work(self.device_id, self.options.poll_s))
            kind = work.WhichOneof("work")
            if kind == "finished":
                logger.info("[Client] job finished: %s", work.finished.reason)
                return work.finished.reason
            if kind == "step":
                self._do_step(work.step)

    def _do_step(self, work: pb.StepWork) -> None:
        """One assignment; a refusal (stale version, closed step) only abandons this step."""
        try:
            if self.endpoint is not None:
                self.endpoint.mailbox.advance(work.step, work.attempt)
            with self.emulation.energy.busy():
                compute = self._compute_stage if work.HasField("stage") else self._compute_step
                # one computation on the model at a time: the coordinator's LoadState / PullState
                # of an owned stage wait for it (they first end superseded attempts)
                with self._model_lock():
                    header, payload, commit = compute(work)
                energy = self.emulation.energy.energy_j()
                if energy is not None and self._energy_mark is not None:
                    header.report.energy_j = energy - self._energy_mark
                self._energy_mark = energy
                started = time.perf_counter()
                self.conn.upload_gradient(header, payload, self._job.chunk_bytes)
                commit()
            report = header.report
            self.telemetry.last_step = (report.compute_s, report.download_s + report.encode_s
                                        + time.perf_counter() - started)
        except StageFailure as e:
            logger.warning("[Client.Stage] step %d attempt %d given up: %s", work.step, work.attempt, e)
            try:
                self.conn.report_failure(self.device_id, work.step, work.attempt, e.kind, str(e))
            except grpc.RpcError as report_error:
                logger.info("[Client.Stage] failure report refused: %s", report_error.details())
        except grpc.RpcError as e:
            if transport.error_reason(e) == Refusal.UNKNOWN_DEVICE:
                raise Rejoin() from e
            logger.warning("[Client.Step] step %d abandoned: %s %s", work.step, e.code().name, e.details())
            if self._abandoned == (work.step, work.attempt):  # the same work again: do not spin
                time.sleep(1.0)
            self._abandoned = (work.step, work.attempt)

    def _model_lock(self):
        return self.endpoint.state.lock if self.endpoint is not None else contextlib.nullcontext()

    def _compute_step(self, work: pb.StepWork):
        """Fetch parameters if needed, compute the update, encode it; returns (header, payload, commit)."""
        started = time.perf_counter()
        if self.endpoint is not None:  # the full view replaces an owned stage (the coordinator took it back)
            self.endpoint.state.drop()
        self._fetch(work)
        if self._loaded != self._version:  # also after a forward pass moved BN running stats
            load_state_tensors(self._model, self._view)
            self._loaded = self._version
        download_s = time.perf_counter() - started
        started = time.perf_counter()
        with self.limiter.working():
            x, y = make_batch(self._dataset, list(work.indices), augment=work.augment, seed=work.data_seed,
                              step=work.step)
            if work.HasField("local"):
                local = work.local
                result = local_train(self._model, x, y, steps=local.steps, batch_size=local.batch_size, lr=local.lr,
                                     momentum=local.momentum, weight_decay=local.weight_decay,
                                     prox_mu=local.prox_mu)
            else:
                result = compute_shard(self._model, x, y, self._job.max_forward_batch)
        compute_s = time.perf_counter() - started
        self._loaded = -1 if work.HasField("local") or self._has_running_stats() else self._loaded
        started = time.perf_counter()
        fmt = self._formats(work.codec)
        tensors = self._with_momentum(result.tensors)
        wire, commit_feedback = fmt.encode(tensors, self._feedback if self._job.error_feedback else None)

        def commit() -> None:
            commit_feedback()
            self._mask_sent_momentum(wire)
        metas, payload = pack(wire)
        report = pb.StepReport(samples=result.samples, loss=result.loss, correct=result.correct,
                               compute_s=compute_s, download_s=download_s,
                               encode_s=time.perf_counter() - started)
        return upload_header(self.device_id, work.step, work.attempt, metas, report), payload, commit

    def _compute_stage(self, work: pb.StepWork):
        """Run this board's pipeline stage for the step; returns (header, payload, commit).

        An owned stage (StageWork.owned) runs on the state this board holds and uploads no
        gradients; otherwise the stage's parameters are downloaded and their gradients uploaded."""
        st = work.stage
        started = time.perf_counter()
        state = self.endpoint.state
        if st.owned:
            with state.lock:
                try:
                    state.begin(work.step, st.first_block, st.end_block, st.commit_step, st.commit_attempt)
                except StageStateError as e:
                    raise StageFailure(FailureKind.STAGE_STATE, str(e)) from None
                self._version, self._loaded, self._view, self._stage_loaded = -1, -1, {}, None  # the view is gone
                try:
                    result = run_stage(self._model, work, self._dataset, self.endpoint, self.device_id,
                                       self._job.job_id, self.limiter, self._job.max_forward_batch)
                except BaseException:
                    state.abandon()
                    raise
                try:
                    state.finish(work.step, work.attempt, st.lr)
                except StageStateError as e:
                    raise StageFailure(FailureKind.STAGE_STATE, str(e)) from None
            compute_s = time.perf_counter() - started - result.wait_s
            prefixes: tuple[str, ...] = ()  # nothing of the stage goes up
            download_s = 0.0
        else:
            state.drop()
            loaded = (work.param_version, st.first_block, st.end_block)
            prefixes = stage_parameter_prefixes(self._model.block_names, st.first_block, st.end_block)
            if self._stage_loaded != loaded:
                metas, payload = self.conn.download_parameters(self.device_id, work.param_version,
                                                               prefixes=list(prefixes))
                load_state_tensors(self._model, unpack(metas, payload))
                self._stage_loaded, self._version, self._loaded, self._view = loaded, -1, -1, {}  # the view is gone
            download_s = time.perf_counter() - started
            started = time.perf_counter()
            result = run_stage(self._model, work, self._dataset, self.endpoint, self.device_id, self._job.job_id,
                               self.limiter, self._job.max_forward_batch)
            compute_s = time.perf_counter() - started - result.wait_s
            self._stage_loaded = None if self._has_running_stats() else self._stage_loaded
        started = time.perf_counter()
        fmt = self._formats(work.codec, prefixes)
        wire, commit = fmt.encode({} if st.owned else result.shard.tensors, None)
        metas, payload = pack(wire)
        shard = result.shard
        report = pb.StepReport(samples=shard.samples, loss=shard.loss, correct=shard.correct, compute_s=compute_s,
                               download_s=download_s, encode_s=time.perf_counter() - started, wait_s=result.wait_s,
                               peak_activation_bytes=result.peak_activation_bytes, peer_bytes=result.peer_bytes)
        return upload_header(self.device_id, work.step, work.attempt, metas, report), payload, commit

    def _with_momentum(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Momentum correction: u <- m u + g per gradient, sent in place of g (when the job asks)."""
        m = self._job.board_momentum
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

    def _has_running_stats(self) -> bool:
        return any(b.is_floating_point() for b in self._model.buffers())

    def _fetch(self, work: pb.StepWork) -> None:
        """Bring the served view to `work.param_version`: deltas when offered and possible, else full."""
        version = work.param_version
        if version == self._version:
            return
        if work.delta_codec and 0 <= self._version < version:
            deltas = self._deltas.get(work.delta_codec)
            if deltas is None:
                deltas = self._deltas[work.delta_codec] = DeltaFormat(state_tensors(self._model), work.delta_codec)
            try:
                metas, payload = self.conn.download_parameters(self.device_id, version, base_version=self._version)
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
        metas, payload = self.conn.download_parameters(self.device_id, version)
        self._view = unpack(metas, payload)
        self._version = version
