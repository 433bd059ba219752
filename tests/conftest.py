"""Shared fixtures: a real coordinator on 127.0.0.1 (port 0), client processes, cleanup."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from edgetrain import transport, trust
from edgetrain.config import JobConfig, job_from_dict
from edgetrain.emulator.throttle import DEFAULT_MEMORY_CGROUP_ROOT, remove_stale_cgroups
from protos import coordinator_pb2_grpc as pb_grpc

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _kill_leftover_children() -> Iterator[None]:
    """No test may leave a client or coordinator process behind, nor the CPU or memory group of
    an emulated board it killed (a killed process cannot remove its own)."""
    yield
    children = psutil.Process(os.getpid()).children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=10)
    remove_stale_cgroups()
    remove_stale_cgroups(DEFAULT_MEMORY_CGROUP_ROOT)


@pytest.fixture(autouse=True, scope="session")
def fleet_authority(tmp_path_factory) -> Iterator[trust.Authority]:
    """The session's fleet authority in a private EDGETRAIN_HOME: coordinators started by tests
    serve under it (mutual TLS, as users run them), and client processes pair themselves through
    the same join-token path as a real board ($EDGETRAIN_JOIN_TOKEN, a many-use token)."""
    home = tmp_path_factory.mktemp("edgetrain-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGETRAIN_HOME", str(home))
        authority = trust.Authority.create(home / "authority")
        patch.setenv("EDGETRAIN_JOIN_TOKEN", str(authority.new_token(uses=1_000_000, note="test session")))
        yield authority


_IDENTITIES: dict[str, trust.Identity] = {}


def board_identity(name: str) -> trust.Identity:
    """A board certificate for `name` from the session's authority (for raw, hand-driven boards)."""
    if name not in _IDENTITIES:
        _IDENTITIES[name] = trust.Authority(trust.default_authority_dir()).issue_identity(name, trust.BOARD)
    return _IDENTITIES[name]


def board_channel(address: str, name: str) -> grpc.Channel:
    """A mutual-TLS channel to a gateway at `address` as board `name`."""
    return transport.open_channel(address, board_identity(name).security(trust.GATEWAY_SERVER_NAME))


@pytest.fixture(autouse=True, scope="session")
def _measurement_cache(tmp_path_factory) -> Iterator[None]:
    """What tests measure (under test load) stays out of the user's measurement cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGETRAIN_CACHE_DIR", str(tmp_path_factory.mktemp("measurements")))
        yield


def small_job(**sections) -> JobConfig:
    """A fast BN-free job on synthetic data; `sections` override parts of the job mapping."""
    data = {
        "name": "test", "model": "small_cnn", "seed": 0,
        "dataset": {"name": "synthetic", "train_size": 512, "test_size": 128, "augment": False},
        "training": {"global_batch": 24, "steps": 6, "min_clients": 1, "eval_every": 0, "log_every": 1,
                     "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0},
        "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "schedule": "cosine",
                      "warmup_steps": 2},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return job_from_dict(data)


@dataclass
class RunningCoordinator:
    """A coordinator serving a job in a background thread of the test process."""

    address: str
    run_dir: Path
    thread: threading.Thread
    stop: threading.Event
    result: dict = field(default_factory=dict)

    def channel(self, name: str = "raw-board") -> grpc.Channel:
        """A channel as board `name` (its certificate from the session's authority)."""
        return board_channel(self.address, name)

    def stub(self, name: str = "raw-board") -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self.channel(name))

    def wait(self, timeout: float) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"coordinator did not finish within {timeout} s"
        if "error" in self.result:
            raise self.result["error"]
        return self.result["summary"]


def start_coordinator(job: JobConfig, tmp_path: Path, *, resume: bool = False,
                      dashboard: str | None = None) -> RunningCoordinator:
    """Run `job` on a real gRPC server bound to 127.0.0.1:0 (with its dashboard on `dashboard`);
    returns once it serves."""
    from coordinator.main import run_coordinator

    port_file = tmp_path / "address"
    port_file.unlink(missing_ok=True)
    stop = threading.Event()
    result: dict = {}

    def serve() -> None:
        try:
            result["summary"] = run_coordinator(job, bind="127.0.0.1:0", runs_dir=str(tmp_path / "runs"),
                                                port_file=str(port_file), stop=stop, resume=resume,
                                                authority=trust.Authority(trust.default_authority_dir()),
                                                dashboard=dashboard)
        except BaseException as e:  # surfaced by RunningCoordinator.wait
            result["error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        assert time.monotonic() < deadline and thread.is_alive(), f"coordinator did not start: {result}"
        time.sleep(0.05)
    return RunningCoordinator(port_file.read_text().splitlines()[0].strip(), tmp_path / "runs" / job.name, thread, stop, result)


@pytest.fixture
def coordinator_factory(tmp_path: Path) -> Iterator:
    """Start coordinators for a test; they are stopped afterwards."""
    started: list[RunningCoordinator] = []

    def factory(job: JobConfig, **options) -> RunningCoordinator:
        running = start_coordinator(job, tmp_path, **options)
        started.append(running)
        return running

    yield factory
    for running in started:
        running.stop.set()
        running.thread.join(30)


FORK_PRELOAD = ["torch", "torch._dynamo", "torchvision", "edgetrain.cli"]
"""What the server that forks client processes imports once. Importing torch costs a process
~3 s of CPU, and torch._dynamo (imported when a board first builds an optimizer: an owned
stage, a federated round) ~3 s more, ~9 s at 0.3 of a core. grpc is not imported there: a
channel must not cross a fork."""


def _forks() -> multiprocessing.context.ForkServerContext:
    """The fork server's context; the server starts (and imports FORK_PRELOAD) in the background."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_PRELOAD)
    multiprocessing.forkserver.ensure_running()
    return context


def _client_main(argv: list[str], log_path: str, env: dict[str, str | None]) -> None:
    """`edgetrain ARGV` (a client) in a forked process with `env` set in its environment (None:
    removed — the fork server's own environment is the one it started with), its output going
    to `log_path`."""
    from edgetrain.cli import main

    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    raise SystemExit(main(argv))


class ClientProcess:
    """An edge client process, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once it exited; subprocess.TimeoutExpired after `timeout` seconds."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"edgetrain client (pid {self.pid})", timeout)
        return self._process.exitcode

    def kill(self) -> None:
        """SIGKILL."""
        self._process.kill()


def spawn_edgetrain(argv: list[str], log_path: Path, name: str) -> ClientProcess:
    """`edgetrain ARGV` (a client, a coordinator) as a separate process under the session's
    authority, forked from a process that has already imported torch (FORK_PRELOAD), which
    `python -m edgetrain` would do again; its output goes to `log_path`."""
    env = {key: os.environ.get(key) for key in ("EDGETRAIN_HOME", "EDGETRAIN_JOIN_TOKEN")}
    process = _forks().Process(target=_client_main, args=(argv, str(log_path), env), name=name)
    process.start()
    return ClientProcess(process)


def spawn_client(address: str, name: str, *, speed: float | None = None, log_dir: Path,
                 extra: tuple[str, ...] = ()) -> ClientProcess:
    """An edge client as a separate process (`edgetrain client`, see spawn_edgetrain)."""
    args = ["client", "--coordinator", address, "--name", name, "--threads", "1"]
    if speed:
        args += ["--speed", str(speed)]
    return spawn_edgetrain(args + list(extra), log_dir / f"{name}.log", name)


@pytest.fixture
def client_factory(tmp_path: Path) -> Iterator:
    """Start client processes for a test; they are killed afterwards."""
    _forks()  # while the test starts its coordinator
    procs: list[ClientProcess] = []

    def factory(address: str, name: str, speed: float | None = None, extra: tuple[str, ...] = ()) -> ClientProcess:
        proc = spawn_client(address, name, speed=speed, log_dir=tmp_path, extra=extra)
        procs.append(proc)
        return proc

    yield factory
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSON-lines file that a process may be appending to (a last line
    without its newline is still being written; [] before the file exists)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()
    return [json.loads(line) for line in lines if line]


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    """The records of one kind in a run's metrics.jsonl ([] before it exists)."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def wait_for(predicate, timeout_s: float, what: str | Callable[[], str], *, interval_s: float = 0.5):
    """Poll `predicate` every `interval_s` until it returns something truthy; fail naming `what`
    (a callable: asked at the failure, so it can say what was seen meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")
