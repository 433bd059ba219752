"""Load on one coordinator: hundreds of light fake boards, their heartbeat round trips measured.

``run_fleet_load`` makes a fleet authority for the run and one certificate per board, starts a
real coordinator (``python -m edgetrain coordinator``, mutual TLS) on a job that never starts
training (it waits for one board more than the fleet), and starts the boards in several
``python -m edgetrain.emulator.light_boards`` processes, each board its own thread and channel with its
own certificate. Once every board has registered and profiled, the boards record their
heartbeat round trips for `seconds`; then, while they go on heartbeating, the coordinator is
asked over ListDevices (`edgetrain devices`, as the operator) how many of them it holds alive. Profiles and telemetry are
SYNTHETIC; the calls, TLS and the coordinator are real. All processes share this machine's
cores, so the boards' own CPU use slows the coordinator they measure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import yaml

from edgetrain import trust
from edgetrain.supervisor import edgetrain_command, terminate, wait_for_address

SYNTHETIC_NOTE = "light boards: SYNTHETIC profiles and telemetry; real gRPC, mutual TLS and coordinator"


def load_job(boards: int, heartbeat_interval_s: float) -> dict:
    """A job that holds `boards` boards without training: it waits for one more than there are."""
    return {"name": "fleet-load", "model": "small_cnn", "seed": 0,
            "dataset": {"name": "synthetic", "train_size": 64, "test_size": 32, "augment": False},
            "training": {"global_batch": 16, "steps": 1, "min_clients": boards + 1, "eval_every": 0,
                         "heartbeat_interval_s": heartbeat_interval_s,
                         "heartbeat_timeout_s": max(10.0, 4 * heartbeat_interval_s)}}


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of `values` (fraction 0.99: p99)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def issue_identities(authority: trust.Authority, names: Sequence[str], directory: Path) -> None:
    """A board certificate for each name under the fleet CA, saved as directory/NAME."""
    for name in names:
        authority.issue_identity(name, trust.BOARD).save(directory / name)


def _python_env(home: Path) -> dict[str, str]:
    """The environment of the run's processes: its own EDGETRAIN_HOME, and this checkout first on
    the path (so they run the code this process runs)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "EDGETRAIN_HOME": str(home), "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _start_boards(address: str, identities: Path, groups: list[list[str]], env: dict[str, str], log: Path,
                  idle_calls: bool, nice: int) -> list[subprocess.Popen]:
    extra = [] if idle_calls else ["--heartbeats-only"]
    with log.open("ab") as err:
        return [subprocess.Popen([sys.executable, "-m", "edgetrain.emulator.light_boards", "--coordinator", address,
                                  "--identities", str(identities), *extra, *names],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                 preexec_fn=(lambda: os.nice(nice)) if nice else None)
                for names in groups]


def _read_line(process: subprocess.Popen, what: str) -> dict:
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"a light-board process (pid {process.pid}) exited before {what} "
                           f"(code {process.wait()})")
    return json.loads(line)


def _tell(processes: Sequence[subprocess.Popen], command: str) -> None:
    for process in processes:
        process.stdin.write(command + "\n")
        process.stdin.flush()


def _devices(address: str, authority_dir: Path, env: dict[str, str]) -> list[dict]:
    """The coordinator's boards as the operator lists them (`edgetrain devices --json`)."""
    listing = subprocess.run(edgetrain_command("devices", "--coordinator", address, "--json", "--authority",
                                               str(authority_dir)),
                             env=env, capture_output=True, text=True, timeout=60, check=True)
    [coordinator] = json.loads(listing.stdout)
    if coordinator["error"]:
        raise RuntimeError(f"ListDevices failed: {coordinator['error']}")
    return coordinator["devices"]


class WakeupMeter:
    """How late a sleeping thread of an otherwise idle process wakes on this machine, measured
    in a thread from now until ``stop``: the floor other load sets under any round trip (a
    coordinator thread woken by a heartbeat waits for a core as long)."""

    NAP_S = 0.005

    def __init__(self) -> None:
        self.late_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wakeup-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(self.NAP_S)
            self.late_ms.append((time.perf_counter() - started - self.NAP_S) * 1000)

    def stop(self) -> float:
        """The p99 lateness in milliseconds."""
        self._stop.set()
        self._thread.join()
        return round(percentile(self.late_ms, 0.99), 2)


class _CpuMeter:
    """CPU time used by some processes from now on."""

    def __init__(self, processes: Sequence[subprocess.Popen]) -> None:
        self._processes = [psutil.Process(p.pid) for p in processes]
        self._start = self._used()

    def _used(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self._processes)

    def cores(self, seconds: float) -> float:
        """Cores used on average over the last `seconds` (since the meter was made)."""
        return round((self._used() - self._start) / seconds, 3)


def _end(processes: Sequence[subprocess.Popen]) -> None:
    terminate(*processes, grace_s=15)


def summarize(results: list[dict], devices: list[dict], *, boards: int, processes: int, seconds: float,
              interval_s: float, idle_calls: bool, register_s: float) -> dict:
    """The figures of one load run from what the boards measured and what the coordinator listed."""
    rtts = [r for board in results for r in board["rtts_ms"]]
    ours = {board["device_id"] for board in results if board["device_id"]}
    alive = [d for d in devices if d["device_id"] in ours and d.get("state", "gone") != "gone"]
    return {
        "boards": boards, "processes": processes, "seconds": seconds, "heartbeat_interval_s": interval_s,
        "idle_calls": idle_calls, "cores": os.cpu_count(), "registered": len(ours), "alive": len(alive),
        "heartbeats": len(rtts), "heartbeat_errors": sum(b["heartbeat_errors"] for b in results),
        "boards_answered": sum(bool(b["rtts_ms"]) for b in results),
        "p50_ms": round(percentile(rtts, 0.50), 2) if rtts else None,
        "p99_ms": round(percentile(rtts, 0.99), 2) if rtts else None,
        "max_ms": round(max(rtts), 2) if rtts else None,
        "max_seen_ago_s": round(max((d.get("seconds_since_seen", 0.0) for d in alive), default=0.0), 2),
        "register_s": round(register_s, 2),
        "errors": sorted({b["last_error"] for b in results if b["last_error"]})[:5], "note": SYNTHETIC_NOTE,
    }


def run_fleet_load(boards: int = 256, processes: int = 8, seconds: float = 20.0, *, idle_calls: bool = True,
                   heartbeat_interval_s: float = 1.0, workdir: Path | None = None, board_nice: int = 0) -> dict:
    """Hold `boards` light boards (in `processes` processes) on one real coordinator for `seconds`
    of heartbeats; returns the round trips the boards saw (p50_ms, p99_ms, max_ms), how many boards
    the coordinator lists as alive, and the machine's core count (see ``summarize``). With
    `idle_calls` each board also holds open its presence stream and a work poll, as an idle real
    board does. `board_nice` > 0 runs the boards' processes at that nice level: they stand for other
    machines, so the coordinator gets the CPU it would have on its own gateway (the boards still
    get what it leaves)."""
    if boards < 1 or not 1 <= processes <= boards or seconds <= 0:
        raise ValueError(f"need boards >= 1, 1 <= processes <= boards and seconds > 0, got {boards}, "
                         f"{processes}, {seconds}")
    made_here = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="fleet-load-"))
    home, identities = workdir / "home", workdir / "boards"
    authority = trust.Authority.create(home / "authority")
    names = [f"light-{i:03d}" for i in range(boards)]
    issue_identities(authority, names, identities)
    job_file = workdir / "job.yaml"
    job_file.write_text(yaml.safe_dump(load_job(boards, heartbeat_interval_s)))
    env = _python_env(home)
    port_file, log = workdir / "coordinator.address", workdir / "processes.log"
    started: list[subprocess.Popen] = []
    try:
        with log.open("ab") as out:
            coordinator = subprocess.Popen(edgetrain_command(
                "coordinator", "--config", str(job_file), "--bind", "127.0.0.1:0", "--port-file", str(port_file),
                "--runs-dir", str(workdir / "runs"), "--data-dir", str(workdir / "data"), "--no-advertise",
                "--authority", str(authority.directory)), stdout=out, stderr=subprocess.STDOUT, env=env)
        started.append(coordinator)
        address = wait_for_address(port_file, coordinator, timeout_s=120)
        began = time.perf_counter()
        fleet = _start_boards(address, identities, [names[i::processes] for i in range(processes)], env, log,
                              idle_calls, board_nice)
        started.extend(fleet)
        failed = {k: v for p in fleet for k, v in _read_line(p, "registering").get("failed", {}).items()}
        if failed:
            raise RuntimeError(f"{len(failed)} light board(s) could not register, e.g. {next(iter(failed.items()))}")
        register_s = time.perf_counter() - began
        coordinator_cpu, boards_cpu = _CpuMeter([coordinator]), _CpuMeter(fleet)
        load_before, wakeups = os.getloadavg()[0], WakeupMeter()
        _tell(fleet, "measure")
        time.sleep(seconds)  # the measurement window: the boards heartbeat meanwhile
        _tell(fleet, "pause")  # listing 256 boards is an operator's one-off, not the boards' steady load
        machine = {"coordinator_cpu_cores": coordinator_cpu.cores(seconds),
                   "boards_cpu_cores": boards_cpu.cores(seconds), "wakeup_p99_ms": wakeups.stop(),
                   "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
        devices = _devices(address, authority.directory, env)
        _tell(fleet, "stop")
        results = [board for p in fleet for board in _read_line(p, "reporting")["boards"]]
        return summarize(results, devices, boards=boards, processes=processes, seconds=seconds,
                         interval_s=heartbeat_interval_s, idle_calls=idle_calls, register_s=register_s) | machine \
            | {"board_nice": board_nice}
    finally:
        _end(started)
        if made_here:
            shutil.rmtree(workdir, ignore_errors=True)
