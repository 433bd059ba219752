"""The process supervisor (edgetrain.supervisor) with real child processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgetrain import supervisor

pytestmark = pytest.mark.timeout(60)


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], **kwargs)


def test_address_file_appears(tmp_path: Path) -> None:
    # Prepare: a child that serves after a moment and writes its address (line 2: pairing)
    address_file = tmp_path / "child.address"
    child = _python(f"import time, pathlib; time.sleep(0.3); "
                    f"pathlib.Path({str(address_file)!r}).write_text('127.0.0.1:4321\\n127.0.0.1:4322\\n'); "
                    f"time.sleep(30)")
    try:
        # Execute
        address = supervisor.wait_for_address(address_file, child, timeout_s=20)
        # Assert
        assert address == "127.0.0.1:4321"
        assert supervisor.first_port(address_file) == 4321
    finally:
        supervisor.terminate(child, grace_s=5)


def test_child_dying_before_serving_is_a_clear_error_at_once(tmp_path: Path) -> None:
    child = _python("import sys; sys.exit(3)")
    started = time.monotonic()
    with pytest.raises(supervisor.ChildExited, match="the board exited with code 3 before serving"):
        supervisor.wait_for_address(tmp_path / "never.address", child, timeout_s=30, what="the board")
    assert time.monotonic() - started < 5


def test_waiting_times_out(tmp_path: Path) -> None:
    child = _python("import time; time.sleep(30)")
    try:
        with pytest.raises(TimeoutError, match="did not start serving within 0.5 s"):
            supervisor.wait_for_address(tmp_path / "never.address", child, timeout_s=0.5)
    finally:
        supervisor.terminate(child, grace_s=5)


def test_terminate_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    # Prepare: a child that ignores SIGTERM (it says so once the handler is set)
    ready = tmp_path / "ready"
    child = _python(f"import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    f"pathlib.Path({str(ready)!r}).write_text('x'); time.sleep(60)")
    supervisor.wait_for(ready.exists, child, timeout_s=20, what="the child")
    started = time.monotonic()
    # Execute
    supervisor.terminate(child, grace_s=0.5)
    # Assert: killed after the grace period, and reaped
    assert child.returncode == -9
    assert time.monotonic() - started < 10


def test_terminate_lets_a_child_end_on_sigterm() -> None:
    child = _python("import time; time.sleep(60)")
    supervisor.terminate(child, grace_s=10)
    assert child.returncode == -15


def test_adopt_by_pid_and_start_time() -> None:
    # Prepare: a process started "before a restart", known only by its pid and start time
    child = _python("import time; time.sleep(60)")
    try:
        started = supervisor.create_time(child.pid)
        # Execute
        adopted = supervisor.adopt(child.pid, started)
        stranger = supervisor.adopt(child.pid, started - 100)  # a recycled pid is not ours
        # Assert
        assert adopted is not None and adopted.pid == child.pid
        assert supervisor.exit_code(adopted) is None
        assert stranger is None
        supervisor.terminate(adopted, grace_s=10)
        child.wait(timeout=10)
        assert supervisor.exit_code(adopted) == -1
        assert supervisor.adopt(child.pid, started) is None
    finally:
        supervisor.terminate(child, grace_s=1)


def test_stop_waits_then_terminates() -> None:
    quick, slow = _python("pass"), _python("import time; time.sleep(60)")
    supervisor.stop([quick, slow], grace_s=5, terminate_wait_s=5)
    assert quick.returncode == 0 and slow.returncode == -15
