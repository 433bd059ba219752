"""The board runtime: join, profile, heartbeat, then work through the assignments of a job.

Each assignment is a data-parallel shard or federated round (edge_client.shard) or a pipeline
stage (edge_client.stage); the worker runs it, uploads the update with its report, and says why
when it gives a step up. It speaks the core's work types (edgetrain.work); the connection turns
them into wire messages.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import grpc

from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edge_client.dataset import board_dataset
from edge_client.endpoint import StageEndpoint, StageFailure
from edge_client.local_data import LocalData, LocalDataError, LocalDataGone
from edge_client.profiler import profile_device
from edge_client.shard import ShardRunner, Update
from edge_client.stage import StageRunner
from edge_client.streamed import StreamedUpdate
from edge_client.telemetry import TelemetryCollector, probe_link
from edgetrain import transport, trust
from edgetrain.board_hardware import BoardHardware
from edgetrain.config import ConfigError
from edgetrain.errors import FailureKind, Refusal
from edgetrain.models import build_model
from edgetrain.streaming import TransferError, UploadAbandoned
from edgetrain.training import freeze_heap, resolve_device, runtime
from edgetrain.work import Assignment, BoardJob, BoardProfile, Finished

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
    probe_interval_s: float = 30.0
    """How often the link is probed when no large transfer measured it recently."""
    power_w: tuple[float, float] | None = None
    """(idle, busy) power draw in watts, for energy accounting on a real board."""
    stage_bind: str = "0.0.0.0:0"
    """Where the board serves pipeline traffic from its neighbours (port 0: any free port); with
    fleet credentials only the gateway and the boards of the current plan get through."""
    identity: Path | None = None
    """Where the board keeps its fleet key and certificate (None: ~/.edgetrain/boards/NAME)."""
    join_token: str | None = None
    """A join token to pair with when the board has no usable certificate yet."""
    insecure: bool = False
    """Plaintext and unauthenticated, for an `--insecure` coordinator (loopback experiments)."""
    pair_address: str | None = None
    """Where the gateway pairs boards (None: the port after the coordinator's)."""
    give_up_after_s: float | None = None
    """How long to keep trying to reach a coordinator that went away (None: until it answers)."""
    local_data: str | None = None
    """An image folder on the board that it trains on alone; its images never leave it
    (edge_client.local_data)."""
    deterministic: bool = False
    """A GPU board computes without TF32 and with deterministic kernels (edgetrain.training.exact_arithmetic)."""


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

    def __init__(self, conn: CoordinatorConnection, options: ClientOptions, hardware: BoardHardware,
                 local: LocalData | None = None) -> None:
        self.conn = conn
        self.options = options
        self.local = local
        """The board's own images, decoded (None: it trains on the job's dataset)."""
        self.hardware = hardware
        """The machine it computes on: throttle, memory, link, battery, energy."""
        self.telemetry = TelemetryCollector(link=conn.link, emulated_speed=options.emulated_speed,
                                            battery=hardware.read_battery, energy_j=hardware.energy.energy_j,
                                            energy_measured=lambda: hardware.energy.measured,
                                            power_w=hardware.energy.power_w,
                                            memory=lambda: hardware.memory.reading())
        self.device_id = ""
        self.endpoint: StageEndpoint | None = None
        """This board's pipeline peer endpoint (started on the first run)."""
        self._job: BoardJob | None = None
        self._profile: BoardProfile | None = None
        self._shards: ShardRunner | None = None
        self._stages: StageRunner | None = None
        self._abandoned: tuple[int, int] | None = None
        self._lost = threading.Event()
        self._energy_mark: tuple[float, bool] | None = None
        """(energy used, whether measured) at the last step's upload."""

    def run(self) -> str:
        """Work until the job finishes; returns the coordinator's reason."""
        if self.endpoint is None:
            credentials = self.conn.credentials.credentials if self.conn.credentials else None
            self.endpoint = StageEndpoint(self.options.stage_bind, shaper=self.conn.shaper, credentials=credentials)
        while True:
            self.device_id, job = self.conn.register(self.options.name, self.options.emulated_speed,
                                                     stage_address(self.conn.address, self.endpoint.port))
            self._lost = threading.Event()
            stop_beat = threading.Event()
            threading.Thread(target=self._heartbeats, daemon=True,
                             args=(job.heartbeat_interval_s, stop_beat, self._lost)).start()
            presence = self._attend(self._lost)
            try:
                self._prepare(job)
                return self._work_loop()
            except BatteryEmpty:
                logger.error("[Client] %s: battery empty; the board shuts down", self.device_id)
                return BATTERY_EMPTY
            except Rejoin:
                logger.warning("[Client] coordinator forgot %s; joining again", self.device_id)
                # the coordinator may have restarted: what this board holds may not be its view
                self._shards.forget()
                self._stages.invalidate()
                self.endpoint.reset()  # owned stage state stays: the coordinator may pull it
            finally:
                stop_beat.set()
                if presence is not None:
                    presence.cancel()

    def _attend(self, lost: threading.Event):
        """Hold this registration's presence stream open (the coordinator notices at once when it
        breaks) and give up older pipeline attempts as it announces newer ones. When the stream
        breaks while the coordinator is unreachable, the coordinator no longer counts this board:
        `lost` is set, and the work loop registers again once it reaches the coordinator. Returns
        the call (cancelled when the registration ends), or None if it could not be opened."""
        try:
            call = self.conn.attach(self.device_id)
        except (grpc.RpcError, trust.TrustError, ValueError):
            return None

        def follow() -> None:
            try:
                for event in call:
                    if event.HasField("newest_step"):
                        self.endpoint.mailbox.supersede(event.newest_step, event.newest_attempt)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:  # not closed by us: the connection broke
                    logger.info("[Client] %s: presence stream broke (%s)", self.device_id, transport.describe(e))
                    lost.set()

        threading.Thread(target=follow, daemon=True, name=f"presence-{self.device_id}").start()
        return call

    def _prepare(self, job: BoardJob) -> None:
        """Set up the job's model and data (once per job), profile, and report the profile."""
        if self._job != job:
            self._setup(job)
        try:
            _rejoin_if_forgotten(lambda: self.conn.report_profile(self.device_id, self._profile))
        except grpc.RpcError as e:
            if self.local is not None and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LocalDataError(f"the coordinator refused this board's own data: {e.details()}") from None
            raise
        self._step_energy()  # the first step's energy counts from here
        logger.info("[Client] %s joined job %s (%s); profile %s", self.device_id, job.job_id, job.model,
                    ", ".join(f"b={b}: {s * 1000:.0f} ms" for b, s in self._profile.timings))

    def _setup(self, job: BoardJob) -> None:
        self._job = job
        self.endpoint.reset()
        if self.local is not None:  # its own images, labelled with the job's classes (or refused here)
            dataset = self.local.for_job(job.class_names)
        else:  # the job's dataset: fetched from the coordinator when the board has no copy
            dataset = board_dataset(job.dataset, train=True, data_dir=self.options.data_dir,
                                    download=self.options.download, connection=lambda: self.conn)
        try:  # the job's device: profiled there like any other, so the split follows
            device = resolve_device(job.device)
        except ValueError as e:
            raise ConfigError(f"job {job.job_id}: {e}") from None
        model = build_model(job.model, num_classes=job.num_classes or 10).to(device)
        logger.info("[Client] %s trains job %s with %s (job device %s)", self.options.name, job.job_id, runtime(device),
                    job.device)
        self._profile = profile_device(model, dataset, list(job.profile_batch_sizes), self.hardware.throttle,
                                       max_forward_batch=job.max_forward_batch,
                                       memory=self.hardware.memory.reading)
        if self.local is not None:  # what leaves the board about its data: the count (and per class)
            counts = self.local.class_counts(job.class_names) if job.share_class_counts else ()
            self._profile = replace(self._profile, local_samples=self.local.samples, local_class_counts=counts)
            logger.info("[Client] %s trains on its own %d images (%s); they stay on this board", self.options.name,
                        self.local.samples, "class counts shared" if counts else "class counts not shared")
        self._shards = ShardRunner(model, dataset, job, self.hardware.throttle)
        self._stages = StageRunner(model, dataset, job, self.endpoint, self.hardware.throttle)
        self.endpoint.state.attach(model, job.job_id)
        freeze_heap()

    def _heartbeats(self, interval_s: float, stop: threading.Event, lost: threading.Event) -> None:
        """Heartbeats with telemetry for one registration; `lost` is set when it is forgotten."""
        beat = threading.Event()
        threading.Thread(target=self._probes, args=(beat, stop, lost), daemon=True).start()
        while not stop.wait(interval_s):
            try:
                self.hardware.refresh()
                newest = self.conn.heartbeat(self.device_id, self.telemetry.sample())
                beat.set()  # a probe, if one is due, runs now: between heartbeats, not across one
                if newest is not None:
                    self.endpoint.mailbox.supersede(*newest)
            except grpc.RpcError as e:
                if transport.error_reason(e) == Refusal.UNKNOWN_DEVICE:
                    lost.set()
                    return
                logger.debug("[Client.Heartbeat] failed", exc_info=True)
            except trust.TrustError:  # revoked or expired: the work loop's next call says so and stops
                return
            except ValueError:  # the channel was closed under a last beat: this registration is over
                if stop.is_set():
                    return
                raise

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
                except trust.TrustError:  # revoked or expired: the work loop's next call says so and stops
                    return
                except ValueError:  # the channel was closed under a last probe: this registration is over
                    if stop.is_set():
                        return
                    raise
                last_probe = time.monotonic()

    def _work_loop(self) -> str:
        while True:
            if self._lost.is_set():
                raise Rejoin()
            if self.hardware.battery_empty:
                raise BatteryEmpty()
            work = _rejoin_if_forgotten(lambda: self.conn.get_work(self.device_id, self.options.poll_s))
            if isinstance(work, Finished):
                logger.info("[Client] job finished: %s", work.reason)
                return work.reason
            if work is not None:
                self._do_step(work)

    def _step_energy(self) -> float | None:
        """Joules since the last step's reading (the first step: since the board profiled);
        None when unknown, or when the source changed in between (a battery counter that stopped
        measuring on mains power: the difference of two sources means nothing)."""
        meter = self.hardware.energy
        energy, measured = meter.energy_j(), meter.measured
        mark, self._energy_mark = self._energy_mark, (energy, measured) if energy is not None else None
        if energy is None or mark is None or mark[1] != measured:
            return None
        return max(0.0, energy - mark[0])

    def _do_step(self, work: Assignment) -> None:
        """One assignment; a refusal (stale version, closed step) only abandons this step. A board
        whose own data is gone says so and leaves the job (LocalDataGone)."""
        if self.local is not None:
            try:
                self.local.check()
            except LocalDataGone as e:
                logger.error("[Client] %s: %s; leaving the job", self.options.name, e)
                with contextlib.suppress(grpc.RpcError, CoordinatorUnreachable):
                    self.conn.report_failure(self.device_id, work.step, work.attempt, FailureKind.LOCAL_DATA, str(e))
                raise
        try:
            self.endpoint.expect(work)
            with self.hardware.energy.busy():
                # one computation on the model at a time: the coordinator's LoadState / PullState
                # of an owned stage wait for it (they first end superseded attempts)
                with self.endpoint.state.lock:
                    update = self._compute(work)
            if work.stage is None and self.endpoint.mailbox.redone(work.step, work.attempt):
                logger.info("[Client.Step] step %d attempt %d is being redone without this board's update "
                            "(a board left); not uploading it", work.step, work.attempt)
                if update.streamed is not None:
                    update.streamed.abandon()
                    with contextlib.suppress(grpc.RpcError, TransferError, UploadAbandoned,
                                             CoordinatorUnreachable):
                        update.streamed.wait()
                return
            report = replace(update.report, energy_j=self._step_energy())
            started, cpu_started = time.perf_counter(), time.process_time()
            if update.streamed is not None:
                update.streamed.send_report(report)
                update.streamed.wait()
            else:
                self.conn.upload(self.device_id, work, update.metas, update.payload, report, self._job.chunk_bytes)
            if work.stage is None and work.local is None:
                self._shards.stream_choice.observe(streamed=update.streamed is not None,
                                                   wall_s=time.perf_counter() - started,
                                                   cpu_s=time.process_time() - cpu_started)
            update.commit()
            self.telemetry.last_step = (report.compute_s, report.download_s + report.encode_s
                                        + time.perf_counter() - started)
        except StageFailure as e:
            logger.warning("[Client.Stage] step %d attempt %d given up: %s", work.step, work.attempt, e)
            try:
                self.conn.report_failure(self.device_id, work.step, work.attempt, e.kind, str(e))
            except grpc.RpcError as report_error:
                logger.info("[Client.Stage] failure report refused: %s", report_error.details())
        except (grpc.RpcError, TransferError) as e:
            if isinstance(e, grpc.RpcError) and transport.error_reason(e) == Refusal.UNKNOWN_DEVICE:
                raise Rejoin() from e
            logger.warning("[Client.Step] step %d abandoned: %s", work.step, transport.describe(e))
            if self._abandoned == (work.step, work.attempt):  # the same work again: do not spin
                time.sleep(1.0)
            self._abandoned = (work.step, work.attempt)

    def _compute(self, work: Assignment) -> Update:
        """This board's update for `work`: its pipeline stage, or a data-parallel shard (which
        replaces any stage the board owned: the coordinator took it back)."""
        def download(version: int, **kw):
            return self.conn.download_parameters(self.device_id, version, **kw)

        if work.stage is not None:
            self._shards.invalidate()
            return self._stages.compute(work, self.device_id, download)
        self.endpoint.state.drop()
        self._stages.invalidate()

        def send_streamed(update: StreamedUpdate) -> None:
            self.conn.upload_streamed(self.device_id, work, update, self._job.chunk_bytes)

        return self._shards.compute(work, download, send_streamed)
