"""Benchmark: several jobs sharing the fleet — the rolling scheduler against its baselines (issue 7).

SIMULATED, not measured: every number comes from ``coordinator/job_sim.py`` with a throughput
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

Prints a table per fleet (JCT and makespan in seconds; average JCT of soft and of hard jobs apart,
since hard requests constrain every scheduler differently; scheduler calls, how many were solved exactly,
simulation seconds), and as its last line one JSON object: avg_jct, p95_jct, makespan (maps
from scheduler to seconds) for the 8-board trace, the same under "large" for 64 boards / 500 jobs,
"simulated": true.

    python scripts/bench_jobs.py [--seed 3] [--load 0.9]
"""

from __future__ import annotations

import argparse
import json
import time

from coordinator.job_scheduler import SCHEDULERS, Board
from coordinator.job_sim import SimResult, TraceSpec, poisson_trace, scaled_sum_oracle, simulate

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
    base = results["rolling"].avg_jct
    for name in ("first_fit", "static", "fifo"):
        print(f"  rolling avg JCT vs {name}: {100 * (base / results[name].avg_jct - 1):+.1f}%")
    return results


def _avg(result: SimResult, kind: str) -> float:
    jcts = [r.jct for r in result.records if r.job.kind == kind]
    return sum(jcts) / len(jcts) if jcts else float("nan")


def _maps(results: dict[str, SimResult]) -> dict[str, dict[str, float]]:
    return {key: {n: round(getattr(r, key), 1) for n, r in results.items()}
            for key in ("avg_jct", "p95_jct", "makespan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.9)
    args = parser.parse_args()
    print(f"lab fleet, 8 boards, 40 jobs, load {args.load} (simulated)")
    small = run(1, 40, args.seed, args.load)
    print(f"64 boards, 500 jobs, load {args.load} (simulated)")
    large = run(8, 500, args.seed, args.load)
    print(json.dumps({**_maps(small), "large": _maps(large), "simulated": True}))


if __name__ == "__main__":
    main()
