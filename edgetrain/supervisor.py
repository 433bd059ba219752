"""Start, watch and stop the role processes: one place for every launcher above the roles (the
job server's job coordinators, the emulated fleet, the experiment runner, the benchmarks).

A role started here writes its serving address to an address file (line 1: the address; line 2,
when there, a pairing address); `wait_for_address` waits for it while watching the child die.
A process started before a restart is adopted by pid and start time (`adopt`), so a recycled pid
is never taken for it. `terminate` asks with SIGTERM (a coordinator then tells its boards the job
ended) and kills what is left after a grace period.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

Proc = subprocess.Popen | psutil.Process
"""A child this process started, or one it adopted after a restart."""


class ChildExited(RuntimeError):
    """A child ended before it served."""


def edgetrain_command(*args: str) -> list[str]:
    """The command line that runs `edgetrain ARGS` with this interpreter (roles start as processes)."""
    return [sys.executable, "-m", "edgetrain", *args]


def read_address(address_file: Path) -> str:
    """The address on line 1 of `address_file` ("" while it is not written)."""
    try:
        lines = address_file.read_text().splitlines()
    except OSError:
        return ""
    return lines[0].strip() if lines else ""


def first_port(address_file: Path) -> int:
    """The port of the address on line 1 of `address_file` (0: not written yet)."""
    try:
        return int(read_address(address_file).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 0


def wait_for(ready: Callable[[], bool], proc: Proc, *, timeout_s: float, what: str,
             poll_s: float = 0.1) -> None:
    """Wait until `ready()`; ChildExited as soon as `proc` ends first, TimeoutError after
    `timeout_s`. `what` names the child in the error."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return
        code = exit_code(proc)
        if code is not None:
            raise ChildExited(f"{what} exited with code {code} before serving")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start serving within {timeout_s:g} s")
        time.sleep(poll_s)


def wait_for_address(address_file: Path, proc: Proc, timeout_s: float = 300, *,
                     what: str = "the coordinator") -> str:
    """The address `proc` wrote to `address_file` once it serves (ChildExited if it ended first,
    TimeoutError after `timeout_s`)."""
    wait_for(lambda: bool(read_address(address_file)), proc, timeout_s=timeout_s, what=what)
    return read_address(address_file)


def create_time(pid: int) -> float:
    """When process `pid` started (0.0: no such process); stored with a pid to adopt it later."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def adopt(pid: int, started: float) -> psutil.Process | None:
    """The running process `pid` if it is still the one started at `started` (a recycled pid is
    not); None when it ended."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def exit_code(proc: Proc) -> int | None:
    """The exit code, None while running (reaps a child that ended); -1 for an adopted process
    (its code is not ours to read)."""
    if isinstance(proc, subprocess.Popen):
        return proc.poll()
    try:
        return None if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE else -1
    except psutil.Error:
        return -1


def terminate(*procs: Proc, grace_s: float = 8.0) -> None:
    """SIGTERM every process, SIGKILL what is left after `grace_s`, and reap them."""
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
            _kill(proc)
        except (ProcessLookupError, psutil.Error):
            pass


def _kill(proc: Proc) -> None:
    try:
        proc.kill()
        proc.wait(timeout=5)
    except (ProcessLookupError, psutil.Error, subprocess.TimeoutExpired):
        pass


def stop(procs: Sequence[Proc], grace_s: float, *, terminate_wait_s: float = 5) -> None:
    """Let `procs` end by themselves for `grace_s`, then `terminate` what is left (killed after
    `terminate_wait_s`)."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            pass
    terminate(*[p for p in procs if exit_code(p) is None], grace_s=terminate_wait_s)
