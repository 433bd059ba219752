"""Coordinator entry point: build the job, serve devices, train, report, always clean up."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace
from pathlib import Path

import torch

from coordinator.advertiser import advertise_on
from coordinator.dashboard.server import serve_dashboard
from coordinator.dashboard.view import RunView
from coordinator.data_service import datasets_service
from coordinator.pairing import serve_gateway
from coordinator.registry import DeviceRegistry
from coordinator.servicer import CoordinatorServicer, coordinator_service
from coordinator.training.aggregator import Aggregator
from coordinator.training.checkpoint import CheckpointError, checkpoint_sets, describe_missing
from coordinator.training.parameters import ParameterStore
from coordinator.training.report import summarize, summary_table
from coordinator.training.rounds import JobAborted
from coordinator.training.steps import StepBoard
from coordinator.training.trainer import Trainer
from edgetrain import transport, trust
from edgetrain.channels import split_parameters
from edgetrain.config import JobConfig, job_to_dict
from edgetrain.data import dataset_classes, dataset_is_synthetic, load_dataset
from edgetrain.models import build_model
from edgetrain.training import freeze_heap, shard_tensor_names
from edgetrain.updates import UpdateFormats
from edgetrain.work import BoardJob

logger = logging.getLogger(__name__)


def profile_batch_sizes(global_batch: int) -> list[int]:
    """Batch sizes a device times itself at: around the shares it is likely to get, at most 64
    (a board at a tenth of a core takes about 25 s per forward+backward of 64 ResNet-18 samples,
    and times each size 4 times; the speed fit needs two sizes, not large ones)."""
    return sorted({max(2, min(global_batch // 8, 16)), max(4, min(global_batch // 2, 64))})


def board_job(job: JobConfig, aggregator: Aggregator, classes: tuple[str, ...] | None = None) -> BoardJob:
    """The job as boards get it when they register (`classes`: the dataset's class names; by
    default read from its manifest)."""
    classes = classes or dataset_classes(job.dataset)
    return BoardJob(job_id=job.name, model=job.model, num_classes=len(classes), dataset=job.dataset,
                    profile_batch_sizes=tuple(profile_batch_sizes(job.training.global_batch)),
                    heartbeat_interval_s=job.training.heartbeat_interval_s, chunk_bytes=job.training.chunk_bytes,
                    max_forward_batch=job.training.max_forward_batch, error_feedback=job.compression.error_feedback,
                    board_momentum=aggregator.board_momentum, device=job.device,
                    stream_upload=job.training.stream_upload_mode, stream_download=job.training.stream_download_mode,
                    class_names=classes, share_class_counts=job.privacy.class_counts)


def _watch_heartbeats(registry: DeviceRegistry, board: StepBoard, timeout_s: float, stop: threading.Event) -> None:
    """Drop silent devices; when the coordinator stops, release everything waiting on the board."""
    while not stop.wait(min(1.0, timeout_s / 4)):
        registry.expire(timeout_s)
    board.finish("coordinator stopped")


def board_security(authority: trust.Authority | None) -> transport.Security:
    """How the coordinator dials boards' StagePeer endpoints: as the gateway, verifying that the
    endpoint holds a board certificate of the fleet (plaintext without an authority)."""
    if authority is None:
        return transport.INSECURE
    return authority.gateway_identity().security(trust.BOARD_SERVER_NAME)


def run_coordinator(job: JobConfig, *, bind: str = "127.0.0.1:0", data_dir: str = "data",
                    runs_dir: str = "runs", port_file: str | None = None, resume: bool = False,
                    resume_or_start: bool = False, stop: threading.Event | None = None,
                    cluster: str = "edgetrain", advertise: list[str] | None = None,
                    authority: trust.Authority | None = None, pair_bind: str | None = None,
                    dashboard: str | None = None) -> dict:
    """Serve and train `job` to completion; returns the run summary (also under runs/<name>/).

    With an `authority` the fleet port takes mutual TLS under the fleet CA and boards pair on the
    pairing port (coordinator.pairing.serve_gateway; `pair_bind` "none": no pairing port);
    without one (`--insecure`) it serves plaintext. With `advertise` (IPv4 addresses of
    interfaces), the coordinator announces itself over mDNS on those interfaces, so boards find
    it without an address. A job that stops before its last step (JobAborted) still writes its
    summary, saying how many steps were applied, then raises.

    `resume`: continue from the run's newest complete checkpoint (checkpoint.py), or raise
    CheckpointError, before serving anything, when there is none; `resume_or_start`: continue
    from it if there is one, else train from step 0. Without either, training starts from step 0
    and an earlier run's checkpoints are moved to checkpoints.previous/.

    `dashboard` ("host:port"): serve the live dashboard there (coordinator.dashboard), over HTTPS
    with the gateway's certificate unless the host is loopback or the run is `--insecure`; its URL,
    access token included, is logged and written to runs/<name>/dashboard.url (owner-only).
    """
    stop = stop or threading.Event()
    job = replace(job, dataset=replace(job.dataset, data_dir=data_dir))
    run_dir = Path(runs_dir) / job.name
    if resume and not checkpoint_sets(run_dir):  # say so at once, before building the model and data
        raise _nothing_to_resume(run_dir, [])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job_to_dict(job), indent=2))
    torch.set_num_threads(1)
    train_size = len(load_dataset(job.dataset, train=True))
    if job.training.epochs and job.dataset.train_size is None:  # steps follow the split's real size
        job = replace(job, dataset=replace(job.dataset, train_size=train_size))
    test_set = load_dataset(job.dataset, train=False)
    classes = test_set.classes
    model = build_model(job.model, num_classes=len(classes), seed=job.seed)
    if dataset_is_synthetic(job.dataset):
        logger.info("[Coordinator] dataset: SYNTHETIC CIFAR-shaped data (seed %d), not CIFAR-10", job.dataset.seed)
    else:
        logger.info("[Coordinator] dataset %r: %d training and %d test samples of %d classes", job.dataset.name,
                    train_size, len(test_set), len(classes))
    registry = DeviceRegistry()
    split = split_parameters(model)  # what channel group members move only a slice of
    board = StepBoard(UpdateFormats(shard_tensor_names(model), split), model.block_names)
    aggregator = Aggregator(job, model, registry)
    store = ParameterStore(job.compression.downlink, keep_full=aggregator.versions_kept, split=split)
    servicer = CoordinatorServicer(job, board_job(job, aggregator, classes), registry, board, store, cluster=cluster)
    trainer = Trainer(job, registry, board, model, train_size, test_set, run_dir, stop, store=store,
                      aggregator=aggregator, board_security=board_security(authority))
    try:
        _resume_or_start(trainer, run_dir, resume=resume, resume_or_start=resume_or_start)
    except BaseException:
        trainer.policy.close()
        trainer.metrics.close()
        raise
    services = coordinator_service(servicer) + datasets_service(data_dir, job.dataset.name)  # boards fetch blocks
    servers = serve_gateway(bind, services, authority=authority, pair_bind=pair_bind)
    freeze_heap()
    advertiser = page = None
    try:
        if dashboard:
            view = RunView(job.name, run_dir, registry, synthetic=dataset_is_synthetic(job.dataset), classes=classes)
            page = serve_dashboard(dashboard, view.state, run_dir / "dashboard.url", authority)
        host = bind.rsplit(":", 1)[0]
        if authority is None:
            logger.warning("[Coordinator] serving job %r on %s:%d WITHOUT TLS (--insecure): any host that "
                           "reaches the port can join and change the training", job.name, host, servers.port)
        else:
            logger.info("[Coordinator] serving job %r on %s:%d with mutual TLS (fleet CA %s…)%s", job.name, host,
                        servers.port, authority.fingerprint[:16],
                        f"; boards pair on port {servers.pairing_port}" if servers.pairing_server else "")
        advertiser = advertise_on(cluster, host, servers.port, advertise,
                                  ca_fingerprint=authority.fingerprint if authority else "") if advertise else None
        if port_file:
            lines = [f"{host}:{servers.port}"] + ([f"{host}:{servers.pairing_port}"] if servers.pairing_server else [])
            Path(port_file).write_text("".join(line + "\n" for line in lines))
        threading.Thread(target=_watch_heartbeats, daemon=True,
                         args=(registry, board, job.training.heartbeat_timeout_s, stop)).start()
        try:
            final = trainer.run()
        except JobAborted as e:
            _write_summary(run_dir, summarize(job, trainer.metrics.last_eval, trainer, registry.snapshot(),
                                              stopped=str(e), classes=classes))
            raise
        return _write_summary(run_dir, summarize(job, final, trainer, registry.snapshot(), classes=classes))
    finally:
        stop.set()
        trainer.metrics.close()
        if advertiser:
            advertiser.close()
        if page:
            page.close()
        servers.stop(grace=2.0)


def _resume_or_start(trainer: Trainer, run_dir: Path, *, resume: bool, resume_or_start: bool) -> None:
    """Load the checkpoint to continue from, or set up a run from step 0 (see run_coordinator)."""
    if resume or resume_or_start:
        restored = trainer.resume_if_possible()
        if restored.checkpoint is not None:
            return
        if resume:
            raise _nothing_to_resume(run_dir, restored.skipped)
        logger.info("[Coordinator] --resume-or-start: %s; training starts from step 0",
                    describe_missing(run_dir, restored.skipped))
    trainer.start_from_scratch()


def _nothing_to_resume(run_dir: Path, skipped: list[dict]) -> CheckpointError:
    return CheckpointError(f"--resume: {describe_missing(run_dir, skipped)}; "
                           "start without --resume, or with --resume-or-start")


def _write_summary(run_dir: Path, summary: dict) -> dict:
    """Save the run's summary as summary.json and print its table."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(summary_table(summary), flush=True)
    return summary
