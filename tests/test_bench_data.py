"""scripts/bench_data.py: its smoke size runs every part end to end and ends with the JSON figures;
an argument it cannot use is refused in one usage line."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH_DATA = "scripts/bench_data.py"


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run the benchmark from the repository root; past `timeout`, SIGTERM it (it then stops the
    coordinators and boards it started) and fail."""
    proc = subprocess.Popen([sys.executable, BENCH_DATA, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"bench_data {' '.join(args)} did not finish within {timeout:.0f} s:\n{out[-3000:]}\n"
                    f"{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_smoke_size_runs_every_part_and_ends_with_the_figures():
    # Execute
    done = run_bench("--smoke", timeout=270)

    # Assert: progress lines for every part, then one JSON object saying the data is synthetic
    assert done.returncode == 0, done.stderr[-5000:]
    lines = done.stdout.strip().splitlines()
    assert "SYNTHETIC" in lines[0]
    assert any(line.startswith("import 1/1:") for line in lines)
    assert any(line.startswith("train folder 1/1:") for line in lines)
    assert any(line.startswith("train cifar 1/1:") for line in lines)
    assert any(line.startswith("local seed 0 served:") for line in lines)
    assert any(line.startswith("local seed 0 local:") for line in lines)
    out = json.loads(lines[-1])
    assert out["synthetic"] is True and "SYNTHETIC" in out["note"] and out["smoke"] is True
    assert out["commit"] is None or isinstance(out["commit"], str)
    assert isinstance(out["date"], str)
    assert set(out["wall_s"]) == {"import", "train", "local", "total"}
    assert all(v >= 0 for v in out["wall_s"].values())

    # the import: a rate, the folder's size and side
    assert out["import_images_per_s"] > 0
    assert out["import"]["images"] == 200 and out["import"]["side"] == 32 and out["import"]["folder_mb"] > 0

    # the train part: one pair, positive rates, the boards fetched blocks, the same bytes both ways
    train = out["train"]
    assert out["train_ratio"] > 0
    assert train["identical_blocks"] is True
    assert [r["arm"] for r in train["runs"]] == ["folder", "cifar"]
    assert all(r["samples_per_s"] > 0 and r["blocks_fetched"] > 0 for r in train["runs"])
    assert out["train_ratio"] == pytest.approx(train["folder_samples_per_s"][0] / train["cifar_samples_per_s"][0],
                                               rel=1e-3)

    # local against served: each arm's accuracy and rate, and the seed's gap and ratio as the means
    local = out["local_vs_served"]
    assert local["seeds"] == [0] and set(local["per_seed"]) == {"0"}
    seed = local["per_seed"]["0"]
    for arm in ("served", "local"):
        assert 0.0 <= seed[arm]["test_accuracy"] <= 1.0
        assert seed[arm]["samples_per_s"] > 0
    assert sum(seed["partition_sizes"]) == 200 and len(seed["partition_sizes"]) == 4
    assert seed["accuracy_gap_pp"] == pytest.approx(
        (seed["served"]["test_accuracy"] - seed["local"]["test_accuracy"]) * 100, abs=1e-3)  # signed
    assert local["accuracy_gap_pp"] == pytest.approx(abs(seed["accuracy_gap_pp"])) and local["accuracy_gap_pp"] <= 100
    assert local["accuracy_gap_sd_pp"] is None and local["accuracy_gap_se_pp"] is None  # one seed: no spread
    assert local["samples_per_s_ratio"] == pytest.approx(seed["samples_per_s_ratio"]) and local["samples_per_s_ratio"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--seeds", "x"], "--seeds: expected comma-separated whole numbers"),
    (["--parts", "import,everything"], "unknown part(s) ['everything']"),
    (["--train-steps", "5", "--warmup", "5"], "--warmup (5) must be below --train-steps (5)"),
])
def test_an_argument_it_cannot_use_is_one_usage_line(args, message):
    # Execute
    done = run_bench(*args, timeout=120)

    # Assert: argparse's usage line and its error, exit code 2, nothing run
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: bench_data.py"), done.stderr
    assert message in lines[1]
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
