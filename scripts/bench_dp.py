"""Benchmark: proportional vs equal data-parallel split on an emulated heterogeneous fleet.

Four emulated boards (0.5, 0.3, 0.2, 0.1 of a core; cgroup quota as root, duty-cycle otherwise)
train MobileNetV2 with a global batch of 64 on SYNTHETIC CIFAR-shaped data, once with the equal
split and once with the proportional split, in the same run. Each board's standalone training
throughput under its own emulated speed is measured first, one at a time; their sum is the
fleet's ideal throughput. Because small batches are much less efficient per sample on a CPU
(MobileNetV2 here: ~22 ms for 1 sample, ~104 ms for 8, ~238 ms for 32), the benchmark also times
each board standalone at several batch sizes and reports the best any split of the global batch
could do if communication were free (`compute_bound_samples_per_s`): the tighter bound for this
batch size. The last line printed is one JSON object with the figures.

    python scripts/bench_dp.py [--steps 40] [--warmup 5] [--standalone-batch 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from edgetrain.emulator.launch import DEMO_JOB, LocalRun, run_local

SPEEDS = (0.5, 0.3, 0.2, 0.1)
PROFILE_BATCHES = (2, 4, 8, 16, 32)


def standalone(speed: float, model: str, batch: int) -> None:
    """Child mode: this process limits itself to `speed` and prints its training throughput."""
    import torch

    from edge_client.profiler import time_training_step
    from edgetrain.data import DatasetSpec, load_dataset
    from edgetrain.emulator.throttle import limit_cpu
    from edgetrain.models import build_model

    torch.set_num_threads(1)
    dataset = load_dataset(DatasetSpec(name="synthetic", train_size=512), train=True)
    net = build_model(model, seed=0)
    with limit_cpu(speed, name=f"bench-{speed:g}") as limiter:
        seconds = {b: time_training_step(net, dataset, b, limiter, repeats=3) for b in PROFILE_BATCHES}
        print(json.dumps({"speed": speed, "mode": limiter.mode, "samples_per_s": batch / seconds[batch],
                          "seconds": seconds}))


def interpolated_seconds(seconds: dict[int, float], samples: int) -> float:
    """Step time at `samples` from measured points (linear between them, 0 at 0, extrapolated)."""
    points = [(0, 0.0)] + sorted(seconds.items())
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if samples <= b1:
            return t0 + (t1 - t0) * (samples - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (samples - b1) / (b1 - b0)


def compute_bound(alone: list[dict], batch: int) -> float:
    """Samples/s of the best split of `batch` with free communication (greedy min-max)."""
    shares = [0] * len(alone)
    for _ in range(batch):
        cost = [interpolated_seconds(a["seconds"], n + 1) for a, n in zip(alone, shares)]
        shares[cost.index(min(cost))] += 1
    return batch / max(interpolated_seconds(a["seconds"], n) for a, n in zip(alone, shares) if n)


def measure_standalone(speed: float, model: str, batch: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--standalone", str(speed), "--model", model,
                          "--standalone-batch", str(batch)], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["seconds"] = {int(b): s for b, s in result["seconds"].items()}
    return result


def fleet_throughput(split: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Run the fleet with `split`; samples/s over the steps after warm-up, from metrics.jsonl."""
    name = f"bench-dp-{split}"
    job = yaml.safe_load(DEMO_JOB.read_text())
    job.update(name=name, model=args.model)
    job["dataset"].update(train_size=4096, test_size=256)
    job["training"].update(steps=args.steps, split=split, min_clients=len(SPEEDS), eval_every=0,
                           global_batch=args.batch, log_every=10)
    job_file = workdir / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(job))
    code = run_local(LocalRun(job_file=job_file, speeds=SPEEDS, runs_dir=workdir / "runs"), job_name=name)
    if code != 0:
        raise RuntimeError(f"{split} run failed with exit code {code}")
    records = [json.loads(line) for line in (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= args.warmup]
    samples = sum(r["samples"] for r in steps)
    seconds = sum(r["step_s"] for r in steps)
    shares = steps[-1]["shares"]
    return {"samples_per_s": samples / seconds, "shares": list(shares.values()),
            "compute_s": {d: v["compute_s"] for d, v in steps[-1]["devices"].items()},
            "comm_s": {d: v["comm_s"] for d, v in steps[-1]["devices"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--standalone-batch", type=int, default=32)
    parser.add_argument("--standalone", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.standalone:
        standalone(args.standalone, args.model, args.standalone_batch)
        return
    print(f"# {args.model}, global batch {args.batch}, emulated boards {SPEEDS}; data: SYNTHETIC", flush=True)
    alone = [measure_standalone(s, args.model, args.standalone_batch) for s in SPEEDS]
    for a in alone:
        print(f"standalone speed {a['speed']:.1f} ({a['mode']}): {a['samples_per_s']:.1f} samples/s", flush=True)
    ideal = sum(a["samples_per_s"] for a in alone)
    bound = compute_bound(alone, args.batch)
    with tempfile.TemporaryDirectory(prefix="bench_dp_") as tmp:
        equal = fleet_throughput("equal", args, Path(tmp))
        proportional = fleet_throughput("proportional", args, Path(tmp))
    print(f"ideal (sum of standalone at batch {args.standalone_batch}): {ideal:.1f} samples/s; best split of "
          f"{args.batch} with free communication: {bound:.1f} samples/s")
    for name, result in (("equal", equal), ("proportional", proportional)):
        print(f"{name:>13}: {result['samples_per_s']:.1f} samples/s = {result['samples_per_s'] / ideal:.2f} x ideal; "
              f"shares {result['shares']}")
    print(f"proportional / equal = {proportional['samples_per_s'] / equal['samples_per_s']:.2f}")
    print(json.dumps({
        "model": args.model, "global_batch": args.batch, "speeds": SPEEDS, "synthetic_data": True,
        "throttle": alone[0]["mode"], "standalone_batch": args.standalone_batch,
        "standalone_samples_per_s": [round(a["samples_per_s"], 2) for a in alone],
        "ideal_samples_per_s": round(ideal, 2),
        "compute_bound_samples_per_s": round(bound, 2),
        "proportional_fraction_of_compute_bound": round(proportional["samples_per_s"] / bound, 3),
        "equal_samples_per_s": round(equal["samples_per_s"], 2),
        "proportional_samples_per_s": round(proportional["samples_per_s"], 2),
        "proportional_fraction_of_ideal": round(proportional["samples_per_s"] / ideal, 3),
        "equal_fraction_of_ideal": round(equal["samples_per_s"] / ideal, 3),
        "proportional_over_equal": round(proportional["samples_per_s"] / equal["samples_per_s"], 2),
        "proportional_shares": proportional["shares"], "equal_shares": equal["shares"],
    }))


if __name__ == "__main__":
    main()
