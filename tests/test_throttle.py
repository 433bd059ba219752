"""Tests for edgetrain.emulator.throttle: duty-cycle pacing, validation, and the cgroup v1 quota.

The machine is shared, so speeds are checked as CPU/wall ratios with wide tolerances.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgetrain.emulator import throttle
from edgetrain.emulator.throttle import limit_cpu, remove_stale_cgroups

REPO = Path(__file__).resolve().parents[1]
CGROUP_ROOT = Path(throttle.DEFAULT_CGROUP_ROOT)

needs_cgroup = pytest.mark.skipif(
    os.geteuid() != 0 or not (CGROUP_ROOT / "cpu.cfs_quota_us").exists(),
    reason="needs root and cgroup v1 cpu mounted at /sys/fs/cgroup/cpu",
)


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _runqueue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (0 where the kernel does not
    say): time other processes took, which no throttle can give back."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@pytest.mark.parametrize("burst_s", [0.005, 0.0002], ids=["5ms-bursts", "0.2ms-bursts"])
def test_duty_cycle_holds_fraction(burst_s: float) -> None:
    # Prepare
    limiter = limit_cpu(0.25, name="test-duty", prefer_cgroup=False)
    wall0, cpu0, waited0 = time.perf_counter(), time.process_time(), _runqueue_wait_s()

    # Execute
    while time.perf_counter() - wall0 < 1.0:
        with limiter.working():
            _burn(burst_s)
    wall = time.perf_counter() - wall0
    cpu, waited = time.process_time() - cpu0, _runqueue_wait_s() - waited0

    # Assert: a ceiling on CPU/wall, as a cgroup quota; and the throttle did not sleep more than
    # its share: time running or waiting for a CPU (others' time on a busy machine is not the
    # throttle's doing) makes up at least the fraction
    assert limiter.mode == "duty-cycle"
    assert cpu / wall <= 0.35, f"CPU/wall {cpu / wall:.3f} for fraction 0.25"
    assert (cpu + waited) / wall >= 0.15, f"(CPU + run-queue wait)/wall {(cpu + waited) / wall:.3f} for 0.25"


@pytest.mark.parametrize("fraction", [0.0, -0.5, (os.cpu_count() or 1) + 1, float("nan")])
def test_rejects_fraction_outside_cores(fraction: float) -> None:
    with pytest.raises(ValueError, match=str(fraction)):
        limit_cpu(fraction, name="test-bad")


def test_none_mode_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    sleeps: list[float] = []
    monkeypatch.setattr(throttle.time, "sleep", sleeps.append)

    # Execute
    with limit_cpu(None, name="test-none") as limiter:
        for _ in range(20):
            with limiter.working():
                _burn(0.001)

    # Assert
    assert (limiter.mode, limiter.fraction, limiter.cgroup_path) == ("none", None, None)
    assert sleeps == []


def test_cgroup_failure_falls_back_to_duty_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: looks like cgroup v1 to a root process, but the group cannot be created
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "edgetrain").write_text("not a directory")
    monkeypatch.setattr(throttle.os, "geteuid", lambda: 0)

    # Execute
    with caplog.at_level(logging.WARNING, logger=throttle.__name__):
        limiter = limit_cpu(0.5, name="test-fallback", cgroup_root=str(tmp_path))

    # Assert
    assert (limiter.mode, limiter.cgroup_path) == ("duty-cycle", None)
    assert "using duty-cycle" in caplog.text


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; killed at teardown, and their groups removed, if it failed."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            _child_group(proc).rmdir()


def _child_group(proc: subprocess.Popen[str]) -> Path:
    return CGROUP_ROOT / "edgetrain" / f"test-cg_child-{proc.pid}"


def _start_limited_child(spawn: list[subprocess.Popen[str]], body: str) -> subprocess.Popen[str]:
    """Start a Python child that limits itself to 0.2 cores, prints its state, then runs body."""
    code = textwrap.dedent(
        """
        import json, os, time
        from edgetrain.emulator.throttle import limit_cpu
        with limit_cpu(0.2, name="test-cg/child") as limiter:
            group = limiter.cgroup_path
            burst = f"{group}/cpu.cfs_burst_us"
            print(json.dumps({"mode": limiter.mode, "path": group,
                              "quota": int(open(f"{group}/cpu.cfs_quota_us").read()),
                              "burst": int(open(burst).read()) if os.path.exists(burst) else None}), flush=True)
        """
    ) + textwrap.indent(textwrap.dedent(body), "    ")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    spawn.append(proc)
    return proc


@pytest.mark.root
@needs_cgroup
def test_cgroup_quota_holds_fraction_and_is_removed_on_close(
    spawn: list[subprocess.Popen[str]],
) -> None:
    # Prepare
    proc = _start_limited_child(
        spawn,
        """
        wall0, cpu0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - wall0 < 1.5:
            pass
        print((time.process_time() - cpu0) / (time.perf_counter() - wall0), flush=True)
        """,
    )

    # Execute
    out, _ = proc.communicate(timeout=60)

    # Assert
    state_line, ratio_line = out.splitlines()
    state, ratio = json.loads(state_line), float(ratio_line)
    assert proc.returncode == 0
    assert state["mode"] == "cgroup"
    assert state["path"] == str(_child_group(proc))
    assert state["burst"] in (None, state["quota"])  # one period's unused quota carries over, where the kernel can
    assert 0.1 <= ratio <= 0.3, f"CPU/wall {ratio:.3f} for fraction 0.2"
    assert not Path(state["path"]).exists()


@pytest.mark.root
@needs_cgroup
def test_killed_child_leaves_group_that_remove_stale_cgroups_removes(
    spawn: list[subprocess.Popen[str]],
) -> None:
    # Prepare
    proc = _start_limited_child(spawn, "time.sleep(60)")
    assert proc.stdout is not None
    state = json.loads(proc.stdout.readline())
    group = Path(state["path"])
    assert state["mode"] == "cgroup" and group.is_dir()

    # Execute
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    left_behind = group.is_dir()
    removed = remove_stale_cgroups()

    # Assert
    assert left_behind
    assert str(group) in removed
    assert not group.exists()


MEMORY_ROOT = Path(throttle.DEFAULT_MEMORY_CGROUP_ROOT)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not (MEMORY_ROOT / "memory.limit_in_bytes").exists(),
                    reason="needs root and cgroup v1 memory mounted at /sys/fs/cgroup/memory")
def test_a_memory_cap_is_reported_and_a_process_that_outgrows_it_is_killed(
    spawn: list[subprocess.Popen[str]],
) -> None:
    # Prepare: a child capped at 256 MiB reports its memory, then allocates 512 MiB
    code = textwrap.dedent("""
        import json
        from edgetrain.emulator.throttle import limit_memory
        with limit_memory(256 * 2**20, name="test-mem/child") as memory:
            total, available = memory.reading()
            print(json.dumps({"mode": memory.mode, "path": memory.cgroup_path, "total": total,
                              "available": available}), flush=True)
            blob = b"\\x01" * (512 * 2**20)  # written, so every page counts against the cap
            print("survived", flush=True)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    spawn.append(proc)

    # Execute
    out, _ = proc.communicate(timeout=60)

    # Assert: enforced by the kernel (the child is killed, as a board out of memory is); the cap,
    # not the host's 24 GiB, is what it reports, with what its own use leaves
    state = json.loads(out.splitlines()[0])
    assert state["mode"] == "cgroup" and state["total"] == 256 * 2**20
    assert 0 < state["available"] < 256 * 2**20
    assert "survived" not in out and proc.returncode == -signal.SIGKILL
    assert str(Path(state["path"])) in remove_stale_cgroups(str(MEMORY_ROOT))


def test_without_a_cgroup_the_memory_cap_is_reported_but_not_enforced(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    # no memory controller under this root: the cap is what the board says it has
    memory = throttle.limit_memory(512 * 2**20, name="reported", cgroup_root=str(tmp_path))
    total, available = memory.reading()
    assert memory.mode == "reported" and total == 512 * 2**20 and 0 <= available < total
    unlimited = throttle.limit_memory(None, name="none")
    assert unlimited.mode == "none" and unlimited.reading()[0] > 512 * 2**20
