"""scripts/check_cuda.py: a board on the job's device beside CPU boards, in data parallelism and in
a two-stage pipeline holding the heavier stage, computes what single-process SGD computes. CI runs
it on the CPU (the same code path); a machine with CUDA runs it with --device cuda."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_device_board_matches_single_process_sgd_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "scripts/check_cuda.py", "--device", "cpu", "--keep", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["runs"]) == {"dp", "pipeline"}
    for run in result["runs"].values():
        assert run["passed"] and run["max_abs_difference"] < run["tolerance"] == 2e-5 and run["device_board"] == "cpu"
    # the data-parallel run's shards also estimate the gradient noise scale, step by step
    dp = [json.loads(line) for line in (tmp_path / "runs" / "check-dp" / "metrics.jsonl").read_text().splitlines()]
    noise = [r["noise_scale"] for r in dp if r["kind"] == "train"]
    assert all(v is None or v >= 0 for v in noise) and any(v for v in noise), noise
    # the pipeline run did run as two stages, the heavier one (blocks 1-3) on the device board
    records = [json.loads(line) for line in (tmp_path / "runs" / "check-pipeline" / "metrics.jsonl").read_text()
               .splitlines()]
    stages = [r["stages"] for r in records if r["kind"] == "train"]
    assert stages and all({k.rsplit("-", 1)[0]: v["blocks"] for k, v in s.items()} ==
                          {"cpu-a": [0, 1], "device-board": [1, 4]} for s in stages)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_asking_for_cuda_without_it_is_one_usage_line():
    done = subprocess.run([sys.executable, "scripts/check_cuda.py", "--device", "cuda"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("usage: check_cuda.py") and lines[-1].startswith("check_cuda.py: error: --device cuda")
    assert "no CUDA device" in lines[-1] and done.stdout == ""
