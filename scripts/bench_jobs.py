"""Benchmark: several jobs sharing the fleet — the rolling scheduler against its baselines (issue 7).

SIMULATED, not measured: every number comes from the job simulator (``edgetrain/emulator/``) with a throughput
model, no board trains anything. The model (``scaled_sum_oracle``):
    per-board samples/s = relative speed × one core's speed on the model, with one core doing
        ResNet-18 at 25 samples/s and MobileNetV2 at 105 samples/s;
    the lab fleet of 8 boards: pi4-a, pi4-b 0.4 · nano-a, nano-b 0.32 · pi3-a, pi3-b 0.14 ·
        laptop 1.0 · xavier 0.5 (relative to one core);
    speed(job, boards) = Σ per-board speed · eff(n), eff(n) = 1 / (1 + 0.08 (n − 1))
        (data parallelism losing more to synchronisation the more boards share a step).
Traces (``poisson_trace``): Poisson arrivals at an offered load of 0.9 of the fleet's capacity
(every board computing alone), half ResNet-18 and half MobileNetV2, 30% hard jobs (half name k
boards, half ask for any k, k in {1, 2, 4}), soft jobs 1..{2, 4, 8} boards, work log-uniform over
5,000-50,000 samples; 40 jobs on the lab fleet (seed 3), and 500 jobs on 64 boards (the lab fleet
eight times, seed 3). Schedulers: rolling, fifo, first_fit, static (fixed groups of 2 boards, allocated whole,
requests kept).

Prints a table per fleet and a lower bound on the average JCT (every job running the moment it
arrives, alone on the fleet, on its fastest request: no queueing at all), which caps how far
below a baseline any scheduler can get on that trace (JCT and makespan in seconds; average JCT of soft and of hard jobs apart,
since hard requests constrain every scheduler differently; scheduler calls, how many were solved exactly,
simulation seconds), and as its last line one JSON object: avg_jct, p95_jct, makespan (maps
from scheduler to seconds) for the 8-board trace, the same under "large" for 64 boards / 500 jobs,
"simulated": true.

With ``--live`` it also runs a short trace for real, for each scheduler in turn: a job server
(``edgetrain coordinator --jobs --scheduler NAME``) and the five lab boards of
``edgetrain/presets/lab-jobs.yaml`` as client processes on this machine (CPU quotas, links shaped
in the application), 8 jobs (Poisson arrivals at load 0.9 counting training work only, half
ResNet-18 and half MobileNetV2, 30% hard, 600-2400 samples in steps of 32, SYNTHETIC data,
planner enabled) submitted at their arrival times. It prints each scheduler's measured average
JCT and makespan beside the simulator's prediction for the same trace (the planner's predicted
speeds, the measured setup time), and adds them to the JSON line under "live".

    python scripts/bench_jobs.py [--seed 3] [--load 0.9] [--live [--live-schedulers rolling,first_fit]] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from coordinator.jobs.scheduler import SCHEDULERS, Board, Job
from edgetrain.emulator.job_simulator import (
    SimResult,
    TraceSpec,
    poisson_trace,
    scaled_sum_oracle,
    simulate,
)
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm

ONE_CORE = {"resnet18": 25.0, "mobilenet_v2": 105.0}
"""Samples/s of one host core, per model."""
LAB = (("pi4", 0.4, 2), ("nano", 0.32, 2), ("pi3", 0.14, 2), ("laptop", 1.0, 1), ("xavier", 0.5, 1))
"""(kind, speed relative to one core, boards of that kind) of the lab fleet."""


def lab_fleet(copies: int = 1) -> list[Board]:
    """The 8-board lab fleet, ``copies`` times over."""
    boards = []
    for c in range(copies):
        for kind, _, n in LAB:
            for i in range(n):
                suffix = "" if n == 1 else "-" + "ab"[i]
                boards.append(Board(f"{kind}{suffix}" + (f"-{c}" if copies > 1 else ""), kind))
    return boards


def run(n_boards_copies: int, n_jobs: int, seed: int, load: float) -> dict[str, SimResult]:
    boards = lab_fleet(n_boards_copies)
    speed = scaled_sum_oracle({kind: {m: rel * v for m, v in ONE_CORE.items()} for kind, rel, _ in LAB})
    trace = poisson_trace(TraceSpec(n_jobs=n_jobs, load=load, seed=seed), boards, speed)
    results = {}
    print(f"  {'':<10} {'avg JCT':>8} {'p95 JCT':>8} {'makespan':>9} {'avg soft':>8} {'avg hard':>8}  "
          f"{'plans':>5} {'exact':>5} {'sim s':>5}")
    for name in SCHEDULERS:
        t0 = time.perf_counter()
        results[name] = simulate(trace, boards, speed, name)
        r = results[name]
        print(f"  {name:<10} {r.avg_jct:8.0f} {r.p95_jct:8.0f} {r.makespan:9.0f} "
              f"{_avg(r, 'soft'):8.0f} {_avg(r, 'hard'):8.0f}  {r.plans:5d} {r.exact_plans:5d} "
              f"{time.perf_counter() - t0:5.1f}")
    bound = no_queueing_bound(trace, boards, speed)
    print(f"  lower bound on avg JCT (each job alone on the fleet, on its fastest request): {bound:.0f}; "
          f"no scheduler can be more than {100 * (1 - bound / results['static'].avg_jct):.0f}% below static here")
    results["bound"] = bound
    base = results["rolling"].avg_jct
    for name in ("first_fit", "static", "fifo"):
        print(f"  rolling avg JCT vs {name}: {100 * (base / results[name].avg_jct - 1):+.1f}%")
    return results


def no_queueing_bound(trace, boards, speed) -> float:
    """Average JCT if every job ran the moment it arrived, alone, on its fastest request."""
    durations = []
    for job in trace:
        if job.boards is not None:
            sets = [tuple(b for b in boards if b.name in job.boards)]
        else:
            counts = [job.count] if job.count else range(job.min_boards, min(job.max_boards, len(boards)) + 1)
            ranked = sorted(boards, key=lambda b: (-speed(job, (b,)), b.name))
            sets = [tuple(ranked[:k]) for k in counts]
        durations.append(min(job.duration(speed(job, s)) for s in sets))
    return sum(durations) / len(durations)


def _avg(result: SimResult, kind: str) -> float:
    jcts = [r.jct for r in result.records if r.job.kind == kind]
    return sum(jcts) / len(jcts) if jcts else float("nan")


def _maps(results: dict) -> dict:
    out = {key: {n: round(getattr(r, key), 1) for n, r in results.items() if n != "bound"}
           for key in ("avg_jct", "p95_jct", "makespan")}
    out["avg_jct_lower_bound"] = round(results["bound"], 1)
    return out


LIVE_FLEET = Path(__file__).resolve().parents[1] / "edgetrain" / "presets" / "lab-jobs.yaml"
LIVE_BATCH = 32


def live_trace(seed: int, load: float) -> tuple[list, tuple[Job, ...]]:
    """The live trace on the lab-jobs boards (relative speeds from the preset)."""
    from edgetrain.fleet_file import load_fleet

    specs = load_fleet(LIVE_FLEET).boards
    boards = [Board(b.name, b.name) for b in specs]
    per_board = {b.name: {m: b.speed * v for m, v in ONE_CORE.items()} for b in specs}
    speed = scaled_sum_oracle(per_board)
    trace = poisson_trace(TraceSpec(n_jobs=8, load=load, seed=seed, work_range=(600.0, 2400.0),
                                    hard_counts=(1, 2), soft_max=(2, 3)), boards, speed)
    return list(specs), trace


def job_yaml(job: Job) -> str:
    """The job YAML a trace job is submitted as."""
    import yaml

    steps = max(1, round(job.work / LIVE_BATCH))
    if job.kind == "hard":
        schedule = {"kind": "hard", **({"boards": sorted(job.boards)} if job.boards else {"count": job.count})}
    else:
        schedule = {"kind": "soft", "min_boards": job.min_boards, "max_boards": job.max_boards}
    return yaml.safe_dump({
        "name": job.id, "model": job.model,
        "dataset": {"name": "synthetic", "train_size": 4096, "test_size": 256, "augment": False},
        "training": {"global_batch": LIVE_BATCH, "steps": steps, "eval_every": 0, "log_every": 10},
        "optimizer": {"lr": 0.05, "momentum": 0.9, "schedule": "cosine", "warmup_steps": 2},
        "planner": {"enabled": True}, "schedule": schedule})


def run_live(scheduler: str, specs: list, trace: tuple[Job, ...], workdir: Path) -> dict:
    """One scheduler on the live trace; returns measured and simulated JCTs."""
    import os

    import yaml

    from coordinator.jobs.speed import PlannerSpeed, board_spec
    from edgetrain import trust
    from edgetrain.config import job_from_dict, parse_yaml
    from edgetrain.fleet_file import board_to_dict
    from edgetrain.job_client import JobServerClient
    from edgetrain.supervisor import edgetrain_command, terminate, wait_for_address

    work = workdir / scheduler
    work.mkdir(parents=True)
    port_file = work / "server.address"
    # as users run it: mutual TLS under a fleet authority of its own, boards pairing with a token
    authority = trust.Authority.create(work / "home" / "authority")
    env = {**os.environ, "EDGETRAIN_HOME": str(work / "home"),
           "EDGETRAIN_JOIN_TOKEN": str(authority.new_token(uses=len(specs), note="bench_jobs"))}
    procs = [subprocess.Popen(edgetrain_command(
        "coordinator", "--jobs", "--scheduler", scheduler, "--bind", "127.0.0.1:0", "--port-file", str(port_file),
        "--state-dir", str(work / "state"), "--runs-dir", str(work / "runs"), "--data-dir", str(work / "data"),
        "--no-advertise"), stdout=(work / "server.log").open("w"), stderr=subprocess.STDOUT, env=env)]
    try:
        address = wait_for_address(port_file, procs[0], what="the job server")
        for b in specs:
            board_file = work / f"{b.name}.yaml"
            board_file.write_text(yaml.safe_dump(board_to_dict(b)))
            procs.append(subprocess.Popen(edgetrain_command(
                "client", "--coordinator", address, "--name", b.name, "--emulate", str(board_file), "--threads", "1",
                "--probe-interval", "15", "--data-dir", str(work / "data")),
                stdout=(work / f"{b.name}.log").open("w"), stderr=subprocess.STDOUT, env=env))
        client = JobServerClient(address, authority.operator_identity().security(trust.GATEWAY_SERVER_NAME))
        while client.boards_joined() < len(specs):
            time.sleep(0.5)
        t0 = time.time()
        ids = {}
        for job in sorted(trace, key=lambda j: j.arrival):
            time.sleep(max(0.0, t0 + job.arrival - time.time()))
            ids[client.submit(job_yaml(job)).id] = job
        while True:
            listing = client.list_jobs()
            if all(j.state in ("finished", "failed", "cancelled") for j in listing.jobs):
                break
            time.sleep(2.0)
        jobs = list(listing.jobs)
        failed = [f"{j.id}: {j.message}" for j in jobs if j.state != "finished"]
        jct = [j.finished - j.submitted for j in jobs]
        makespan = max(j.finished for j in jobs) - min(j.submitted for j in jobs)
        state = json.loads((work / "state" / "jobs.json").read_text())["jobs"]
        setups = [j["overhead_s"] for j in state if j["overhead_s"] > 0]
        overhead_s = statistics.median(setups) if setups else 20.0
        # the simulator on the same trace, with the server's measured boards and the planner's speeds
        boards = {bv.name: board_spec(bv.name, bv.speed, bv.link_mbit_per_s) for bv in listing.boards}
        configs = {j.id: job_from_dict(parse_yaml(job_yaml(ids[j.id]), "job")) for j in jobs}
        sim_trace = tuple(Job(id=j.id, arrival=j.submitted - t0, kind=ids[j.id].kind, model=ids[j.id].model,
                              work=float(j.steps * LIVE_BATCH), boards=ids[j.id].boards, count=ids[j.id].count,
                              min_boards=ids[j.id].min_boards, max_boards=ids[j.id].max_boards, overhead_s=overhead_s)
                          for j in jobs)
        fleet = [Board(bv.name, f"{bv.speed:.2f}@{bv.link_mbit_per_s:.0f}") for bv in listing.boards]
        sim = simulate(sim_trace, fleet, PlannerSpeed(configs, boards), scheduler)
        return {"avg_jct": round(statistics.mean(jct), 1), "makespan": round(makespan, 1),
                "simulated_avg_jct": round(sim.avg_jct, 1), "simulated_makespan": round(sim.makespan, 1),
                "overhead_s": round(overhead_s, 1), "failed": failed}
    finally:
        terminate(*reversed(procs), grace_s=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--live", action="store_true", help="also run a short trace on emulated boards")
    parser.add_argument("--live-schedulers", default="rolling,first_fit,static,fifo")
    add_bench_args(parser)
    args = parser.parse_args()
    stop_on_sigterm()
    small_jobs, large_copies, large_jobs = (8, 2, 16) if args.smoke else (40, 8, 500)
    print(f"lab fleet, 8 boards, {small_jobs} jobs, load {args.load} (simulated)")
    small = run(1, small_jobs, args.seed, args.load)
    print(f"{8 * large_copies} boards, {large_jobs} jobs, load {args.load} (simulated)")
    large = run(large_copies, large_jobs, args.seed, args.load)
    out = {**_maps(small), "large": _maps(large), "simulated": True}
    if args.live:
        specs, trace = live_trace(args.seed, args.load)
        print(f"live: {len(trace)} jobs on the {len(specs)} lab-jobs boards, emulated on this machine, SYNTHETIC data")
        live = {}
        with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
            for name in args.live_schedulers.split(","):
                live[name] = run_live(name, specs, trace, Path(tmp))
                r = live[name]
                print(f"  {name:<10} measured avg JCT {r['avg_jct']:6.0f} s, makespan {r['makespan']:6.0f} s | "
                      f"simulated {r['simulated_avg_jct']:6.0f} s, {r['simulated_makespan']:6.0f} s "
                      f"(setup {r['overhead_s']:.0f} s){'  FAILED: ' + '; '.join(r['failed']) if r['failed'] else ''}",
                      flush=True)
        out["live"] = live
    finish(__file__, out, args)


if __name__ == "__main__":
    main()
