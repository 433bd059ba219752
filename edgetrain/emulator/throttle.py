"""Emulated CPU speed and memory of a board: a client started with ``--speed F`` runs at F of
one core; a board file's ``memory_mb`` caps its memory.

As root with cgroup v1 ``cpu`` mounted, the kernel enforces F with a CFS quota on a cgroup
made for this process; otherwise :meth:`CpuLimiter.working` sleeps after each compute burst.
As root with cgroup v1 ``memory`` mounted, the kernel enforces the memory cap (a process that
outgrows it is killed, as on a board that runs out of memory); otherwise the cap is only
reported (:class:`MemoryLimiter`), so the planner still plans by it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import final

import psutil

logger = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup/cpu"
DEFAULT_MEMORY_CGROUP_ROOT = "/sys/fs/cgroup/memory"

DEFAULT_PERIOD_US = 20_000
"""CFS period, the same for every board. Each period the group runs its quota at full speed and
then waits out the rest, so a burst shorter than the period either runs unthrottled or stalls for
up to (1 - F) of it: the shorter the period, the closer a burst of a few ms comes to its ideal
cpu/F. Shorter periods wake the throttle timer more often and, with the kernel's 1 ms minimum
quota, raise the lowest F (0.05 at 20 ms).

One period for every F means a slow board runs in short slices (2 ms a period at 0.1 of a core),
each beginning with caches other boards filled. A longer period for slow boards does not pay: a
synchronous step waits for its slowest board, and coarser slices make that one later
(docs/benchmarks.md#conditions).

Where the kernel has it (5.14+), the group may also carry up to one period's unused quota into
the next (`cpu.cfs_burst_us` = quota), so the quota holds as an average rather than a cap per
period. Without it a board's process gets less than its fraction: its gRPC threads wake on the
other core and take a slice of the period's quota there, which the training thread, throttled
meanwhile, gets back only after the period ends."""

_MIN_QUOTA_US = 1_000
"""The kernel rejects a smaller cfs_quota_us; longer periods keep very low F representable."""

_MIN_SLEEP_S = 0.001
"""Duty-cycle debt below this is carried to the next burst: shorter sleeps mostly oversleep."""


@final
class CpuLimiter:
    """Holds one process to a fraction of a core; made by :func:`limit_cpu`.

    ``fraction`` is the limit in cores (None: unlimited); ``mode`` is "cgroup" (kernel quota),
    "duty-cycle" (sleeps in ``working()``) or "none"; ``cgroup_path`` is the group it created.
    """

    def __init__(self, *, fraction: float | None, mode: str, cgroup_path: str | None = None,
                 cgroup_root: str = DEFAULT_CGROUP_ROOT) -> None:
        self.fraction = fraction
        self.mode = mode
        self.cgroup_path = cgroup_path
        self._cgroup_root = cgroup_root
        self._debt_s = 0.0

    @contextmanager
    def working(self) -> Iterator[None]:
        """Wrap one burst of compute; in duty-cycle mode sleep afterwards to slow it to F.

        The burst should last cpu/F wall seconds, so the sleep owed is that minus its wall time:
        with the machine to itself (one torch thread) that is busy*(1-F)/F, and on a busy
        machine time lost to other processes counts towards it, a ceiling as with a cgroup
        quota. Owed sleep that is too short, or overslept, is carried to later bursts.
        F >= 1 cannot be emulated by sleeping and is left alone.
        """
        wall0, cpu0 = time.perf_counter(), time.process_time()
        yield
        if self.mode != "duty-cycle" or self.fraction is None or self.fraction >= 1:
            return
        wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
        self._debt_s += max(0.0, cpu_s / self.fraction - wall_s)
        if self._debt_s >= _MIN_SLEEP_S:
            slept_from = time.perf_counter()
            time.sleep(self._debt_s)
            self._debt_s -= time.perf_counter() - slept_from

    def close(self) -> None:
        """Lift the limit; in cgroup mode leave the group and remove it so none pile up."""
        if self.cgroup_path is not None:
            _leave_group(self._cgroup_root, self.cgroup_path)
            self.cgroup_path = None
        self.mode = "none"

    def __enter__(self) -> CpuLimiter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def limit_cpu(fraction: float | None, *, name: str, prefer_cgroup: bool = True,
              period_us: int = DEFAULT_PERIOD_US,
              cgroup_root: str = DEFAULT_CGROUP_ROOT) -> CpuLimiter:
    """Hold this process to ``fraction`` of one core (None: unlimited) until ``close()``.

    The kernel quota is exact and also covers threads and children, so it is used whenever
    possible; without root or cgroup v1 the process throttles itself in ``working()``.
    """
    if fraction is None:
        return CpuLimiter(fraction=None, mode="none")
    cores = os.cpu_count() or 1
    if not 0 < fraction <= cores:
        raise ValueError(f"CPU fraction must be in (0, {cores}], got {fraction}")
    can_cgroup = os.geteuid() == 0 and Path(cgroup_root, "cpu.cfs_quota_us").exists()
    if prefer_cgroup and can_cgroup:
        safe_name = re.sub(r"[^A-Za-z0-9_-]", "_", name)
        group = Path(cgroup_root, "edgetrain", f"{safe_name}-{os.getpid()}")
        period_us = max(period_us, math.ceil(_MIN_QUOTA_US / fraction))
        try:
            group.mkdir(parents=True, exist_ok=True)
            _write(group / "cpu.cfs_period_us", period_us)
            quota_us = round(fraction * period_us)
            _write(group / "cpu.cfs_quota_us", quota_us)
            with suppress(OSError):  # absent before Linux 5.14: the quota is then a cap per period
                _write(group / "cpu.cfs_burst_us", quota_us)
            _write(group / "cgroup.procs", os.getpid())
        except OSError as e:
            logger.warning("[Throttle.limit_cpu] cgroup %s failed (%s); using duty-cycle", group, e)
            with suppress(OSError):
                group.rmdir()
        else:
            logger.info("[Throttle.limit_cpu] %s: %.3g cores via %s", name, fraction, group)
            return CpuLimiter(fraction=fraction, mode="cgroup", cgroup_path=str(group),
                              cgroup_root=cgroup_root)
    logger.info("[Throttle.limit_cpu] %s: %.3g cores via duty-cycle", name, fraction)
    return CpuLimiter(fraction=fraction, mode="duty-cycle")


@final
class MemoryLimiter:
    """Holds one process (and its children) to `cap_bytes` of memory; made by :func:`limit_memory`.

    ``mode`` is "cgroup" (the kernel enforces it), "reported" (not enforced: no root or no
    cgroup v1 memory controller; the board still reports the cap) or "none" (no cap: the host's
    memory is reported).
    """

    def __init__(self, *, cap_bytes: int | None, mode: str, cgroup_path: str | None = None,
                 cgroup_root: str = DEFAULT_MEMORY_CGROUP_ROOT) -> None:
        self.cap_bytes = cap_bytes
        self.mode = mode
        self.cgroup_path = cgroup_path
        self._cgroup_root = cgroup_root

    def reading(self) -> tuple[int, int]:
        """(total, available) bytes as the board sees them: the cap and what of it is unused
        (cgroup: the group's usage; reported: this process's resident memory), else the host's."""
        host = psutil.virtual_memory()
        if self.cap_bytes is None:
            return host.total, host.available
        used = None
        if self.cgroup_path is not None:
            with suppress(OSError, ValueError):
                used = int(Path(self.cgroup_path, "memory.usage_in_bytes").read_text())
        if used is None:
            used = psutil.Process(os.getpid()).memory_info().rss
        return self.cap_bytes, max(0, min(self.cap_bytes - used, host.available))

    def close(self) -> None:
        """Leave the group and remove it."""
        if self.cgroup_path is not None:
            _leave_group(self._cgroup_root, self.cgroup_path)
            self.cgroup_path = None

    def __enter__(self) -> MemoryLimiter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def limit_memory(cap_bytes: int | None, *, name: str,
                 cgroup_root: str = DEFAULT_MEMORY_CGROUP_ROOT) -> MemoryLimiter:
    """Cap this process's memory at `cap_bytes` (None: no cap) until ``close()``: enforced by a
    cgroup v1 memory group when this process may make one, else only reported."""
    if cap_bytes is None:
        return MemoryLimiter(cap_bytes=None, mode="none")
    if cap_bytes <= 0:
        raise ValueError(f"memory cap must be > 0 bytes, got {cap_bytes}")
    if os.geteuid() == 0 and Path(cgroup_root, "memory.limit_in_bytes").exists():
        group = Path(cgroup_root, "edgetrain", f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)}-{os.getpid()}")
        try:
            group.mkdir(parents=True, exist_ok=True)
            _write(group / "memory.limit_in_bytes", cap_bytes)
            _write(group / "cgroup.procs", os.getpid())
        except OSError as e:
            logger.warning("[Throttle.limit_memory] cgroup %s failed (%s); the cap is reported, not enforced",
                           group, e)
            with suppress(OSError):
                group.rmdir()
        else:
            logger.info("[Throttle.limit_memory] %s: %d MiB via %s", name, cap_bytes >> 20, group)
            return MemoryLimiter(cap_bytes=cap_bytes, mode="cgroup", cgroup_path=str(group), cgroup_root=cgroup_root)
    logger.warning("[Throttle.limit_memory] %s: %d MiB reported, not enforced (needs root and cgroup v1 memory)",
                   name, cap_bytes >> 20)
    return MemoryLimiter(cap_bytes=cap_bytes, mode="reported")


def remove_stale_cgroups(cgroup_root: str = DEFAULT_CGROUP_ROOT) -> list[str]:
    """Remove the groups of crashed processes (pid dead, group empty); return their paths.

    A live pid may be between creating its group and joining it, so only dead ones are touched.
    """
    parent = Path(cgroup_root, "edgetrain")
    removed: list[str] = []
    for group in sorted(parent.iterdir()) if parent.is_dir() else []:
        pid = group.name.rpartition("-")[2]
        if not group.is_dir() or not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        try:
            if (group / "cgroup.procs").read_text().strip():
                continue
            group.rmdir()
        except OSError as e:
            logger.warning("[Throttle.remove_stale_cgroups] cannot remove %s: %s", group, e)
            continue
        removed.append(str(group))
    return removed


def _leave_group(cgroup_root: str, group: str) -> None:
    """Move this process back to the hierarchy's root group and remove `group` (made for it)."""
    try:
        _write(Path(cgroup_root) / "cgroup.procs", os.getpid())
        os.rmdir(group)
    except OSError as e:
        logger.warning("[Throttle.close] cannot remove %s: %s", group, e)


def _write(path: Path, value: int) -> None:
    path.write_text(f"{value}\n")

