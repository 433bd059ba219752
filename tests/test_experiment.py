"""Experiments as files (edgetrain.experiment.spec, .runner and `edgetrain experiment run`): bad
files refused in one line naming the key (exit 2), stop rules as job keys, repeats and seeds as
runs, what a live fleet refuses, and one real run of two EdgeTrain arms on two emulated boards."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import read_metrics, wait_for

from edgetrain.cli import main
from edgetrain.experiment.results import collect
from edgetrain.experiment.runner import check_live
from edgetrain.experiment.spec import (
    UNBOUNDED_STEPS,
    SpecError,
    StopRule,
    load_experiment,
    parse_stop,
)

ROOT = Path(__file__).resolve().parent.parent
JOB = {"name": "tiny", "model": "small_cnn",
       "dataset": {"name": "synthetic", "train_size": 256, "test_size": 64, "augment": False},
       "training": {"global_batch": 16, "eval_every": 2, "log_every": 1},
       "optimizer": {"lr": 0.05, "schedule": "constant"}}
FLEET = {"name": "two", "network": "loopback", "boards": [{"name": "fast", "speed": 0.5}, {"name": "slow", "speed": 0.3}]}


def _write(tmp_path: Path, experiment: dict, name: str = "exp.yaml") -> Path:
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"name": "tiny", "job": JOB, "fleet": "fleet.yaml", "stop": {"steps": 3},
                                    "arms": [{"name": "a"}], **experiment}))
    return path


@pytest.mark.parametrize("change, named", [
    ({"repeat": 2}, "unknown key 'repeat'"),
    ({"stop": {"target_accuracy": 0.7}}, "needs time_cap_s"),
    ({"stop": {"steps": 0}}, "stop: steps=0: must be > 0"),
    ({"arms": [{"name": "x", "baseline": "horovod"}]}, "arms: x: baseline='horovod'"),
    ({"arms": [{"name": "x", "set": {"training.split": "diagonal"}}]}, "arms: x: job: training: split='diagonal'"),
    ({"arms": [{"name": "x"}, {"name": "x"}]}, "name 'x' is used twice"),
    ({"set": {"training.global_batch": -1}}, "global_batch=-1"),
    ({"repeats": 2, "seeds": [1, 2]}, "repeats or seeds, not both"),
    ({"arms": [{"name": "t", "trace": {"jobs": "none.yaml", "scheduler": "fifo"}}]}, "none.yaml: trace file not found"),
])
def test_a_bad_experiment_is_one_line_naming_the_key_exit_2(tmp_path, capsys, change, named):
    path = _write(tmp_path, change)

    code = main(["experiment", "run", str(path), "--out", str(tmp_path / "out")])

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and str(tmp_path) in err, err
    assert named in err, err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_the_command_line_refuses_in_one_line_without_a_traceback(tmp_path):
    path = _write(tmp_path, {"stop": {"wall_s": 30, "time_cap_s": 60}})

    done = subprocess.run([sys.executable, "-m", "edgetrain", "experiment", "run", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert "time_cap_s=60" in done.stderr and "Traceback" not in done.stderr


def test_unknown_arm_and_missing_fleet_are_refused(tmp_path, capsys):
    path = _write(tmp_path, {})
    assert main(["experiment", "run", str(path), "--arms", "a,zz"]) == 2
    assert "--arms: no arm 'zz' (arms: a)" in capsys.readouterr().err
    data = yaml.safe_load(path.read_text())
    del data["fleet"]
    path.write_text(yaml.safe_dump(data))
    assert main(["experiment", "run", str(path)]) == 2
    assert "no fleet" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path}: not a run directory" in capsys.readouterr().err


def test_stop_rules_map_to_job_keys():
    assert StopRule(steps=40).job_overrides() == {
        "training.epochs": 0.0, "training.steps": 40, "training.target_accuracy": 0.0}
    assert parse_stop({"wall_s": 600}, "x").job_overrides() == {
        "training.epochs": 0.0, "training.time_limit_s": 600.0, "training.steps": UNBOUNDED_STEPS,
        "training.target_accuracy": 0.0}
    rule = parse_stop({"target_accuracy": 0.7, "time_cap_s": 900, "steps": 5000}, "x")
    assert rule.job_overrides() == {"training.epochs": 0.0, "training.target_accuracy": 0.7,
                                    "training.time_limit_s": 900.0, "training.steps": 5000}
    assert rule.cap_s == 900.0 and rule.to_dict() == {"steps": 5000, "target_accuracy": 0.7, "time_cap_s": 900.0}
    with pytest.raises(SpecError, match="x: unknown key 'epochs'"):
        parse_stop({"epochs": 3}, "x")
    with pytest.raises(SpecError, match="x: empty"):
        parse_stop({}, "x")


def test_seeds_and_repeats_make_one_run_per_arm_and_seed_with_the_stop_rule_applied(tmp_path):
    job = {**JOB, "seed": 5, "training": {**JOB["training"], "epochs": 2.0, "min_clients": 1}}
    path = _write(tmp_path, {"job": job, "repeats": 2, "set": {"training": {"global_batch": 32}},
                             "arms": [{"name": "p"}, {"name": "e", "set": {"training.split": "equal"}}]})

    runs = load_experiment(path).runs(boards=2)

    assert [(r.name, r.seed) for r in runs] == [("p-r0", 5), ("e-r0", 5), ("p-r1", 6), ("e-r1", 6)]
    assert {r.job["name"] for r in runs} == {"p-r0", "p-r1", "e-r0", "e-r1"}
    assert all(r.job["training"]["steps"] == 3 and r.job["training"]["epochs"] == 0 for r in runs)  # stop wins
    assert all(r.job["training"]["global_batch"] == 32 and r.job["training"]["min_clients"] == 2 for r in runs)
    assert [r.job["training"]["split"] for r in runs] == ["proportional", "equal"] * 2
    seeded = yaml.safe_load(path.read_text())
    seeded.pop("repeats")
    path.write_text(yaml.safe_dump({**seeded, "seeds": [0, 7]}))
    assert [(r.name, r.seed) for r in load_experiment(path).runs(["e"], boards=2)] == [("e-r0", 0), ("e-r1", 7)]
    once = {**seeded, "seeds": [0, 7, 9], "arms": [{"name": "p", "repeats": 1}, {"name": "e", "repeats": 2}]}
    path.write_text(yaml.safe_dump(once))
    assert [(r.name, r.seed) for r in load_experiment(path).runs(boards=2)] == [("p-r0", 0), ("e-r0", 0), ("e-r1", 7)]
    path.write_text(yaml.safe_dump({**once, "arms": [{"name": "p", "repeats": 0}]}))
    with pytest.raises(SpecError, match="repeats"):
        load_experiment(path)


def test_a_live_fleet_refuses_baselines_and_traces_in_one_line(tmp_path, capsys):
    path = _write(tmp_path, {"arms": [{"name": "hybrid"}, {"name": "ddp", "baseline": "ddp"}]})
    arms = load_experiment(path).arms

    with pytest.raises(SpecError, match="no authentication: on a live fleet it needs --insecure"):
        check_live(arms, insecure=False)
    with pytest.raises(SpecError, match="not supported yet"):
        check_live(arms, insecure=True)
    check_live(arms[:1], insecure=False)
    # refused before any server is dialed (nothing answers at port 1)
    assert main(["experiment", "run", str(path), "--live", "--server", "127.0.0.1:1"]) == 2
    assert "needs --insecure" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_experiment_runs_its_arms_on_emulated_boards_and_writes_arm_json(tmp_path):
    # one EdgeTrain arm (a coordinator and a client per board) and one baseline arm (one launcher)
    path = _write(tmp_path, {"arms": [{"name": "proportional"}, {"name": "single", "baseline": "single"}],
                             "seeds": [3]})
    out = tmp_path / "results"

    done = subprocess.run([sys.executable, "-m", "edgetrain", "experiment", "run", str(path), "--out", str(out),
                           "--data-dir", str(tmp_path / "data")], cwd=ROOT, capture_output=True, text=True,
                          timeout=220, env={**os.environ, "GRPC_VERBOSITY": "ERROR"})

    assert done.returncode == 0, done.stderr[-3000:]
    for arm, baseline in (("proportional", None), ("single", "single")):
        run_dir = out / f"{arm}-r0"
        record = json.loads((run_dir / "arm.json").read_text())
        assert {k: record[k] for k in ("experiment", "arm", "repeat", "seed", "baseline", "fleet", "exit_code",
                                       "stop", "target_accuracy", "insecure", "synthetic_data")} == {
            "experiment": "tiny", "arm": arm, "repeat": 0, "seed": 3, "baseline": baseline, "fleet": "two",
            "exit_code": 0, "stop": {"steps": 3}, "target_accuracy": None, "insecure": False, "synthetic_data": True}
        assert [b["name"] for b in record["fleet_boards"]] == ["fast", "slow"]
        assert isinstance(record["setup"], dict)
        job = json.loads((run_dir / "job.json").read_text())
        assert (job["seed"], job["training"]["min_clients"]) == (3, 2)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        assert [r["step"] for r in train] == [0, 1, 2]
        # the timed window (from the first step's start) lies between the arm's launch and its end
        assert record["launched_at"] < train[0]["time"] - train[0]["step_s"] < train[-1]["time"] <= record["ended_at"]
        trained = {d.rsplit("-", 1)[0] if baseline is None else d for r in train for d in r["devices"]}
        # device ids are the board names with a registration number; the single arm is the fastest board
        assert trained == ({"fast", "slow"} if baseline is None else {"fast"})
        assert all(d["energy_j"] is not None for r in train for d in r["devices"].values())
    assert not (out / "proportional-r0" / "launch" / "trust").exists()  # the run's throwaway keys are gone
    with (out / "results.csv").open() as f:
        rows = {row["arm"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"proportional", "single"}
    assert all(0 <= float(row["final_accuracy"]) <= 1 and float(row["samples_per_s"]) > 0 for row in rows.values())
    report = (out / "report.md").read_text()
    assert "Synthetic data" in report and "| proportional" in report and "| single" in report
    # time to a target of 0 on the real records: first step's start to the first evaluation (after
    # step 2), less that evaluation's own time
    run_dir = out / "proportional-r0"
    [row] = collect([run_dir], target_accuracy=0.0)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "train")
    evaluation = next(r for r in records if r["kind"] == "eval")
    assert row["reached"] and row["steps_to_target"] == 2 and row["steps"] == 3
    assert row["time_to_target_s"] == pytest.approx(
        evaluation["time"] - (first["time"] - first["step_s"]) - evaluation["eval_s"], abs=0.01)


@pytest.mark.timeout(180)
def test_sigterm_stops_the_runner_and_every_process_it_started(tmp_path):
    # Prepare: an arm far longer than the test, its coordinator and boards training
    path = _write(tmp_path, {"stop": {"wall_s": 3600}})
    out = tmp_path / "results"
    started: list[psutil.Process] = []
    runner = subprocess.Popen([sys.executable, "-m", "edgetrain", "experiment", "run", str(path), "--out", str(out),
                               "--data-dir", str(tmp_path / "data")], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "GRPC_VERBOSITY": "ERROR"})
    try:
        wait_for(lambda: read_metrics(out / "a-r0"), 150, "the arm's first step", interval_s=0.5)
        started += psutil.Process(runner.pid).children(recursive=True)
        assert len(started) >= 3  # a coordinator and a client per board

        # Execute: what a service manager or `kill` sends
        runner.terminate()
        code = runner.wait(timeout=60)

        # Assert: the runner ended as on Ctrl-C, and nothing it started is left running
        _, alive = psutil.wait_procs(started, timeout=30)
        assert code == 130 and not alive, [p.cmdline() for p in alive]
    finally:
        for proc in [*started, psutil.Process(runner.pid)] if runner.poll() is None else started:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
