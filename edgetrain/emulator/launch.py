"""Run a coordinator and N emulated boards as separate processes on this machine (loopback).

The roles are started as `python -m edgetrain coordinator|client` processes, never imported, so
a local run exercises exactly what a real deployment does: separate processes talking gRPC,
with mutual TLS. The run has its own fleet authority (``EmulatedTrust``, under the run's
directory, never the user's own ~/.edgetrain), and each board pairs through the same join-token
path a real board uses: a one-use token in its environment, its key made on the board.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from edgetrain.config import load_yaml
from edgetrain.supervisor import edgetrain_command, stop, wait_for_address

logger = logging.getLogger(__name__)

DEMO_JOB = Path(__file__).parent.parent / "presets" / "demo.yaml"
DEMO_SPEEDS = (0.5, 0.3, 0.2, 0.1)


def plain_demo_job() -> dict:
    """The demo job as a mapping, as plain proportional data parallelism: without its planner and
    its aggregation settings (what benchmarks that compare training modes start from)."""
    job = load_yaml(DEMO_JOB)
    job.pop("aggregation", None)
    job["planner"] = {"enabled": False}
    return job


@dataclass(kw_only=True, frozen=True)
class LocalRun:
    """A local run: one job file, one emulated board per speed."""

    job_file: Path = DEMO_JOB
    """The job YAML the coordinator runs."""
    speeds: tuple[float, ...] = DEMO_SPEEDS
    """Emulated speed of each board, as a fraction of one core."""
    overrides: tuple[str, ...] = ()
    """`key=value` job overrides passed to the coordinator (e.g. training.steps=20)."""
    runs_dir: Path = Path("runs")
    """Where results go (runs/<job name>/)."""
    data_dir: Path = Path("data")
    """Dataset directory of the coordinator, and of the boards unless `board_data_dir` is given."""
    board_data_dir: Path | None = None
    """Where the boards keep their data, each in a directory of its own, board_data_dir/<board
    name>/ (blocks fetched from the gateway, its own images decoded), as real boards do; None: they
    share `data_dir` with the coordinator (and so read a dataset imported there instead of
    fetching it)."""
    board_files: tuple[Path, ...] = ()
    """Board files (speed, link, battery) to emulate; when given they replace `speeds`."""
    client_args: tuple[str, ...] = ()
    """Extra arguments for every client (e.g. --probe-interval 5)."""
    insecure: bool = False
    """Run without TLS or authentication (loopback experiments; the coordinator warns)."""
    dashboard: str | None = None
    """host:port of the coordinator's live dashboard (None: none)."""

    def __post_init__(self) -> None:
        if not self.board_files and (not self.speeds or any(s <= 0 for s in self.speeds)):
            raise ValueError(f"speeds must be a non-empty list of positive fractions, got {self.speeds}")


@dataclass(frozen=True)
class EmulatedTrust:
    """The credentials of an emulated run: a fleet authority in `directory`/authority and each
    board's identity in `directory`/boards/NAME; or nothing at all when `insecure`."""

    directory: Path
    insecure: bool = False

    @property
    def authority_dir(self) -> Path:
        return self.directory / "authority"

    def gateway_args(self) -> list[str]:
        """Arguments of the coordinator (or job server): serve under the run's authority."""
        if self.insecure:
            return ["--insecure"]
        from edgetrain.trust import Authority

        Authority.open_or_create(self.authority_dir)
        return ["--authority", str(self.authority_dir)]

    def operator_args(self) -> list[str]:
        """Arguments of `edgetrain devices|jobs|submit` against this run."""
        return ["--insecure"] if self.insecure else ["--authority", str(self.authority_dir)]

    def board(self, name: str) -> tuple[list[str], dict[str, str]]:
        """Arguments and environment of board `name`'s client: its identity directory and, until it
        has paired, a one-use join token (in the environment: a command line is visible to all)."""
        if self.insecure:
            return ["--insecure"], dict(os.environ)
        from edgetrain.trust import Authority, Identity

        identity = self.directory / "boards" / name
        env = dict(os.environ)
        env.pop("EDGETRAIN_JOIN_TOKEN", None)
        if not Identity.exists(identity):
            token = Authority(self.authority_dir).new_token(ttl_s=600, note=f"emulated board {name}")
            env["EDGETRAIN_JOIN_TOKEN"] = str(token)
        return ["--identity", str(identity)], env


def run_on_emulated_boards(job: dict, boards: Sequence[tuple[float, float]], workdir: Path,
                           client_args: tuple[str, ...] = ("--probe-interval", "5")) -> Path:
    """Run the job mapping `job` on boards given as (fraction of a core, link Mbit/s), named
    board0, board1, ...; returns its run directory (RuntimeError if the coordinator failed)."""
    job_file = workdir / f"{job['name']}.yaml"
    job_file.write_text(yaml.safe_dump(job))
    files = []
    for i, (speed, mbit) in enumerate(boards):
        path = workdir / f"board{i}.yaml"
        path.write_text(yaml.safe_dump({"name": f"board{i}", "speed": speed, "link": {"mbit_per_s": mbit}}))
        files.append(path)
    code = run_local(LocalRun(job_file=job_file, board_files=tuple(files), runs_dir=workdir / "runs",
                              client_args=client_args), job_name=job["name"])
    if code != 0:
        raise RuntimeError(f"job {job['name']} failed with exit code {code}")
    return workdir / "runs" / job["name"]


def run_local(run: LocalRun, *, job_name: str) -> int:
    """Start the coordinator and boards, wait for the job to end; returns the coordinator's exit code."""
    log_dir = run.runs_dir / job_name / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    port_file = run.runs_dir / job_name / "coordinator.address"
    port_file.unlink(missing_ok=True)
    overrides = [arg for o in run.overrides for arg in ("--set", o)]
    trust = EmulatedTrust(run.runs_dir / job_name / "trust", insecure=run.insecure)
    coordinator = subprocess.Popen(edgetrain_command(
        "coordinator", "--config", str(run.job_file), *overrides, "--bind", "127.0.0.1:0",
        "--port-file", str(port_file), "--runs-dir", str(run.runs_dir), "--data-dir", str(run.data_dir),
        *trust.gateway_args(), *(("--dashboard", run.dashboard) if run.dashboard else ())))
    clients: list[subprocess.Popen] = []
    try:
        address = wait_for_address(port_file, coordinator)
        boards = [(path.stem, ("--emulate", str(path))) for path in run.board_files] or [
            (f"board{i}-{speed:g}", ("--speed", f"{speed:g}")) for i, speed in enumerate(run.speeds)]
        for name, emulation in boards:
            credentials, env = trust.board(name)
            data_dir = run.data_dir
            if run.board_data_dir is not None:
                data_dir = run.board_data_dir / name
                data_dir.mkdir(parents=True, exist_ok=True)
            with (log_dir / f"{name}.log").open("w") as log:
                clients.append(subprocess.Popen(edgetrain_command(
                    "client", "--coordinator", address, "--name", name, *emulation, "--data-dir", str(data_dir),
                    *credentials, *run.client_args), stdout=log, stderr=subprocess.STDOUT, env=env))
        logger.info("started %d emulated boards (%s); their logs are in %s", len(clients),
                    ", ".join(name for name, _ in boards), log_dir)
        code = coordinator.wait()
        stop(clients, grace_s=15)
        return code
    finally:
        stop([*clients, coordinator], grace_s=0)
