"""The benchmarks' command lines: what they cannot measure is refused in one line before any run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
BENCH_DP = SCRIPTS / "bench_dp.py"
BENCH_FORWARD_BATCH = SCRIPTS / "bench_forward_batch.py"


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


def test_bench_forward_batch_times_every_limit_and_says_the_data_is_synthetic():
    # Execute: a small model, two shard sizes, chunked and whole
    done = subprocess.run([sys.executable, str(BENCH_FORWARD_BATCH), "--model", "small_cnn", "--shards", "6,3",
                           "--limits", "2,0", "--rounds", "1"], capture_output=True, text=True, timeout=300)

    # Assert: one line per shard with each limit's passes, then the JSON
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "SYNTHETIC" in lines[0]
    assert "shard 6: 2: " in lines[1] and "(3 pass)" in lines[1] and "whole: " in lines[1]
    result = json.loads(lines[-1])
    assert result["synthetic_data"] is True
    assert set(result["ms_per_shard"]) == {"6", "3"}
    assert all(set(v) == {"2", "0"} and all(ms > 0 for ms in v.values()) for v in result["ms_per_shard"].values())
    assert result["over_default"] is None  # the default (64) was not among the limits


@pytest.mark.parametrize(("args", "message"), [
    (["--limits", "64,-1"], "--limits must be >= 0"),
    (["--shards", "0,70"], "--shards must be >= 1"),
    (["--model", "alexnet"], "unknown model 'alexnet'"),
])
def test_bench_forward_batch_refuses_arguments_it_cannot_run(args, message):
    done = subprocess.run([sys.executable, str(BENCH_FORWARD_BATCH), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
