"""Start a job's own coordinator: the ordinary ``edgetrain coordinator`` on a free port of this
host, not advertised, under the job server's fleet authority (or plaintext when it is
``--insecure``), its output appended to ``<state-dir>/logs/<run>.log``."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import yaml

from coordinator.jobs.store import JobRecord
from edgetrain import trust
from edgetrain.config import JobConfig, job_to_dict
from edgetrain.supervisor import edgetrain_command


class JobLauncher:
    """Writes a job's run config and starts its coordinator process."""

    def __init__(self, *, state_dir: Path, runs_dir: Path, data_dir: Path, host: str,
                 authority: trust.Authority | None, job_dashboards: str | None) -> None:
        self.state_dir, self.runs_dir, self.data_dir = state_dir, runs_dir, data_dir
        self.host, self.authority, self.job_dashboards = host, authority, job_dashboards

    def log(self, job: JobRecord) -> Path:
        """Where its coordinator's output goes."""
        return self.state_dir / "logs" / f"{job.run_name}.log"

    def trust_args(self) -> list[str]:
        """How a job's coordinator serves: under this server's authority, with no pairing port of
        its own (boards pair with the job server), or plaintext when this server is."""
        if self.authority is None:
            return ["--insecure"]
        return ["--authority", str(self.authority.directory), "--pair-bind", "none"]

    def start(self, job: JobRecord, config: JobConfig, boards: list[str]) -> tuple[subprocess.Popen, Path]:
        """Start the coordinator of `job` on `boards` (resuming when the job says so); the process
        and the address file it writes once it serves."""
        run_config = replace(config, name=job.run_name,
                             training=replace(config.training, min_clients=len(boards)))
        job_dir = self.state_dir / "jobs"
        job_dir.mkdir(parents=True, exist_ok=True)
        config_file = job_dir / f"{job.run_name}.yaml"
        config_file.write_text(yaml.safe_dump(job_to_dict(run_config)))
        address_file = job_dir / f"{job.run_name}.address"
        address_file.unlink(missing_ok=True)
        self.log(job).parent.mkdir(parents=True, exist_ok=True)
        dashboard = f"{self.job_dashboards}:0" if self.job_dashboards else "none"
        with self.log(job).open("a") as log:
            proc = subprocess.Popen(edgetrain_command(
                "coordinator", "--config", str(config_file), "--bind", f"{self.host}:0",
                "--port-file", str(address_file), "--runs-dir", str(self.runs_dir),
                "--data-dir", str(self.data_dir), "--no-advertise", *self.trust_args(),
                *(["--resume-or-start"] if job.resume else []), "--dashboard", dashboard),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return proc, address_file
