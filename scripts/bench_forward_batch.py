"""Benchmark: what a board's shard costs on one core by the most samples it puts through the model at once.

A board computes its shard in the fewest equal chunks of at most `training.max_forward_batch`
samples (edgetrain.training.compute_shard). Each pass has a fixed cost; a pass too large for the
caches costs more per sample. This times compute_shard on one unthrottled core for shard sizes a
four-board fleet's boards get (e.g. 70 of 128 samples on the 0.5-core board), under each limit,
in alternating rounds so the machine's drift falls on every limit alike, and prints the median ms
per shard and each limit's time over the current default's.

    .venv/bin/python scripts/bench_forward_batch.py [--model mobilenet_v2] [--shards 35,70,96,128,256]
        [--limits 64,96,128,0] [--rounds 5] [--smoke] [--record]

The data is SYNTHETIC (edgetrain.data's generated images); only the time is measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgetrain.allocator import keep_freed_memory
from edgetrain.config import DatasetSpec, TrainingConfig
from edgetrain.data import load_dataset, make_batch
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm
from edgetrain.models import build_model
from edgetrain.training import chunk_bounds, compute_shard


def _numbers(parser: argparse.ArgumentParser, flag: str, text: str, least: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes whole numbers separated by commas, got {text!r}")
    if any(v < least for v in values):
        parser.error(f"{flag} must be >= {least}, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--shards", default="35,58,70,96,128,256", help="shard sizes, samples")
    parser.add_argument("--limits", default="64,96,128,0", help="max_forward_batch values (0: the whole shard at once)")
    parser.add_argument("--rounds", type=int, default=5)
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.shards, args.limits, args.rounds = "small_cnn", "6,3", "2,0", 1
    stop_on_sigterm()
    shards = _numbers(parser, "--shards", args.shards, 1)
    limits = _numbers(parser, "--limits", args.limits, 0)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    default = TrainingConfig().max_forward_batch
    keep_freed_memory()  # as the boards' processes do
    torch.set_num_threads(1)
    try:
        model = build_model(args.model, seed=0)
    except ValueError as e:
        parser.error(str(e))
    dataset = load_dataset(DatasetSpec(name="synthetic", train_size=max(shards)), train=True)
    print(f"# {args.model} on one core, compute_shard by max_forward_batch (default {default}); data: SYNTHETIC",
          flush=True)
    times: dict[tuple[int, int], list[float]] = {}
    for shard in shards:
        x, y = make_batch(dataset, list(range(shard)), augment=False, seed=0, step=0)
        for limit in limits:  # warm-up: the allocator and the caches at this size
            compute_shard(model, x, y, limit)
        for _ in range(args.rounds):
            for limit in limits:
                started = time.perf_counter()
                compute_shard(model, x, y, limit)
                times.setdefault((shard, limit), []).append(time.perf_counter() - started)
        line = ", ".join(f"{limit or 'whole'}: {statistics.median(times[shard, limit]) * 1000:.1f} ms "
                         f"({len(chunk_bounds(0, shard, limit)) - 1} pass)" for limit in limits)
        print(f"shard {shard}: {line}", flush=True)
    ms = {str(s): {str(lim): round(statistics.median(times[s, lim]) * 1000, 2) for lim in limits} for s in shards}
    over = {str(s): {str(lim): round(statistics.median(times[s, lim]) / statistics.median(times[s, default]), 3)
                     for lim in limits} for s in shards} if default in limits else None
    finish(__file__, {"model": args.model, "synthetic_data": True, "default_max_forward_batch": default,
                      "ms_per_shard": ms, "over_default": over}, args)


if __name__ == "__main__":
    main()
