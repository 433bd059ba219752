"""Benchmark: the research mechanisms of issue 20, measured side by side.

Codecs (this part runs today): the same job — MobileNetV2 on the harder SYNTHETIC CIFAR-shaped
data (`synthetic-hard`, 5000 training and 1000 test samples), global batch 64, the same seed and
steps — on four emulated boards (0.5, 0.3, 0.2, 0.1 of a core; links 100, 50, 20, 10 Mbit/s),
once per uplink codec: none, int8, top-k 1% and PowerSGD rank 4 (all lossy ones with error
feedback on the boards; parameters come down dense, so only the uplink differs). For each it
reports samples/s over the steps after warm-up, the test accuracy after the last step and the
uplink bytes per training sample.

Channel-parallel stages (the `fleets` part of the issue) are not built yet: this script will
gain the capped and plain lab fleets with and without channel groups when they are.

    python scripts/bench_channel.py [--steps 300] [--warmup 10] [--codecs none,int8,topk,powersgd]

Last line: one JSON object, `codecs` -> name -> {samples_per_s, accuracy, uplink_bytes_per_sample},
plus `powersgd_accuracy_minus_none` and `powersgd_uplink_reduction` (none's uplink bytes over
PowerSGD's).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from edgetrain.catalog import SYNTHETIC_HARD_TEST_SIZE, SYNTHETIC_HARD_TRAIN_SIZE
from edgetrain.emulator.launch import DEMO_JOB, run_on_emulated_boards

BOARDS = ((0.5, 100), (0.3, 50), (0.2, 20), (0.1, 10))
"""(fraction of a core, link Mbit/s) of each emulated board."""
CODECS = {"none": "none", "int8": "int8", "topk": "topk:0.01", "powersgd": "powersgd:4"}


def run_codec(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Train with one uplink codec; throughput, accuracy and uplink bytes per sample from the run."""
    job = yaml.safe_load(DEMO_JOB.read_text())
    job.update(name=f"bench-codec-{name}", model="mobilenet_v2", seed=args.seed)
    job["dataset"] = {"name": "synthetic-hard", "train_size": SYNTHETIC_HARD_TRAIN_SIZE,
                      "test_size": SYNTHETIC_HARD_TEST_SIZE, "augment": True}
    job["training"].update(steps=args.steps, min_clients=len(BOARDS), eval_every=0, global_batch=64,
                           log_every=25, split="proportional", heartbeat_timeout_s=30.0, checkpoint_every_s=0)
    job["compression"] = {"uplink": CODECS[name], "downlink": "none"}
    run_dir = run_on_emulated_boards(job, BOARDS, workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    steady = [r for r in train if r["step"] >= args.warmup]
    summary = json.loads((run_dir / "summary.json").read_text())
    uplink = sum(d["upload_bytes"] for r in train for d in r["devices"].values())
    return {"samples_per_s": round(sum(r["samples"] for r in steady) / sum(r["step_s"] for r in steady), 2),
            "accuracy": summary["test_accuracy"],
            "uplink_bytes_per_sample": round(uplink / sum(r["samples"] for r in train), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated subset of " + ",".join(CODECS))
    args = parser.parse_args()
    names = args.codecs.split(",")
    unknown = [n for n in names if n not in CODECS]
    if unknown:
        parser.error(f"unknown codec(s) {unknown}; choose from {list(CODECS)}")
    print(f"# mobilenet_v2 on synthetic-hard (SYNTHETIC data), batch 64, {args.steps} steps, seed {args.seed}; "
          f"boards (core, Mbit/s) {BOARDS}", flush=True)
    codecs = {}
    with tempfile.TemporaryDirectory(prefix="bench_channel_") as tmp:
        for name in names:
            codecs[name] = run_codec(name, args, Path(tmp))
            print(f"{name} ({CODECS[name]}): {codecs[name]}", flush=True)
    out: dict = {"synthetic_data": True, "steps": args.steps, "seed": args.seed, "codecs": codecs}
    if "none" in codecs and "powersgd" in codecs:
        out["powersgd_accuracy_minus_none"] = round(codecs["powersgd"]["accuracy"] - codecs["none"]["accuracy"], 4)
        out["powersgd_uplink_reduction"] = round(codecs["none"]["uplink_bytes_per_sample"]
                                                 / codecs["powersgd"]["uplink_bytes_per_sample"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
