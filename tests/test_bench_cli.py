"""The throughput benchmark's command line refuses what it cannot measure, in one line, before any run."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DP = Path(__file__).resolve().parent.parent / "scripts" / "bench_dp.py"


@pytest.mark.parametrize(("args", "message"), [
    (["--sixteen", "--batches", "128,512"], "batch 512 is the 16-board fleet's"),
    (["--batches", "64,many"], "--batches takes whole numbers"),
    (["--arms", "proportional,fastest"], "unknown arms ['fastest']"),
])
def test_bench_dp_refuses_arguments_it_cannot_run(args, message):
    # Execute
    done = subprocess.run([sys.executable, str(BENCH_DP), *args], capture_output=True, text=True, timeout=120)

    # Assert: argparse's usage error, no traceback, nothing run
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert "samples/s" not in done.stdout
