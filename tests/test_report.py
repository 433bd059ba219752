"""Results and report of experiment runs: time and energy to target, medians over repeats, the
ratio to ddp, report.md, the plots.

Run directories are written by hand in the format the coordinator and the experiment runner
write (metrics.jsonl records, summary.json, job.json, arm.json): for `collect` and
`build_report` they are inputs. One slow test runs `edgetrain plan` for the Pareto front, one
runs `collect` on the directory of a short real run.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from coordinator.planning.inputs import machine_costs
from edgetrain.config import ConfigError
from edgetrain.experiment.fleet_plan import _fleet_file
from edgetrain.experiment.report import INSECURE_LABEL, arms_table, build_report
from edgetrain.experiment.results import collect, describe_plan, load_run
from edgetrain.fleet_file import load_fleet

BATCH = 32


def device(compute_s: float, comm_s: float, energy_j: float | None, upload_bytes: int = 1000) -> dict:
    """A board's entry in a train record's `devices`, as coordinator.training.metrics writes it."""
    return {"samples": BATCH // 2, "compute_s": compute_s, "download_s": comm_s / 2, "encode_s": 0.0,
            "upload_s": comm_s / 2, "comm_s": comm_s, "energy_j": energy_j, "codec": "none",
            "upload_bytes": upload_bytes, "staleness": 0, "weight": 1.0}


def train(step: int, end: float, step_s: float, energy: tuple[float | None, float | None] = (1.0, 0.5)) -> dict:
    return {"time": end, "kind": "train", "step": step, "epoch": 0.1 * step, "loss": 2.0, "train_accuracy": 0.2,
            "lr": 0.05, "samples": BATCH, "step_s": step_s, "samples_per_s": BATCH / step_s, "attempts": 1,
            "shares": {"a": 16, "b": 16}, "codecs": {"a": "none", "b": "none"},
            "devices": {"a": device(0.6 * step_s, 0.2 * step_s, energy[0]),
                        "b": device(0.3 * step_s, 0.5 * step_s, energy[1])},
            "rejected": {}, "clipped": {}, "failed": [], "late": [], "quarantined": [], "attempt_log": []}


def evaluation(step: int, end: float, accuracy: float, eval_s: float) -> dict:
    return {"time": end, "kind": "eval", "step": step, "test_loss": 1.0, "test_accuracy": accuracy,
            "test_samples": 128, "eval_s": eval_s}


def write_run(path: Path, records: list[dict], *, arm: str | None, repeat: int = 0, baseline: str | None = None,
              target: float | None = 0.7, synthetic: bool = True, **arm_fields) -> Path:
    """A run directory as the runner leaves it (arm=None: a plain coordinator run, no arm.json)."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    trains = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    (path / "summary.json").write_text(json.dumps({
        "job": "test", "model": "small_cnn", "dataset": "synthetic", "synthetic_data": synthetic,
        "split": "proportional", "global_batch": BATCH, "steps": len(trains),
        "test_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "train_samples": BATCH * len(trains), "bytes_per_sample": 2500.0, "devices": [], "plan": None}))
    (path / "job.json").write_text(json.dumps({
        "name": "test", "model": "small_cnn", "seed": repeat, "dataset": {"name": "synthetic"},
        "training": {"global_batch": BATCH, "target_accuracy": target or 0.0, "split": "proportional"},
        "pipeline": {"stages": [], "stage_state": "hosts", "replicate": True}}))
    if arm is not None:
        (path / "arm.json").write_text(json.dumps({
            "experiment": "exp", "arm": arm, "repeat": repeat, "seed": repeat, "baseline": baseline,
            "fleet": None, "fleet_boards": [], "exit_code": 0, "stop": {"target_accuracy": target, "time_cap_s": 900},
            "target_accuracy": target, "insecure": baseline == "ddp", "synthetic_data": synthetic, "setup": {},
            **arm_fields}))
    return path


def reaching(path: Path, arm: str, repeat: int, at: float | None, *, baseline: str | None = None,
             energy: float | None = 1.0) -> Path:
    """A run of 1-s steps from t=1000 whose evaluation after the step ending at 1000+`at` first
    reaches 0.7 (None: it never does; it stops at 1000+20)."""
    end = at if at is not None else 20.0
    records = [train(s, 1000.0 + s + 1, 1.0, (energy, energy)) for s in range(int(end))]
    records.append(evaluation(int(end) - 1, 1000.0 + end, 0.8 if at is not None else 0.5, 0.0))
    return write_run(path / f"{arm}-r{repeat}", records, arm=arm, repeat=repeat, baseline=baseline)


def png_title(path: Path) -> str:
    with Image.open(path) as image:
        image.verify()  # a valid PNG, or this raises
    with Image.open(path) as image:
        assert image.size[0] > 100 and image.size[1] > 100
        return image.text.get("Title", "")


def test_time_and_energy_to_target_count_the_window_less_evaluation_plus_counted_setup(tmp_path):
    # Prepare: steps of 2 s from t=1010; evaluations after steps 1, 3, 4; the one after step 3
    # (at 1020.5, 1.5 s of evaluating) first reaches 0.7. Counted set-up: 5 s and 2 J of data
    # shipping; profiling (3 s) is set-up, not counted. Launched at 1000.
    records = [
        {"time": 1003.0, "kind": "setup", "what": "profiling", "seconds": 3.0},
        {"time": 1004.0, "kind": "setup", "what": "data_ship", "seconds": 5.0, "counted": True, "energy_j": 2.0},
        train(0, 1012.0, 2.0), train(1, 1014.0, 2.0), evaluation(1, 1015.0, 0.4, 1.0),
        train(2, 1017.0, 2.0), train(3, 1019.0, 2.0), evaluation(3, 1020.5, 0.75, 1.5),
        train(4, 1023.0, 2.0), evaluation(4, 1024.0, 0.8, 1.0)]
    run = write_run(tmp_path / "centralized-r0", records, arm="centralized", baseline="centralized",
                    launched_at=1000.0, ended_at=1030.0)

    # Execute
    [row] = collect([run])

    # Assert: window 1010 -> 1020.5, less 1.0 + 1.5 s of evaluation, plus 5 s counted
    assert row["reached"] is True and row["steps_to_target"] == 4
    assert row["time_to_target_s"] == pytest.approx(1020.5 - 1010 - 2.5 + 5.0)
    assert row["energy_to_target_j"] == pytest.approx(4 * 1.5 + 2.0)  # steps 0-3, 1.5 J each, + shipping
    assert row["energy_j"] == pytest.approx(5 * 1.5)
    assert row["setup_s"] == pytest.approx(10.0)  # launch to first step (10 s) > recorded (8 s)
    assert "profiling 3.0 s" in row["setup"] and "data_ship 5.0 s (counted)" in row["setup"]
    assert row["samples_per_s"] == pytest.approx(5 * BATCH / 10.0)
    assert row["final_accuracy"] == 0.8 and row["steps"] == 5 and row["wall_s"] == 30.0
    assert row["bytes_per_sample"] == 2500.0 and row["plan"] == "the gateway alone (the boards' data shipped to it)"
    assert (row["experiment"], row["arm"], row["baseline"], row["insecure"]) == ("exp", "centralized", "centralized",
                                                                                 False)
    # a lower target given by the caller is reached at the first evaluation
    [low] = collect([run], target_accuracy=0.3)
    assert low["steps_to_target"] == 2 and low["time_to_target_s"] == pytest.approx(1015 - 1010 - 1.0 + 5.0)


def test_unknown_energy_and_a_plain_coordinator_run(tmp_path):
    # Prepare: board b reports no energy at step 1 only; no arm.json (an `edgetrain coordinator` run)
    records = [train(0, 1002.0, 2.0), train(1, 1004.0, 2.0, energy=(1.0, None)), evaluation(1, 1005.0, 0.9, 0.5)]
    run = write_run(tmp_path / "my-run", records, arm=None, target=0.7)

    # Execute
    [row] = collect([run])

    # Assert: reached, but energy unknown (None, never 0); names derived from the directory and job
    assert row["reached"] and row["time_to_target_s"] == pytest.approx(4.5)
    assert row["energy_to_target_j"] is None and row["energy_j"] is None
    assert (row["arm"], row["experiment"], row["repeat"], row["seed"]) == ("my-run", tmp_path.name, 0, 0)
    assert row["plan"] == "data parallelism, proportional split" and row["setup_s"] is None
    assert arms_table([row])[2].startswith("| my-run | 1 | 1 of 1 | 4.5 s | unknown |")  # report.md's table


def test_report_medians_ratios_to_ddp_labels_and_plots(tmp_path):
    # Prepare: ddp reaches the target at 40/50/60 s; hybrid at 10 s, 12 s and not within the cap
    runs = [reaching(tmp_path, "ddp", k, at, baseline="ddp") for k, at in enumerate((60.0, 40.0, 50.0))]
    runs += [reaching(tmp_path, "hybrid", k, at) for k, at in enumerate((10.0, None, 12.0))]
    runs.append(reaching(tmp_path, "single", 0, None, energy=None))  # one repeat, never there, no energy

    # Execute
    report_path = build_report(runs, tmp_path / "out", title="Hybrid vs DDP")

    # Assert: the table
    report = report_path.read_text()
    assert report.startswith("# Hybrid vs DDP\n")
    assert "**Synthetic data**" in report and "Target: test accuracy ≥ 0.700, time cap 900 s per run." in report
    assert "evaluation is measurement, not training" in report
    ddp_row = next(line for line in report.splitlines() if line.startswith(f"| ddp — {INSECURE_LABEL} | 3 |"))
    assert "| 50.0 s [40.0 s–60.0 s] | 100 J [80 J–120 J] |" in ddp_row
    hybrid_row = next(line for line in report.splitlines() if line.startswith("| hybrid | 3 | 2 of 3 |"))
    assert "| 12.0 s [10.0 s–not reached within the cap] |" in hybrid_row
    assert "| 0.24× (4.2× sooner) | 0.24× (4.2× less) |" in hybrid_row  # 12/50; 24 J / 100 J
    single_row = next(line for line in report.splitlines() if line.startswith("| single | 1 | 0 of 1 |"))
    assert single_row.count("not reached within the cap") == 2
    # results.csv: one row per run
    with (tmp_path / "out" / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(r["arm"], r["repeat"]) for r in table] == [("ddp", "0"), ("ddp", "1"), ("ddp", "2"), ("hybrid", "0"),
                                                        ("hybrid", "1"), ("hybrid", "2"), ("single", "0")]
    assert table[4]["reached"] == "False" and table[4]["time_to_target_s"] == "" and table[0]["insecure"] == "True"
    # plots: valid PNGs, titled as synthetic; what is missing is said
    plots = tmp_path / "out" / "plots"
    names = sorted(p.name for p in plots.glob("*.png"))
    assert names == ["accuracy_vs_energy.png", "accuracy_vs_time.png", "samples_per_s.png", "timeline_ddp.png",
                     "timeline_hybrid.png", "timeline_single.png"]
    for name in names:
        assert png_title(plots / name).endswith("(synthetic data)"), name
        assert f"](plots/{name})" in report
    assert "left out (no energy figures): single" in report
    assert "never reached the target: single" in report
    assert "No Pareto front: the runs record no fleet" in report
    assert "no fleet ideal" in report  # no fleet file, no board profiles in summary.json


def test_real_data_is_not_labelled_synthetic_and_traces_get_their_own_table(tmp_path):
    # Prepare: one arm on real data; two multi-job trace arms (seed 003)
    run = write_run(tmp_path / "real", [train(0, 1002.0, 2.0), evaluation(0, 1003.0, 0.71, 1.0)], arm="dp",
                    synthetic=False)
    traces = []
    for arm, finished in (("rolling", (1100.0, 1300.0)), ("fifo", (1200.0, 1400.0))):
        path = tmp_path / arm
        path.mkdir()
        (path / "trace.json").write_text(json.dumps({"scheduler": arm, "jobs": [
            {"job": "j1", "submitted": 1000.0, "finished": finished[0]},
            {"job": "j2", "submitted": 1050.0, "finished": finished[1]}]}))
        (path / "arm.json").write_text(json.dumps({"experiment": "trace", "arm": arm, "repeat": 0,
                                                   "synthetic_data": False}))
        traces.append(path)

    # Execute
    rows = collect([run, *traces])
    report = build_report([run, *traces], tmp_path / "out").read_text()

    # Assert
    assert rows[1]["makespan_s"] == 300.0 and rows[1]["mean_jct_s"] == pytest.approx((100 + 250) / 2)
    assert "ynthetic" not in report
    assert "## Multi-job traces" in report and "| rolling | 1 | 300 s | 175 s | rolling |" in report
    for png in (tmp_path / "out" / "plots").glob("*.png"):
        assert "synthetic" not in png_title(png)


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty: not a run directory"):
        collect([tmp_path / "empty"])
    bad = write_run(tmp_path / "bad", [train(0, 1002.0, 2.0)], arm="x")
    (bad / "metrics.jsonl").write_text("{not json\n" + json.dumps(train(1, 1004.0, 2.0)) + "\n")
    with pytest.raises(ConfigError, match=r"bad/metrics.jsonl: line 1 is not JSON"):
        collect([bad])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pareto_front_from_edgetrain_plan_marks_the_hybrid_plan(tmp_path):
    # Prepare: a fleet file of two boards with power figures; a hybrid arm whose planner chose
    # pure DP over both (as a `plan` record)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("name: pair\njob: {model: small_cnn}\nboards:\n"
                     "  - {name: a, speed: 0.5, link: {mbit_per_s: 100}, battery: {capacity_wh: 20, idle_w: 2, busy_w: 6}}\n"
                     "  - {name: b, speed: 0.2, link: {mbit_per_s: 20}, battery: {capacity_wh: 20, idle_w: 1, busy_w: 4}}\n")
    plan = {"time": 1000.0, "kind": "plan", "step": 0, "reasons": ["first plan"], "switched": True,
            "plan": {"stages": [], "microbatches": 1, "schedule": "1f1b", "dp_boards": ["a", "b"], "dp_share": 1.0},
            "plan_kind": "dp", "left_out": {}, "predicted_step_s": 0.05, "predicted_samples_per_s": 640.0,
            "predicted_energy_per_sample_j": 0.01}
    hybrid = write_run(tmp_path / "hybrid-r0", [plan, train(0, 1002.0, 2.0), evaluation(0, 1003.0, 0.8, 0.1)],
                       arm="hybrid")
    # this machine's figures for small_cnn in the session's measurement cache (test_live_planner
    # measures the same), so the subprocess below plans without importing torch
    machine_costs("small_cnn")

    # Execute: the front and the ideal come from `edgetrain plan` run as a subprocess on the
    # fleet the runner passes (a FleetSpec, written out as a fleet file)
    report = build_report([hybrid], tmp_path / "out", fleet=load_fleet(fleet)).read_text()

    # Assert
    assert "pareto_front.png" in report and "planner: dp — data parallelism over a+b" in report
    assert png_title(tmp_path / "out" / "plots" / "pareto_front.png") == \
        "Planner's time/energy front: pair, small_cnn (synthetic data)"
    assert "Σ board speed × small_cnn's one-core samples/s on this machine" in report
    assert "No Pareto front" not in report


def test_a_run_directory_alone_is_enough_to_plan_its_fleet(tmp_path):
    # Prepare: a run whose fleet file is gone; arm.json recorded its boards (speed, link, power)
    boards = [{"name": "b50", "speed": 0.5, "mbit_per_s": 100, "idle_w": 2.7, "busy_w": 7.3},
              {"name": "b10", "speed": 0.1, "mbit_per_s": None, "idle_w": 2.7, "busy_w": 3.6}]
    run = write_run(tmp_path / "r", [train(0, 1001.0, 1.0)], arm="hybrid", fleet="gone", fleet_boards=boards)

    # Execute
    path = _fleet_file([load_run(run)], None, "small_cnn", tmp_path)

    # Assert: the fleet edgetrain plan gets has those boards, links and power figures
    fleet = load_fleet(path)
    assert [(b.name, b.speed, b.link.mbit_per_s if b.link else None, b.busy_w) for b in fleet.boards] == [
        ("b50", 0.5, 100, 7.3), ("b10", 0.1, None, 3.6)]


def test_a_federated_arm_is_described_as_federated_rounds(tmp_path):
    run = write_run(tmp_path / "fed", [train(0, 1001.0, 1.0)], arm="federated")
    job = json.loads((run / "job.json").read_text())
    job.update(aggregation={"rule": "fedavg"}, federated={"local_steps": 5, "local_batch": 16})
    (run / "job.json").write_text(json.dumps(job))

    assert describe_plan(load_run(run)) == "federated rounds (fedavg), 5 local steps of 16 a round"
