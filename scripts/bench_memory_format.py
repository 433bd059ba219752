"""Benchmark: one core's training speed with images in the default layout and channels-last.

For each model and batch, one forward + backward of the mean cross-entropy on SYNTHETIC random
images (no optimizer step), timed alternately in both layouts on one torch thread for `--seconds`
each, `--rounds` times; the median of each is reported and their ratio. The model is the
catalog's (edgetrain.models.build_model) with its `image_format` overridden, so the two arms differ
in nothing else. What this decides: `edgetrain.models.IMAGE_FORMATS`.

Usage: python scripts/bench_memory_format.py [--models mobilenet_v2,resnet18] [--batches 12,58,128] [--smoke] [--record]
Last line: one JSON object, model -> batch -> {"default", "channels_last" (samples/s), "ratio"}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgetrain.allocator import keep_freed_memory
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm
from edgetrain.models import build_model


def samples_per_s(model: torch.nn.Module, batch: int, seconds: float) -> float:
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()

    step()
    started, samples = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        step()
        samples += batch
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mobilenet_v2,resnet18")
    parser.add_argument("--batches", default="12,58,128")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.models, args.batches, args.seconds, args.rounds = "small_cnn", "4", 0.1, 1
    stop_on_sigterm()
    keep_freed_memory()
    torch.set_num_threads(1)
    print("# one core, one torch thread; data: SYNTHETIC random images", flush=True)
    formats = {"default": torch.contiguous_format, "channels_last": torch.channels_last}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in args.models.split(","):
        model = build_model(name, seed=0)
        model.train()
        for batch in (int(b) for b in args.batches.split(",")):
            runs: dict[str, list[float]] = {arm: [] for arm in formats}
            for _ in range(args.rounds):
                for arm, memory_format in formats.items():
                    model.image_format = memory_format
                    runs[arm].append(samples_per_s(model, batch, args.seconds))
            row = {arm: round(statistics.median(v), 1) for arm, v in runs.items()}
            row["ratio"] = round(row["channels_last"] / row["default"], 2)
            out.setdefault(name, {})[str(batch)] = row
            print(f"{name} batch {batch}: default {row['default']} samples/s, channels-last "
                  f"{row['channels_last']} ({row['ratio']}x)", flush=True)
    finish(__file__, out, args)


if __name__ == "__main__":
    main()
