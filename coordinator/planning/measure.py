"""Timing this machine with torch: a model's per-block costs, one core's training speed, and the
CPU cost of moving a byte. Callers go through ``coordinator.planning.inputs``, which keeps the
results in the measurement cache and imports this module only to measure what it has not kept.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from edgetrain.models import block_costs, build_model
from edgetrain.plan import BlockCost, ModelCost
from edgetrain.split import SpeedEstimate, fit_speed


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """Run torch on `threads` threads inside the block, then as before (1: as one core does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def block_seconds(model: torch.nn.Module, batch: int, repeats: int = 2) -> list[float]:
    """Seconds of forward + backward of each block on a random batch (best of `repeats`)."""
    model.train()
    x = torch.randn(batch, 3, 32, 32)
    inputs = []
    with torch.no_grad():
        for block in model.block_modules():
            inputs.append(x)
            x = block(x)
    best = [float("inf")] * len(inputs)
    for _ in range(repeats):
        for b, (block, inp) in enumerate(zip(model.block_modules(), inputs, strict=True)):
            inp = inp.clone().requires_grad_()
            started = time.perf_counter()
            out = block(inp)
            out.backward(torch.ones_like(out))
            best[b] = min(best[b], time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    return best


def model_cost(model_name: str, batch: int, num_classes: int, threads: int) -> ModelCost:
    """The model's blocks as the planner sees them: counted FLOPs split by measured block time
    (and what a channel group splits: each block's split layers' share of its counted FLOPs)."""
    with num_threads(threads):
        model = build_model(model_name, num_classes=num_classes, seed=0)
        counted = block_costs(model, 1)
        seconds = block_seconds(model, batch)
    flops = sum(3 * b.forward_flops for b in counted)
    total_s = sum(seconds)
    blocks = []
    for b, s in zip(counted, seconds, strict=True):
        effective = flops * s / total_s / 3
        blocks.append(BlockCost(  # a channel group splits the layers' share of the block's counted FLOPs
            name=b.name, param_bytes=b.param_bytes, activation_bytes=b.output_bytes, forward_flops=effective,
            channel_layers=b.channel_layers,
            channel_flops=effective * b.channel_flops / b.forward_flops if b.forward_flops else 0.0,
            channel_param_bytes=b.channel_param_bytes, channel_output_bytes=b.channel_output_bytes,
            channel_input_bytes=b.channel_input_bytes))
    return ModelCost(tuple(blocks))


def one_core_speed(model_name: str, batches: tuple[int, int]) -> SpeedEstimate:
    """Training speed of the model on one core: samples/s and the fixed cost per forward+backward
    call, fitted over two batch sizes."""
    with num_threads(1):
        model = build_model(model_name, seed=0)
        model.train()
        timings = []
        for batch in batches:
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
            best = float("inf")
            for _ in range(2):
                started = time.perf_counter()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                best = min(best, time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
            timings.append((batch, best))
        return fit_speed(timings)


def transfer_cpu_s_per_byte(nbytes: int) -> float:
    """CPU seconds one core spends per byte a board moves: packing, chunking with checksums, and
    unpacking (what a transfer costs besides the link)."""
    from edgetrain.streaming import ChunkAssembler, iter_chunks
    from edgetrain.tensors import pack, unpack

    with num_threads(1):
        tensors = {"x": torch.randn(nbytes // 4)}
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            metas, payload = pack(tensors)
            assembler = ChunkAssembler(len(payload))
            for chunk in iter_chunks(payload):
                assembler.add(chunk.offset, chunk.data, chunk.crc32)
            unpack(metas, assembler.payload())
            best = min(best, time.perf_counter() - started)
        return best / nbytes

