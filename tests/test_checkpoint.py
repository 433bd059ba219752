"""Checkpoints: crash-safe sets, the fallback past damaged ones, the ledger of applied steps, and
a coordinator process killed with SIGKILL and resumed with --resume (coordinator.training.checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ClientProcess, read_metrics, small_job, spawn_edgetrain, wait_for
from reference import max_abs_difference, reference_state

from coordinator.main import run_coordinator
from coordinator.registry import DeviceRegistry
from coordinator.training.aggregator import Aggregator
from coordinator.training.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PREVIOUS_DIR,
    STATE_FILE,
    CheckpointError,
    checkpoint_sets,
    load_newest,
    model_state,
    prune,
    read_ledger,
    save_checkpoint,
    set_name,
)
from coordinator.training.parameters import ParameterStore
from coordinator.training.steps import StepBoard
from coordinator.training.trainer import Trainer
from edgetrain import trust
from edgetrain.config import job_to_dict
from edgetrain.models import build_model
from edgetrain.training import make_optimizer, shard_tensor_names
from edgetrain.updates import UpdateFormats

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 2e-5
"""As in test_dp_integration: a lost or doubled step moves the parameters by at least 5e-5."""


def _trained(seed: int, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its SGD optimizer after `steps` steps on random data (momentum set)."""
    torch.manual_seed(seed)
    job = small_job()
    model = build_model(job.model, seed=seed)
    optimizer = make_optimizer(model, job.optimizer)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,))).backward()
        optimizer.step()
    return model, optimizer


def _state(next_step: int, total: int = 8) -> dict:
    return {"next_step": next_step, "train_seconds": 1.5 * next_step, "samples_done": 24 * next_step,
            "job": "test", "applied_steps": [1] * next_step + [0] * (total - next_step)}


def _momentum(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters() if p in optimizer.state}


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    job = small_job()
    model = build_model(job.model, seed=99)
    return model, make_optimizer(model, job.optimizer)


def test_a_saved_set_loads_back_exactly(tmp_path):
    # Prepare
    model, optimizer = _trained(seed=1, steps=2)

    # Execute
    saved = save_checkpoint(tmp_path, model, optimizer, _state(3))
    restored_model, restored_optimizer = _fresh()
    restored = load_newest(tmp_path, restored_model, restored_optimizer)

    # Assert: same tensors, same momentum, same progress; the manifest lists every other file
    assert saved.name == restored.checkpoint.name == f"{CHECKPOINTS_DIR}/step-000003"
    assert restored.state == _state(3) and restored.skipped == []
    assert max_abs_difference(restored_model.state_dict(), model.state_dict()) == 0
    assert max_abs_difference(_momentum(restored_model, restored_optimizer), _momentum(model, optimizer)) == 0
    manifest = json.loads((saved.path / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == sorted([MODEL_FILE, OPTIMIZER_FILE, STATE_FILE])
    assert all(manifest["files"][f]["bytes"] == (saved.path / f).stat().st_size for f in manifest["files"])
    assert read_ledger(tmp_path) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == ["step-000003"]  # no temporary left


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _other_model(run_dir: Path, checkpoint: Path) -> None:
    """The set holds another job's model (intact, with a matching manifest)."""
    other = torch.nn.Linear(3, 2)
    save_checkpoint(run_dir, other, torch.optim.SGD(other.parameters(), lr=0.1), _state(4))


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda run, s: (s / MANIFEST_FILE).unlink(), "no manifest.json (its save did not finish)"),
    (lambda run, s: _truncate(s / MODEL_FILE), "model.safetensors has"),
    (lambda run, s: _flip_a_bit(s / OPTIMIZER_FILE), "optimizer.safetensors does not match its sha256"),
    (lambda run, s: _truncate(s / STATE_FILE), "state.json has"),
    (lambda run, s: (s / MANIFEST_FILE).write_text('{"format": 1, "next_st'), "manifest.json is unreadable"),
    (_other_model, "model.safetensors does not fit the job's model"),
], ids=["no-manifest", "truncated-model", "bit-flipped-optimizer", "truncated-state", "torn-manifest",
        "another-model"])
def test_a_damaged_newest_set_is_skipped_for_the_older_one(tmp_path, caplog, damage, reason):
    # Prepare: sets after 2 and 4 steps of different models; the newer one then damaged
    older, older_optimizer = _trained(seed=1)
    save_checkpoint(tmp_path, older, older_optimizer, _state(2))
    newer, newer_optimizer = _trained(seed=2)
    damage(tmp_path, save_checkpoint(tmp_path, newer, newer_optimizer, _state(4)).path)

    # Execute
    model, optimizer = _fresh()
    with caplog.at_level(logging.WARNING, logger="coordinator.training.checkpoint"):
        restored = load_newest(tmp_path, model, optimizer)

    # Assert: the older set was loaded, the newer one named once with why, for the log and metrics
    assert restored.checkpoint.name == f"{CHECKPOINTS_DIR}/step-000002" and restored.state == _state(2)
    assert max_abs_difference(model.state_dict(), older.state_dict()) == 0
    assert [s["checkpoint"] for s in restored.skipped] == [f"{CHECKPOINTS_DIR}/step-000004"]
    assert reason in restored.skipped[0]["reason"]
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skips == [f"[Coordinator.Checkpoint] skipping {CHECKPOINTS_DIR}/step-000004: {restored.skipped[0]['reason']}"]
    if damage is not _other_model:  # the manifest checks alone see these; the ledger reader falls back too
        assert read_ledger(tmp_path) == _state(2)["applied_steps"]
        assert max_abs_difference(model_state(tmp_path), older.state_dict()) == 0


def test_prune_keeps_only_the_sets_named(tmp_path):
    # Prepare: three sets and the temporary directory of a save that was interrupted
    model, optimizer = _trained(seed=1)
    sets = [save_checkpoint(tmp_path, model, optimizer, _state(n)) for n in (1, 2, 3)]
    (tmp_path / CHECKPOINTS_DIR / f".tmp-{set_name(4)}-12345").mkdir()

    # Execute
    deleted = prune(tmp_path, sets[-2:])

    # Assert
    assert deleted == [f".tmp-{set_name(4)}-12345", "step-000001"]
    assert [s.next_step for s in checkpoint_sets(tmp_path)] == [3, 2]


def _trainer(job, run_dir: Path) -> Trainer:
    """A Trainer wired from real parts as coordinator.main wires it, not serving anything."""
    model = build_model(job.model, seed=job.seed)
    registry = DeviceRegistry()
    board = StepBoard(UpdateFormats(shard_tensor_names(model)), model.block_names)
    aggregator = Aggregator(job, model, registry)
    return Trainer(job, registry, board, model, 512, [], run_dir, store=ParameterStore(job.compression.downlink),
                   aggregator=aggregator)


def test_resuming_a_longer_job_records_where_it_continues_and_extends_the_ledger(tmp_path):
    # Prepare: a set after 2 steps of a 8-step job and a newer one whose save did not finish
    model, optimizer = _trained(seed=1)
    save_checkpoint(tmp_path, model, optimizer, _state(2))
    (save_checkpoint(tmp_path, model, optimizer, _state(4)).path / MANIFEST_FILE).unlink()
    trainer = _trainer(small_job(training={"steps": 10}), tmp_path)

    # Execute
    restored = trainer.resume_if_possible()
    trainer.metrics.close()

    # Assert
    assert (trainer.start_step, trainer.train_seconds, trainer.samples_done) == (2, 3.0, 48)
    assert trainer.applied_steps == [1, 1] + [0] * 8  # the ledger grew with the job's steps
    assert trainer.checkpoints == [restored.checkpoint]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"kind": "resume", "from_step": 2, "checkpoint": f"{CHECKPOINTS_DIR}/step-000002",
         "skipped": [{"checkpoint": f"{CHECKPOINTS_DIR}/step-000004",
                      "reason": "no manifest.json (its save did not finish)"}]}]


def test_a_run_from_step_0_moves_an_earlier_runs_sets_and_metrics_aside(tmp_path):
    # Prepare
    model, optimizer = _trained(seed=1)
    save_checkpoint(tmp_path, model, optimizer, _state(5))
    earlier = '{"kind": "train", "step": 4}\n'
    (tmp_path / "metrics.jsonl").write_text(earlier)
    trainer = _trainer(small_job(), tmp_path)

    # Execute
    trainer.start_from_scratch()
    trainer.metrics.write({"kind": "train", "step": 0})
    trainer.metrics.close()

    # Assert: nothing to resume this run from, the earlier sets kept one generation; the earlier
    # run's records are set aside too: this run's metrics.jsonl holds its own steps only
    assert checkpoint_sets(tmp_path) == []
    assert (tmp_path / PREVIOUS_DIR / "step-000005" / MANIFEST_FILE).exists()
    assert (tmp_path / "metrics.previous.jsonl").read_text() == earlier
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0]


def _legacy_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "runs" / "test").mkdir(parents=True)
    (tmp_path / "runs" / "test" / "checkpoint.json").write_text('{"next_step": 4}')


def _damaged_set(run_dir: Path) -> None:
    model, optimizer = _trained(seed=1)
    _truncate(save_checkpoint(run_dir / "runs" / "test", model, optimizer, _state(2)).path / MODEL_FILE)


@pytest.mark.parametrize(("prepare", "message"), [
    (_legacy_checkpoint, "holds only a checkpoint in the old single-file layout (checkpoint.json), which this version cannot resume from"),
    (_damaged_set, f"no usable checkpoint in {{runs}}/{CHECKPOINTS_DIR} ({CHECKPOINTS_DIR}/step-000002: model.safetensors has"),
], ids=["old-layout", "only-damaged-sets"])
def test_resume_without_a_usable_checkpoint_fails_before_serving(tmp_path, prepare, message):
    # Prepare
    prepare(tmp_path)
    port_file = tmp_path / "address"

    # Execute
    with pytest.raises(CheckpointError) as raised:
        run_coordinator(small_job(), bind="127.0.0.1:0", runs_dir=str(tmp_path / "runs"),
                        data_dir=str(tmp_path / "data"), port_file=str(port_file), resume=True, authority=trust.Authority(trust.default_authority_dir()))

    # Assert: one line saying why and what to do; nothing was served
    text = str(raised.value)
    assert message.format(runs=tmp_path / "runs" / "test") in text and "\n" not in text
    assert text.endswith("start without --resume, or with --resume-or-start")
    assert not port_file.exists()


def _coordinator(job_file: Path, tmp_path: Path, *flags: str) -> subprocess.Popen:
    """`python -m edgetrain coordinator` for the job, as a user starts it (the session's authority)."""
    (tmp_path / "address").unlink(missing_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "edgetrain", "coordinator", "--config", str(job_file), "--bind", "127.0.0.1:0",
         "--port-file", str(tmp_path / "address"), "--runs-dir", str(tmp_path / "runs"),
         "--data-dir", str(tmp_path / "data"), "--no-advertise", *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_resume_with_no_checkpoint_is_a_one_line_error_from_the_cli(tmp_path):
    # Prepare
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_to_dict(small_job())))

    # Execute
    process = _coordinator(job_file, tmp_path, "--resume")
    _, stderr = process.communicate(timeout=120)

    # Assert: exit 2, our one line last, no traceback, never served
    assert process.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"edgetrain coordinator: error: --resume: no checkpoint in {tmp_path / 'runs' / 'test' / CHECKPOINTS_DIR}; "
        "start without --resume, or with --resume-or-start")
    assert not (tmp_path / "address").exists()


def _forked_coordinator(job_file: Path, tmp_path: Path, log: str, *flags: str) -> ClientProcess:
    """`edgetrain coordinator` for the job as its own process, forked from the test's fork server,
    which has torch imported already (as conftest.spawn_client forks boards): the same CLI path as
    `python -m edgetrain`, without paying for torch's import twice."""
    (tmp_path / "address").unlink(missing_ok=True)
    argv = ["coordinator", "--config", str(job_file), "--bind", "127.0.0.1:0", "--port-file", str(tmp_path / "address"),
            "--runs-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "data"), "--no-advertise", *flags]
    return spawn_edgetrain(argv, tmp_path / log, log)


def _address(tmp_path: Path, process: ClientProcess, log: str) -> str:
    def served() -> str:
        assert process.poll() is None, f"the coordinator exited: {(tmp_path / log).read_text()[-3000:]}"
        path = tmp_path / "address"
        return path.exists() and path.read_text().splitlines()[0].strip()
    return wait_for(served, 90, "the coordinator to serve", interval_s=0.05)


def _records(run_dir: Path, kind: str) -> list[dict]:
    return read_metrics(run_dir, kind)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_coordinator_killed_after_a_timed_checkpoint_resumes_with_every_step_applied_once(tmp_path, client_factory):
    # Prepare: checkpoints every second of training (none by steps); a board slow enough that
    # the 12 steps take several seconds; started with --resume-or-start and nothing to resume
    job = small_job(training={"steps": 12, "global_batch": 96, "checkpoint_every_s": 1.0},
                    optimizer={"schedule": "constant", "warmup_steps": 0})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_to_dict(job)))
    run_dir = tmp_path / "runs" / job.name
    first = _forked_coordinator(job_file, tmp_path, "first.log", "--resume-or-start")
    board = client_factory(_address(tmp_path, first, "first.log"), "board", 0.4)

    def checkpointed() -> int:
        try:
            return sum(read_ledger(run_dir))
        except FileNotFoundError:
            return 0

    # Execute: SIGKILL as soon as the first timed checkpoint is complete, then plant what a
    # crash in the middle of the next save leaves (a newer set without its manifest)
    saved_steps = wait_for(checkpointed, 120, "the first timed checkpoint", interval_s=0.02)
    first.kill()  # SIGKILL
    assert first.wait(10) == -signal.SIGKILL
    board.kill()
    newest = checkpoint_sets(run_dir)[0]
    assert newest.next_step < job.training.steps, "the run ended before the kill: nothing to resume mid-run"
    torn = run_dir / CHECKPOINTS_DIR / set_name(newest.next_step + 1)
    torn.mkdir()
    (torn / MODEL_FILE).write_bytes((newest.path / MODEL_FILE).read_bytes()[:1000])
    second = _forked_coordinator(job_file, tmp_path, "second.log", "--resume")
    client_factory(_address(tmp_path, second, "second.log"), "board-again")  # unthrottled: this half need not be slow
    exit_code = second.wait(timeout=180)
    stderr = (tmp_path / "second.log").read_text()

    # Assert: the job finished from the newest complete set, skipping the torn one and saying so;
    # the final model has every step's update exactly once and equals 12 uninterrupted steps
    assert exit_code == 0, stderr[-3000:]
    assert f"skipping {torn.relative_to(run_dir)}: no manifest.json (its save did not finish)" in stderr
    [resume] = _records(run_dir, "resume")
    assert resume["from_step"] == newest.next_step >= saved_steps > 0
    assert resume["checkpoint"] == newest.name
    assert resume["skipped"] == [{"checkpoint": f"{CHECKPOINTS_DIR}/{torn.name}",
                                  "reason": "no manifest.json (its save did not finish)"}]
    assert read_ledger(run_dir) == [1] * job.training.steps
    assert max_abs_difference(model_state(run_dir), reference_state(job)) < TOLERANCE
    # the last two complete sets are kept, the torn one and older ones deleted
    assert sorted(os.listdir(run_dir / CHECKPOINTS_DIR))[-1] == set_name(job.training.steps)
    assert len(os.listdir(run_dir / CHECKPOINTS_DIR)) == 2
    assert _records(run_dir, "checkpoint")[-1]["checkpoint"] == f"{CHECKPOINTS_DIR}/{set_name(job.training.steps)}"


def test_a_negative_checkpoint_interval_is_refused_by_the_job_config():
    from edgetrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint_every_s=-1\.0: must be >= 0"):
        small_job(training={"checkpoint_every_s": -1.0})
    assert small_job().training.checkpoint_every_s == 60.0  # on by default
