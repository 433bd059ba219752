"""Benchmark: a ResNet-18 pipeline vs proportional and equal data parallelism on slow links.

Four emulated boards (0.5, 0.3, 0.2, 0.1 of a core) on application-shaped links of 100, 50,
50 and 20 Mbit/s train ResNet-18 on SYNTHETIC CIFAR-shaped data, in one run:

    equal         data parallelism, equal shares (the framework default)
    proportional  data parallelism, shares from measured speed and link time
    pipeline      3 stages: stem..layer2 on board0, layer3 on board1, layer4+head on board2, each
                  host owning its stage's parameters and optimizer (only activations cross the
                  links), M micro-batches, 1F1B; board3 (0.1 core on 20 Mbit/s) is left out:
                  its share of layer4 would cost it 2 x 34 MB of parameters per step

Reported per mode: samples/s over the steps after warm-up and bytes on the wire per sample
(parameters, gradients and activations; the coordinator counts its transfers, stage hosts
report the activation bytes they sent each other; stage state handed over and pulled back
counts too). For the pipeline also the bubble: measured as the
stage hosts' time waiting for neighbours over their time in the step's schedule, and the
theory (S-1)/(M+S-1). The last line printed is one JSON object.

    python scripts/bench_pipeline.py [--steps 8] [--warmup 2] [--microbatches 4] [--modes equal,pipeline] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from edgetrain.emulator.launch import plain_demo_job, run_on_emulated_boards
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm
from edgetrain.pipeline import bubble_fraction

BOARDS = ((0.5, 100), (0.3, 50), (0.2, 50), (0.1, 20))
"""(fraction of a core, link Mbit/s) of each emulated board."""
STAGES = [{"blocks": 5, "boards": ["board0"]}, {"blocks": 2, "boards": ["board1"]},
          {"blocks": 3, "boards": ["board2"]}]
"""ResNet-18's 10 blocks: stem + layer1 + layer2 | layer3 | layer4 + head."""
SMOKE_BOARDS = tuple((0.5, 1000) for _ in BOARDS)
"""--smoke: half a core each on fast links (ResNet-18's profiling at 0.1 of a core and the stage
hand-over on slow links take a minute)."""
MODES = ("equal", "proportional", "pipeline")


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    name = f"bench-pipe-{mode}"
    job = plain_demo_job()
    job.update(name=name, model="resnet18")
    job["dataset"].update(train_size=64 if args.smoke else 4096, test_size=16 if args.smoke else 256, augment=False)
    job["training"].update(steps=args.steps, min_clients=len(BOARDS), eval_every=0, global_batch=args.batch,
                           log_every=1, split="equal" if mode == "equal" else "proportional",
                           heartbeat_timeout_s=60.0)
    if mode == "pipeline":
        job["pipeline"] = {"stages": STAGES, "microbatches": args.microbatches, "schedule": "1f1b",
                           "stage_timeout_s": 600}
    run_dir = run_on_emulated_boards(job, SMOKE_BOARDS if args.smoke else BOARDS, workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= args.warmup]
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = sum(r["samples"] for r in steps)
    out = {"samples_per_s": samples / sum(r["step_s"] for r in steps),
           "bytes_per_sample": summary["bytes_per_sample"], "shares": steps[-1]["shares"]}
    if mode == "pipeline":
        waits = [v["wait_s"] for r in steps for v in r["stages"].values()]
        computes = [v["compute_s"] for r in steps for v in r["stages"].values()]
        out["bubble_measured"] = sum(waits) / (sum(waits) + sum(computes))
        out["peak_activation_bytes"] = {d: v["peak_activation_bytes"] for d, v in steps[-1]["stages"].items()}
        out["activation_bytes_per_sample"] = sum(v["peer_bytes"] for r in steps for v in r["stages"].values()) / samples
        out["activation_bytes_per_sample_expected"] = activation_bytes_per_sample(args)
        out["bytes_per_sample"] += out["activation_bytes_per_sample"]
    return out


def activation_bytes_per_sample(args: argparse.Namespace) -> float:
    """Bytes of activations (forward) and their gradients (backward) crossing stage boundaries per sample."""
    import torch

    from edgetrain.models import build_model

    model = build_model("resnet18", seed=0).eval()
    x = torch.zeros(1, 3, 32, 32)
    total, at = 0, 0
    with torch.no_grad():
        for stage in STAGES[:-1]:
            x = model.run_blocks(x, at, at + stage["blocks"])
            at += stage["blocks"]
            total += 2 * x.numel() * 4
    return float(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:  # two steps of the pipeline alone, small micro-batches
        args.steps, args.warmup, args.batch, args.microbatches, args.modes = 2, 0, 8, 2, "pipeline"
    stop_on_sigterm()
    boards = SMOKE_BOARDS if args.smoke else BOARDS
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        parser.error(f"modes must be among {MODES}")
    print(f"# resnet18, global batch {args.batch}, {args.steps} steps, boards (core, Mbit/s) {boards}; "
          "data: SYNTHETIC", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_pipe_") as tmp:
        for mode in modes:
            results[mode] = run_mode(mode, args, Path(tmp))
            r = results[mode]
            print(f"{mode:>13}: {r['samples_per_s']:.2f} samples/s, {r['bytes_per_sample'] / 1e6:.2f} MB/sample, "
                  f"shares {list(r['shares'].values())}", flush=True)
    out = {"model": "resnet18", "steps": args.steps, "global_batch": args.batch, "synthetic_data": True,
           "boards": [{"speed": s, "mbit_per_s": m} for s, m in boards], "stages": STAGES,
           "microbatches": args.microbatches,
           **{f"{m}_samples_per_s": round(r["samples_per_s"], 3) for m, r in results.items()},
           "bytes_per_sample": {m: round(r["bytes_per_sample"]) for m, r in results.items()}}
    if "pipeline" in results:
        out["bubble_measured"] = round(results["pipeline"]["bubble_measured"], 3)
        out["bubble_theory"] = round(bubble_fraction(len(STAGES), args.microbatches), 3)
        out["peak_activation_bytes"] = results["pipeline"]["peak_activation_bytes"]
        if "equal" in results:
            out["pipeline_over_equal"] = round(results["pipeline"]["samples_per_s"] / results["equal"]["samples_per_s"], 2)
        if "proportional" in results:
            out["pipeline_over_proportional"] = round(
                results["pipeline"]["samples_per_s"] / results["proportional"]["samples_per_s"], 2)
    finish(__file__, out, args)


if __name__ == "__main__":
    main()
