"""Every scripts/bench_*.py runs end to end at its smoke size and ends with its documented JSON line;
--record appends that line, dated and with the commit; SIGTERM stops everything a benchmark started.

A new benchmark fails here until it has a smoke size and its keys are declared in EXPECTED_KEYS."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from edgetrain.emulator.netns import netns_available
from edgetrain.emulator.throttle import DEFAULT_CGROUP_ROOT, DEFAULT_MEMORY_CGROUP_ROOT
from edgetrain.experiment.bench_output import RESULTS_ENV, benchmark_name, commit_id

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "scripts").glob("bench_*.py"))

EXPECTED_KEYS = {  # the top-level keys each script's docstring promises in its last line
    "aggregation": {"model", "steps", "global_batch", "synthetic_data", "boards", "modes"},
    "channel": {"synthetic_data", "fleet_steps", "warmup", "steps", "seed", "codecs"},
    "chaos": {"kills", "board_recovery_s", "redo_opened_s_each", "coordinator_recovery_s", "boards_rejoined",
              "lost_steps", "doubled_steps", "redone_steps", "false_lost", "accuracy_clean", "accuracy_chaos",
              "heartbeat_p99_ms_at_256"},
    "dashboard": {"open_samples_per_s", "closed_samples_per_s", "ratio", "pair_ratio_median",
                  "pair_ratio_quartiles", "windows"},
    "data": {"benchmark", "synthetic", "note", "commit", "date", "import_images_per_s", "import", "train_ratio",
             "train", "local_vs_served", "wall_s"},
    "dp": {"model", "fleet", "speeds", "one_core_samples_per_s", "ideal_samples_per_s", "samples_per_s",
           "fraction_of_ideal", "fraction_of_adjacent_ideal", "time_split", "prediction_error"},
    "fleet_load": {"boards", "processes", "cores", "alive", "p50_ms", "p99_ms", "target_p99_ms", "met", "runs"},
    "forward_batch": {"model", "synthetic_data", "default_max_forward_batch", "ms_per_shard", "over_default"},
    "jobs": {"avg_jct", "p95_jct", "makespan", "large", "simulated"},
    "links": {"model", "stream_fraction_of_rate", "probe_fraction_of_rate"},
    "memory_format": {"small_cnn"},  # model -> batch -> {default, channels_last, ratio}
    "pipeline": {"model", "steps", "global_batch", "synthetic_data", "boards", "stages", "bytes_per_sample",
                 "pipeline_samples_per_s", "bubble_measured", "bubble_theory"},
    "planner": {"optimality_gap", "plan_seconds", "fleets", "prediction_error", "synthetic_data", "global_batch"},
    "time_to_accuracy": {"target_accuracy", "fleets", "projected", "synthetic_data"},
    "tls": {"tls_samples_per_s", "insecure_samples_per_s", "tls_cost_fraction", "tls_board_cpu_ms_per_sample",
            "pairing_seconds"},
}


def _skip_reason(name: str) -> str | None:
    """Why a benchmark cannot run its smoke size here (None: it can)."""
    if name == "data":
        return "run at its smoke size, with its figures checked, by tests/test_bench_data.py"
    if name == "links":
        ok, why = netns_available()
        return None if ok else f"bench_links measures tc links in network namespaces, which need root: {why}"
    if name == "dashboard":
        try:
            import selenium  # noqa: F401
        except ImportError:
            return "bench_dashboard needs selenium"
        if not (shutil.which("chromium") or shutil.which("chromium-browser")) or not shutil.which("chromedriver"):
            return "bench_dashboard needs Chromium and chromedriver"
    return None


def run_script(script: Path, *args: str, results_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, RESULTS_ENV: str(results_dir)}
    return subprocess.run([sys.executable, str(script), "--smoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS, ids=[benchmark_name(s.name) for s in SCRIPTS])
def test_every_benchmark_runs_at_its_smoke_size_and_ends_with_its_json_line(script, tmp_path):
    # Prepare
    name = benchmark_name(script.name)
    assert name in EXPECTED_KEYS, f"declare the keys of {script.name}'s last line in EXPECTED_KEYS"
    reason = _skip_reason(name)
    if reason:
        pytest.skip(reason)

    # Execute
    done = run_script(script, results_dir=tmp_path)

    # Assert: it ran, and its last line is one JSON object with its documented keys, saying smoke
    assert done.returncode == 0, f"{script.name} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(out, dict)
    assert EXPECTED_KEYS[name] <= set(out), f"missing {sorted(EXPECTED_KEYS[name] - set(out))}"
    assert out["smoke"] is True
    assert not list(tmp_path.iterdir()), "nothing is recorded without --record"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_record_appends_the_last_line_dated_and_with_the_commit(tmp_path):
    # Prepare
    script = REPO / "scripts" / "bench_jobs.py"
    tracked = REPO / "docs" / "results" / "jobs.jsonl"
    before = tracked.read_text() if tracked.exists() else None

    # Execute: twice, to a results directory of the test's own
    runs = [run_script(script, "--record", results_dir=tmp_path, timeout=100) for _ in range(2)]

    # Assert: one line per run, each the printed line plus date and commit
    assert all(done.returncode == 0 for done in runs), runs[-1].stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "jobs.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for done, record in zip(runs, records):
        printed = json.loads(done.stdout.strip().splitlines()[-1])
        assert {k: v for k, v in record.items() if k not in ("date", "commit")} == printed
        assert record["date"].endswith("+00:00") and record["commit"] == commit_id()
    assert (tracked.read_text() if tracked.exists() else None) == before  # the repository's record untouched


def test_the_commit_is_unknown_outside_git(tmp_path):
    assert commit_id(tmp_path) == "unknown"
    assert benchmark_name("scripts/bench_time_to_accuracy.py") == "time_to_accuracy"


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _namespaces() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_stops_every_process_and_namespace_the_benchmark_started(tmp_path):
    # Prepare: the chaos benchmark at smoke size (a coordinator and four boards; as root each board in
    # a network namespace of its own), until its boards run
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "bench_chaos.py"), "--smoke"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, RESULTS_ENV: str(tmp_path)})
    started: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            for child in _descendants(proc.pid):
                started.setdefault(child.pid, child)
            boards = [p for p in started.values() if _alive(p) and "client" in _cmdline(p)]
            if len(boards) >= 4 and all(_cpu_s(p) > 1.0 for p in boards):  # past their imports
                break
            time.sleep(0.2)
        assert proc.poll() is None and len(boards) >= 4, "the benchmark did not start its boards"
        ours = {ns for ns in _namespaces() if ns.startswith(("chcl", "chch")) and f"{proc.pid % 10000}-" in ns}

        # Execute
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        _, err = proc.communicate(timeout=60)

        # Assert: it ended promptly, nothing it started is left: no process, no namespace
        assert time.monotonic() - began < 45
        assert proc.returncode != 0
        for child in _descendants(proc.pid):
            started.setdefault(child.pid, child)
        survivors = [p for p in started.values() if _alive(p)]
        assert not survivors, f"still running: {[_cmdline(p) for p in survivors]}"
        assert not ours & _namespaces()
        assert not _cgroups_of(started), "a CPU or memory group of a board it started is left"
    finally:
        for p in [*started.values()]:
            if _alive(p):
                p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cgroups_of(processes: dict[int, psutil.Process]) -> list[Path]:
    """The emulator's CPU and memory groups (named ...-<pid>) of these processes still present."""
    roots = [Path(DEFAULT_CGROUP_ROOT, "edgetrain"), Path(DEFAULT_MEMORY_CGROUP_ROOT, "edgetrain")]
    return [group for root in roots if root.is_dir() for group in root.iterdir()
            if group.is_dir() and group.name.rsplit("-", 1)[-1] in {str(pid) for pid in processes}]


def _cpu_s(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def test_time_to_accuracy_resumes_only_arms_of_this_commit_started_within_12_hours():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_tta", REPO / "scripts" / "bench_time_to_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    now = 1_800_000_000.0
    runs = [{"commit": "abc", "launched_at": now - 3600}, {"commit": "abc", "launched_at": now - 7200}]

    assert bench.reusable(runs, "abc", now)
    assert not bench.reusable(runs, "def", now)  # another commit
    assert not bench.reusable(runs, "abc-dirty", now)  # uncommitted code: no promise it is the same
    assert not bench.reusable([{**runs[0], "launched_at": now - 13 * 3600}, runs[1]], "abc", now)  # another day
    assert not bench.reusable([{"launched_at": now}], "abc", now)  # ran before runs recorded their commit
    assert not bench.reusable(None, "abc", now)  # a seed did not finish
    assert bench.provenance(runs) == {"commit": "abc", "started": "2027-01-15T06:00:00Z"}


def test_time_to_accuracy_counts_the_predicted_front_plans_that_differ_in_kind_or_board_set(monkeypatch):
    import importlib.util

    from coordinator.planning import command

    spec = importlib.util.spec_from_file_location("bench_tta", REPO / "scripts" / "bench_time_to_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # Prepare: a front as `edgetrain plan --objective pareto --json` gives it: two DP plans over the
    # same three boards (one with the fourth beside: not left out), a pipeline over the same three,
    # and a DP plan over two
    plans = [{"kind": "dp", "left_out": {"d": "no gain"}}, {"kind": "dp", "left_out": {}},
             {"kind": "dp", "left_out": {"d": "no gain"}}, {"kind": "pipeline", "left_out": {"d": "no gain"}},
             {"kind": "dp", "left_out": {"c": "no gain", "d": "no gain"}}]
    monkeypatch.setattr(command, "plan_report", lambda *a, **kw: json.dumps(
        {"devices": {b: "cpu" for b in "abcd"}, "plans": plans}))

    front = bench.predicted_front(bench.FLEETS["compute"], "small_cnn", 64)

    assert front == {"plans": 5, "distinct": 4,
                     "structures": ["dp: a+b", "dp: a+b+c", "dp: a+b+c+d", "pipeline: a+b+c"]}
