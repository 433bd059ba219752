"""Benchmark: link compression on a bandwidth-bound emulated fleet, every mode in one run.

Four emulated boards (0.5, 0.3, 0.2, 0.1 of a core) on application-shaped links of 100, 50, 20
and 10 Mbit/s train MobileNetV2 (global batch 64) on SYNTHETIC CIFAR-shaped data for the same
number of steps with each link mode:

    none      full float32 parameters down, float32 gradients up
    fp16      fp16 deltas down, fp16 gradients up
    int8      int8 deltas down, int8 gradients up (error feedback)
    topk      int8 deltas down, top-k 1% gradients up (error feedback)
    adaptive  per board from its measured bandwidth (coordinator/codec_policy.py), int8 deltas

For each mode it reports training throughput (samples/s over the steps after warm-up), bytes on
the wire per sample (both directions, counted by the coordinator) and final test accuracy. The
last line printed is one JSON object with the figures.

    python scripts/bench_aggregation.py [--steps 120] [--warmup 10] [--modes none,topk,adaptive] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from edgetrain.emulator.launch import plain_demo_job, run_on_emulated_boards
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm

BOARDS = ((0.5, 100), (0.3, 50), (0.2, 20), (0.1, 10))
"""(fraction of a core, link Mbit/s) of each emulated board."""
MODES = {
    "none": {"uplink": "none", "downlink": "none"},
    "fp16": {"uplink": "fp16", "downlink": "fp16"},
    "int8": {"uplink": "int8", "downlink": "int8"},
    "topk": {"uplink": "topk:0.01", "downlink": "int8"},
    "adaptive": {"uplink": "adaptive", "downlink": "int8"},
}


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Train with one link mode; throughput, bytes per sample and accuracy from the run's outputs."""
    name = f"bench-agg-{mode}"
    job = plain_demo_job()
    job.update(name=name, model=args.model)
    job["dataset"].update(train_size=200 if args.smoke else 20000, test_size=40 if args.smoke else 1000)
    job["training"].update(steps=args.steps, min_clients=len(BOARDS), eval_every=0, global_batch=args.batch,
                           log_every=10, split="proportional", heartbeat_timeout_s=30.0)
    job["compression"] = MODES[mode]
    run_dir = run_on_emulated_boards(job, BOARDS, workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= args.warmup]
    summary = json.loads((run_dir / "summary.json").read_text())
    codecs: dict[str, set] = {}
    for r in steps:
        for device, codec in r["codecs"].items():
            codecs.setdefault(device, set()).add(codec)
    return {"samples_per_s": sum(r["samples"] for r in steps) / sum(r["step_s"] for r in steps),
            "bytes_per_sample": summary["bytes_per_sample"], "accuracy": summary["test_accuracy"],
            "shares": steps[-1]["shares"], "codecs": {d: sorted(c) for d, c in codecs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:  # two steps of one mode on a small model
        args.steps, args.warmup, args.batch, args.model, args.modes = 2, 0, 16, "small_cnn", "topk"
    stop_on_sigterm()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    print(f"# {args.model}, global batch {args.batch}, {args.steps} steps, boards (core, Mbit/s) {BOARDS}; "
          "data: SYNTHETIC", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_agg_") as tmp:
        for mode in modes:
            results[mode] = run_mode(mode, args, Path(tmp))
            r = results[mode]
            print(f"{mode:>9}: {r['samples_per_s']:.1f} samples/s, {r['bytes_per_sample'] / 1e3:.0f} kB/sample, "
                  f"test accuracy {r['accuracy']:.3f}, shares {list(r['shares'].values())}, codecs {r['codecs']}",
                  flush=True)
    out = {"model": args.model, "steps": args.steps, "global_batch": args.batch, "synthetic_data": True,
           "boards": [{"speed": s, "mbit_per_s": m} for s, m in BOARDS],
           "modes": {m: {"samples_per_s": round(r["samples_per_s"], 2), "bytes_per_sample": round(r["bytes_per_sample"]),
                         "accuracy": r["accuracy"], "codecs": r["codecs"]} for m, r in results.items()}}
    if "none" in results:
        base = results["none"]
        out["speedup_over_none"] = {m: round(r["samples_per_s"] / base["samples_per_s"], 2) for m, r in results.items()}
        out["accuracy_pp_vs_none"] = {m: round(100 * (r["accuracy"] - base["accuracy"]), 2) for m, r in results.items()}
    finish(__file__, out, args)


if __name__ == "__main__":
    main()
