"""The `edgetrain` command as a user runs it: which commands start without torch, submit's
validation, and `edgetrain plan`'s measurement cache (coordinator.planning.cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.planning import cache
from coordinator.planning.inputs import measure_model_cost

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "edgetrain" / "presets" / "lab.yaml"
PLAN = ("plan", str(LAB), "--model", "small_cnn", "--json")
NOWHERE = "127.0.0.1:1"
"""A job server address where nothing answers."""


def _edgetrain(*args: str, cache_dir: Path | None = None, env: dict[str, str] | None = None,
               ) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m edgetrain ARGS` from this checkout: the result, with stderr
    cleared of import timings, and the set of modules it imported."""
    environ = {**os.environ, **(env or {})}
    if cache_dir is not None:
        environ[cache.CACHE_ENV] = str(cache_dir)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "edgetrain", *args], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=150)
    timings = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    modules = {line.rsplit("|", 1)[1].strip() for line in timings[1:]}
    stderr = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, stderr), modules


def _torch(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "torch" or m.startswith("torch."))


@pytest.mark.parametrize("args", [("--help",), ("devices", "--help"), ("jobs", "--help"), ("submit", "--help"),
                                  ("cancel", "--help"), ("fleet", "down", "--help")])
def test_commands_that_need_no_torch_start_without_it(args):
    done, modules = _edgetrain(*args)

    assert done.returncode == 0, done.stderr
    assert "usage: edgetrain" in done.stdout
    assert "edgetrain.cli" in modules
    assert _torch(modules) == []


def test_submit_rejects_a_bad_job_before_looking_for_a_server(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: typo\nmodel: small_cnn\ntraining: {global_batch: 32, steps: -5}\n")

    done, modules = _edgetrain("submit", str(job), "--server", NOWHERE)

    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"edgetrain submit: error: {job}: training: steps=-5: must be > 0"]
    assert _torch(modules) == []


@pytest.fixture(scope="module")
def first_plan(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, set[str]]:
    """`edgetrain plan` run over a damaged cache file: the cache directory, the run, its modules."""
    cache_dir = tmp_path_factory.mktemp("cache")
    (cache_dir / cache.FILE_NAME).write_text('{"format": 1, "entries": [{"measured_on": ')
    done, modules = _edgetrain(*PLAN, cache_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    return cache_dir, done, modules


def test_a_damaged_cache_is_ignored_with_one_warning_and_rewritten(first_plan):
    cache_dir, done, modules = first_plan

    assert json.loads(done.stdout)["from_cache"] == dict.fromkeys(
        ("model_cost", "one_core_speed", "transfer_cpu_s_per_byte"), False)
    assert "torch" in modules
    [warning] = done.stderr.splitlines()
    assert "damaged measurement cache" in warning and str(cache_dir / cache.FILE_NAME) in warning
    assert len(json.loads((cache_dir / cache.FILE_NAME).read_text())["entries"]) == 3


def test_plan_with_a_warm_cache_imports_no_torch_and_prints_the_same_plan(first_plan):
    cache_dir, first, _ = first_plan

    done, modules = _edgetrain(*PLAN, cache_dir=cache_dir)

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert _torch(modules) == []
    second, plan = json.loads(done.stdout), json.loads(first.stdout)
    assert set(second.pop("from_cache").values()) == {True}
    plan.pop("from_cache")
    assert second == plan


def test_a_figure_measured_on_something_else_is_measured_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    measure_model_cost("small_cnn")
    path = tmp_path / cache.FILE_NAME
    kept = json.loads(path.read_text())
    [entry] = kept["entries"]
    entry["measured_on"]["torch"], entry["value"] = "0.0", None  # a value that would not decode
    path.write_text(json.dumps(kept))

    cost = measure_model_cost("small_cnn")

    assert [b.name for b in cost.blocks] == ["conv1", "conv2", "conv3", "head"]
    assert [e["measured_on"]["torch"] for e in json.loads(path.read_text())["entries"]] == [
        "0.0", cache.measured_on({}, 1)["torch"]]
    assert caplog.records == []
