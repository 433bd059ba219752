"""Benchmark: time and energy to a fixed test accuracy, EdgeTrain against PyTorch DDP.

Two emulated fleets of four boards at 0.5, 0.3, 0.2 and 0.1 of a core:
- `compute`: loopback links (no shaping): the boards differ only in speed;
- `bandwidth`: the same boards on links of 100, 50, 20 and 10 Mbit/s.
On each, MobileNetV2 trains on the harder SYNTHETIC tier (`synthetic-hard`, calibrated so a
centralized run needs several epochs to pass its target: docs/calibration.md) with a global
batch of 64, to the calibrated target accuracy (`edgetrain.catalog.SYNTHETIC_HARD_TARGET`, the
same for every arm) with a time cap. A third job, `small`, trains the small CNN on the compute
fleet (50,000 `synthetic-hard` items, learning rate 0.02, to `SMALL_CNN_HARD_TARGET`, calibrated
so the fastest board alone needs about 5 minutes): a model so small that each step's fixed costs
weigh most. `--fleets` names any of the three. The arms, run by `edgetrain experiment run`:
- `ddp`: PyTorch DistributedDataParallel over gloo, the framework's equal split (no
  authentication: loopback or this run's network namespaces only); seed 0 only, whatever
  `--seeds` says (the EdgeTrain arms' medians are compared with it);
- `single`: the fastest board alone, no coordinator (the runner's baseline);
- `proportional`: EdgeTrain, synchronous data parallelism, shares from measured speed
  (`planner.enabled: false`);
- `federated`: EdgeTrain federated averaging with a shared time budget per round (each board's
  local steps follow its speed), FedNova-normalised, planner off;
- `planner`: EdgeTrain's defaults: the planner measures its candidates and keeps the fastest,
  boards too slow to wait for train beside the steps (`hybrid` is its old name).
On the slow links EdgeTrain's arms choose each board's update codec from its measured link
(`compression.uplink: adaptive`) and send parameters down as int8 deltas.
Each arm's time to target is its timed window (first training step to the evaluation that
reaches the target, evaluation time excluded in every arm); set-up is reported beside it.

DDP on the slow links may need hours. There its time is projected, as the issue allows: DDP's
arithmetic does not depend on the links, so its steps to the target on the `compute` fleet
times its median step time measured on the slow links over a real segment of `--segment` (≥ 10)
steps; its energy likewise (energy per step on the slow links). The JSON lists projected arms.
Without root the links cannot be shaped for gloo (it is not ours to throttle): then the DDP
segment runs on loopback and its projection would be meaningless, so it is reported as null.

    python scripts/bench_time_to_accuracy.py [--seeds 1] [--cap-s 1800]
                                             [--fleets compute,bandwidth,small]
                                             [--arms ddp,single,proportional,federated,planner]
                                             [--keep DIR [--resume]] [--smoke] [--record]

Last line: one JSON object: `target_accuracy` (the MobileNetV2 fleets'; null when neither ran),
`fleets` → `compute` / `bandwidth` / `small` → `time_to_accuracy_s` and `energy_to_accuracy_j`
(maps by arm, medians over seeds; null where the cap was hit), the ratios of DDP's time and energy
to the best EdgeTrain arm's, and with a `planner` arm: `planner_over_best_other` (its time ÷ the
best of single, proportional and federated), `proportional_over_planner`, `ddp_over_planner`,
`exploration_s` (seconds its trials took, median) and `weak_board_sample_share` (the 0.1-core
board's applied samples × their aggregation weight ÷ all, median); per fleet `model`,
`target_accuracy` and `front`: the planner's predicted time/energy front on that fleet (`edgetrain
plan --objective pareto`), its `plans`, how many are `distinct` in kind or board set, and those
`structures`; `cap_s`, `seeds`, `projected` (list of "fleet/arm"), `reused` (arms read from an
earlier run with --resume: only arms whose every seed ran at this clean commit and started within
12 hours), and per fleet `arms` → arm → `commit`, `started`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from edgetrain.catalog import (
    SMALL_CNN_HARD_LR,
    SMALL_CNN_HARD_TARGET,
    SMALL_CNN_HARD_TRAIN_SIZE,
    SYNTHETIC_HARD_TARGET,
    SYNTHETIC_HARD_TEST_SIZE,
    SYNTHETIC_HARD_TRAIN_SIZE,
)
from edgetrain.experiment.bench_output import (
    add_bench_args,
    commit_id,
    finish,
    run_child,
    stop_on_sigterm,
)
from edgetrain.experiment.results import collect

REPO = Path(__file__).resolve().parent.parent
FLEETS = {"compute": REPO / "experiments" / "fleets" / "compute.yaml",
          "bandwidth": REPO / "experiments" / "fleets" / "bandwidth.yaml"}
MOBILENET = {"model": "mobilenet_v2", "train_size": SYNTHETIC_HARD_TRAIN_SIZE,
             "test_size": SYNTHETIC_HARD_TEST_SIZE, "target": SYNTHETIC_HARD_TARGET, "lr": 0.05}
JOBS = {"compute": {"fleet": "compute", **MOBILENET},
        "bandwidth": {"fleet": "bandwidth", **MOBILENET},
        "small": {"fleet": "compute", "model": "small_cnn", "train_size": SMALL_CNN_HARD_TRAIN_SIZE,
                  "test_size": SYNTHETIC_HARD_TEST_SIZE, "target": SMALL_CNN_HARD_TARGET, "lr": SMALL_CNN_HARD_LR}}
"""What `--fleets` names: a fleet and the job trained on it. `small` is the small CNN on the
compute fleet, where a step's fixed costs weigh most, to a target calibrated for one board alone
to need about 5 minutes (docs/calibration.md)."""
GLOBAL_BATCH = 64
"""Every job's and arm's global batch."""
FEDERATED_ROUND_S = 10.0
"""The federated arm's shared time budget per round: each board trains as many local steps of 16
as its speed fits in it."""
ARMS = {
    "ddp": {"baseline": "ddp", "repeats": 1},  # seed 0 only: the EdgeTrain medians are measured against it
    "single": {"baseline": "single"},
    "proportional": {"set": {"planner.enabled": False, "training.split": "proportional"}},
    "federated": {"set": {"planner.enabled": False, "aggregation.rule": "fedavg",
                          "federated.local_time_s": FEDERATED_ROUND_S, "federated.local_batch": 16,
                          "federated.normalize": True}},
    "planner": {"set": {"planner.enabled": True}},
}
ARMS["hybrid"] = ARMS["planner"]
ARMS["planner-no-local"] = {"set": {"planner.enabled": True, "planner.local_updates": False}}
ARMS["planner-no-trials"] = {"set": {"planner.enabled": True, "planner.trial_steps": 0}}
"""Ablations (not run by default): the planner without boards beside the steps, or without trials."""
EDGETRAIN_ARMS = ("proportional", "hybrid", "federated", "planner", "planner-no-local", "planner-no-trials")
OTHERS = ("single", "proportional", "federated")
"""What the planner is measured against: the best of these."""
WEAK_BOARD = "b10"
"""The 0.1-core board of both fleets."""
LINK_CODECS = {"compression.uplink": "adaptive", "compression.downlink": "int8"}
"""On the slow links EdgeTrain's arms run as a user would run them there: each board's update
codec chosen from its measured link, parameters sent down as int8 deltas (DDP has no such option)."""


SMOKE = {"model": "small_cnn", "train_size": 256, "test_size": 64, "target": 0.05, "lr": 0.05, "cap_s": 120.0,
         "eval_every": 2, "arms": "proportional", "fleets": "compute"}
"""--smoke: one small arm on the compute fleet to a target its first evaluation reaches."""


def job(spec: dict, eval_every: int) -> dict:
    """`spec`'s model on the harder synthetic tier, the demo's optimizer at `spec`'s learning rate."""
    return {
        "name": "tta", "model": spec["model"], "seed": 0,
        "dataset": {"name": "synthetic-hard", "train_size": spec["train_size"], "test_size": spec["test_size"],
                    "augment": True},
        "training": {"global_batch": GLOBAL_BATCH, "min_clients": 4, "eval_every": eval_every, "log_every": 20},
        "planner": {"enabled": True},  # EdgeTrain's defaults; arms that mean something else say so
        "optimizer": {"lr": spec["lr"], "momentum": 0.9, "weight_decay": 5.0e-4, "schedule": "constant",
                      "warmup_steps": 10},
    }


def arm_entry(arm: str, codecs: dict) -> dict:
    """An arm of the experiment file; EdgeTrain arms get `codecs` added to their settings."""
    entry = {"name": arm, **ARMS[arm]}
    if arm in EDGETRAIN_ARMS and codecs:
        entry["set"] = {**entry.get("set", {}), **codecs}
    return entry


def run_experiment(workdir: Path, name: str, job_spec: dict, arms: list[str], seeds: list[int], stop: dict,
                   eval_every: int, codecs: dict | None = None) -> list[dict]:
    """Write the experiment file, run it with `edgetrain experiment run`, return collect()'s rows."""
    spec = {"name": name, "job": job(job_spec, eval_every), "fleet": str(FLEETS[job_spec["fleet"]]),
            "stop": stop, "seeds": seeds,
            "arms": [arm_entry(arm, codecs or {}) for arm in arms]}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = workdir / name
    code = run_child([sys.executable, "-m", "edgetrain", "experiment", "run", str(path), "--out", str(out)], cwd=REPO)
    if code != 0:
        print(f"experiment {name} exited with code {code}; reading whatever it finished", file=sys.stderr)
    run_dirs = sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()) if out.exists() else []
    return collect(run_dirs, target_accuracy=stop.get("target_accuracy"))


def predicted_front(fleet: Path, model: str, batch: int) -> dict:
    """The planner's predicted (step time, energy) front on `fleet`, as `edgetrain plan --objective
    pareto` gives it: how many plans it holds and how many differ in kind or board set (the boards
    it does not leave out: stage hosts, DP shards, boards beside), with each such structure."""
    from coordinator.planning.command import plan_report

    report = json.loads(plan_report(fleet, model=model, objective="pareto", batch=batch, as_json=True))
    structures = []
    for plan in report["plans"]:
        boards = set(report["devices"]) - set(plan["left_out"])  # every board a plan does not leave out works
        structures.append(f"{plan['kind']}: {'+'.join(sorted(boards))}")
    return {"plans": len(structures), "distinct": len(set(structures)), "structures": sorted(set(structures))}


def planner_figures(rows: list[dict], arm: str) -> tuple[float | None, float | None]:
    """(seconds its trials took, the weak board's weighted sample share): medians over an arm's runs."""
    explored, shares = [], []
    for row in rows:
        if row["arm"] != arm:
            continue
        records = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
        explored.append(sum(r.get("trial_s", 0.0) for r in records if r.get("kind") == "plan_trial"))
        weak = total = 0.0
        for r in records:
            if r.get("kind") == "train":
                for device, d in r["devices"].items():
                    counted = d["samples"] * d.get("weight", 1.0)
                    total += counted
                    weak += counted if device.startswith(WEAK_BOARD + "-") else 0.0
        shares.append(weak / total if total else 0.0)
    if not explored:
        return None, None
    return round(statistics.median(explored), 2), round(statistics.median(shares), 4)


REUSE_WITHIN_S = 12 * 3600
"""--resume reuses an arm only when every seed of it ran at this commit and started this recently:
this machine's core runs 1.6-1.85x faster on some days than others, so a result mixes no days."""


def arm_repeats(arm: str, seeds: int) -> int:
    """How many of the `seeds` seeds `arm` runs (DDP only the first)."""
    return min(ARMS[arm].get("repeats", seeds), seeds)


def arm_runs(out: Path, arm: str, repeats: int) -> list[dict] | None:
    """arm.json of each of the `repeats` runs of `arm` under `out` (None when one has not finished)."""
    runs = []
    for k in range(repeats):
        run_dir = out / f"{arm}-r{k}"
        if not (run_dir / "summary.json").exists() or not (run_dir / "arm.json").exists():
            return None
        runs.append(json.loads((run_dir / "arm.json").read_text()))
    return runs


def reusable(runs: list[dict] | None, commit: str, now: float) -> bool:
    """Whether finished runs may stand in this result: same clean commit, started within REUSE_WITHIN_S."""
    return bool(runs) and not commit.endswith("-dirty") and commit != "unknown" and all(
        r.get("commit") == commit and now - float(r.get("launched_at") or 0) <= REUSE_WITHIN_S for r in runs)


def provenance(runs: list[dict] | None) -> dict:
    """An arm's commit(s) and the start of its first run (UTC)."""
    if not runs:
        return {}
    commits = sorted({str(r.get("commit", "unknown")) for r in runs})
    started = min(float(r.get("launched_at") or 0) for r in runs)
    return {"commit": commits[0] if len(commits) == 1 else commits,
            "started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def median_or_none(values: list) -> float | None:
    """The median of `values`, or None when any of them is None (an arm that hit its cap)."""
    if not values or any(v is None for v in values):
        return None
    return round(statistics.median(values), 2)


def steps_to_target(run_dir: Path, target: float) -> int | None:
    """Optimizer steps a run took to its first evaluation at or above `target`."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "eval" and record["test_accuracy"] >= target:
            return record["step"] + 1
    return None


def segment_rates(run_dir: Path) -> tuple[float, float | None, bool]:
    """Median step time (first step left out: it warms up), mean energy per step (None if unknown)
    and whether the run's links were really emulated, from a DDP segment run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"][1:]
    energies = [sum(d["energy_j"] for d in r["devices"].values()) if all(
        d.get("energy_j") is not None for d in r["devices"].values()) else None for r in steps]
    summary = json.loads((run_dir / "summary.json").read_text())
    energy = None if any(e is None for e in energies) else statistics.fmean(energies)
    return statistics.median(r["step_s"] for r in steps), energy, summary.get("links_emulated", True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1, help="repeats with seeds 0..N-1 (the median is reported)")
    parser.add_argument("--cap-s", type=float, default=1800, help="time cap of every arm, s")
    parser.add_argument("--fleets", default="compute,bandwidth,small",
                        help=f"fleets (and jobs) among {', '.join(JOBS)}, comma-separated")
    parser.add_argument("--arms", default="ddp,single,proportional,federated,planner")
    parser.add_argument("--segment", type=int, default=12, help="DDP steps measured on the slow links (>= 10)")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--keep", type=Path, help="keep the run directories here (the bandwidth fleet's DDP projection "
                                                  "reuses a compute fleet run kept in the same directory)")
    parser.add_argument("--resume", action="store_true",
                        help="with --keep: read the arms that already finished there at this clean commit within the "
                             "last 12 hours instead of running them again; the JSON lists them under `reused`")
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.cap_s, args.eval_every = 1, SMOKE["cap_s"], SMOKE["eval_every"]
        args.arms, args.fleets = SMOKE["arms"], SMOKE["fleets"]
    stop_on_sigterm()
    if args.segment < 10:
        parser.error("--segment must be >= 10 steps")
    if args.resume and not args.keep:
        parser.error("--resume needs --keep DIR (the directory holding the finished runs)")
    fleets = args.fleets.split(",")
    unknown = [f for f in fleets if f not in JOBS]
    if unknown:
        parser.error(f"--fleets: unknown {', '.join(unknown)} (known: {', '.join(JOBS)})")
    arms = args.arms.split(",")
    seeds = list(range(args.seeds))
    targets = {f: (SMOKE if args.smoke else JOBS[f])["target"] for f in fleets}
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="bench-tta-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"target test accuracy {', '.join(f'{f} {t}' for f, t in targets.items())} (SYNTHETIC data, calibrated "
          f"tier); cap {args.cap_s:.0f} s; seeds {seeds}; runs in {workdir}", flush=True)

    commit = commit_id()
    result: dict = {"target_accuracy": targets.get("compute", targets.get("bandwidth")),
                    "cap_s": args.cap_s, "seeds": len(seeds), "fleets": {},
                    "projected": [], "reused": [], "synthetic_data": True}
    try:
        ddp_steps: list[int | None] = []
        for fleet in fleets:
            spec = {**JOBS[fleet], **SMOKE} if args.smoke else JOBS[fleet]
            target = spec["target"]
            stop = {"target_accuracy": target, "time_cap_s": args.cap_s}
            # a lone board has no links: `single` on the slow links is the compute fleet's
            fleet_arms = [a for a in arms if not (fleet == "bandwidth" and a in ("ddp", "single"))]
            out = workdir / f"tta-{fleet}"
            finished = [a for a in fleet_arms
                        if args.resume and reusable(arm_runs(out, a, arm_repeats(a, len(seeds))), commit, time.time())]
            result["reused"] += [f"{fleet}/{a}" for a in finished]
            to_run = [a for a in fleet_arms if a not in finished]
            if to_run:
                rows = run_experiment(workdir, f"tta-{fleet}", spec, to_run, seeds, stop, args.eval_every,
                                      LINK_CODECS if fleet == "bandwidth" else None)
            else:
                rows = collect(sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()), target_accuracy=target)
            # runs an earlier invocation left in a kept directory beyond what each arm runs now do not count
            rows = [r for r in rows if r["arm"] not in ARMS or int(r["repeat"]) < arm_repeats(r["arm"], len(seeds))]
            times = {a: median_or_none([r["time_to_target_s"] for r in rows if r["arm"] == a]) for a in fleet_arms}
            energies = {a: median_or_none([r["energy_to_target_j"] for r in rows if r["arm"] == a]) for a in fleet_arms}
            setups = {a: median_or_none([r["setup_s"] for r in rows if r["arm"] == a]) for a in fleet_arms}
            if fleet == "bandwidth" and "ddp" in arms:
                # DDP's steps to the target on the compute fleet: from this run, or an earlier one kept in
                # the same --keep directory (the fleets can then be run one at a time)
                ddp_steps = [steps_to_target(workdir / "tta-compute" / f"ddp-r{k}", target)
                             if (workdir / "tta-compute" / f"ddp-r{k}" / "metrics.jsonl").exists() else None
                             for k in range(arm_repeats("ddp", len(seeds)))]
                if args.resume and reusable(arm_runs(workdir / "tta-bandwidth-ddp-segment", "ddp", 1), commit,
                                            time.time()):
                    result["reused"].append("bandwidth/ddp-segment")
                else:
                    run_experiment(workdir, "tta-bandwidth-ddp-segment", spec, ["ddp"], [0],
                                   {"steps": args.segment}, 0)
                step_s, energy_per_step, emulated = segment_rates(workdir / "tta-bandwidth-ddp-segment" / "ddp-r0")
                steps = median_or_none(ddp_steps)
                times["ddp"] = round(steps * step_s, 2) if steps is not None and emulated else None
                energies["ddp"] = (round(steps * energy_per_step, 2)
                                   if steps is not None and emulated and energy_per_step is not None else None)
                result["projected"].append("bandwidth/ddp")
                result["ddp_segment"] = {"steps": args.segment, "median_step_s": round(step_s, 3),
                                         "links_emulated": emulated, "steps_to_target_on_compute": steps}
            entry = {"model": spec["model"], "target_accuracy": target, "time_to_accuracy_s": times,
                     "energy_to_accuracy_j": energies, "setup_s": setups,
                     "arms": {a: provenance(arm_runs(out, a, arm_repeats(a, len(seeds)))) for a in fleet_arms}}
            best = min((a for a in EDGETRAIN_ARMS if times.get(a) is not None), key=lambda a: times[a], default=None)
            if best and times.get("ddp"):
                entry["best_edgetrain_arm"] = best
                entry["ddp_time_over_best"] = round(times["ddp"] / times[best], 2)
                if energies.get("ddp") and energies.get(best):
                    entry["ddp_energy_over_best"] = round(energies["ddp"] / energies[best], 2)
            if "planner" in times or "hybrid" in times:
                mine = "planner" if "planner" in times else "hybrid"
                others = [times[a] for a in OTHERS if times.get(a) is not None]
                if times.get(mine):
                    entry["planner_over_best_other"] = round(times[mine] / min(others), 3) if others else None
                    if times.get("proportional"):
                        entry["proportional_over_planner"] = round(times["proportional"] / times[mine], 3)
                    if times.get("ddp"):
                        entry["ddp_over_planner"] = round(times["ddp"] / times[mine], 3)
                entry["exploration_s"], entry["weak_board_sample_share"] = planner_figures(rows, mine)
            try:
                entry["front"] = predicted_front(FLEETS[spec["fleet"]], spec["model"], GLOBAL_BATCH)
            except ValueError as e:  # no plan fits the fleet: the arms' figures still stand
                entry["front"] = {"error": str(e)}
            result["fleets"][fleet] = entry
            print(f"{fleet}: {json.dumps(entry)}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    finish(__file__, result, args)


if __name__ == "__main__":
    main()
