"""The job server's job coordinator processes: their port files, and finding, watching and
stopping them (a restarted job server adopts coordinators it did not start)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil


def first_port(port_file: Path) -> int:
    """The port of the address on the first line of a coordinator's port file (0: not written yet).
    Line 2, when there, is a pairing address; job coordinators serve none."""
    try:
        first = port_file.read_text().splitlines()[0].strip()
        return int(first.rsplit(":", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


def create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def process(pid: int, started: float) -> psutil.Process | None:
    """The process `pid` if it is still the one we started (a recycled pid is not)."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def exit_code(proc: subprocess.Popen | psutil.Process) -> int | None:
    """The exit code, None while running; -1 for an adopted process (its code is not ours to read)."""
    if isinstance(proc, subprocess.Popen):
        return proc.poll()
    try:
        return None if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE else -1
    except psutil.Error:
        return -1


def terminate(*procs: subprocess.Popen | psutil.Process, grace_s: float = 8.0) -> None:
    """SIGTERM (a coordinator then tells its boards the job ended), SIGKILL what is left after `grace_s`."""
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except (ProcessLookupError, psutil.Error):
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            proc.kill()
        except (ProcessLookupError, psutil.Error):
            pass
