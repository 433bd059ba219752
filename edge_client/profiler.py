"""Join-time profile: how fast this board trains the job's model on the device it trains on, what a
byte costs to move to that device and back, and how much memory it has."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import psutil
import torch
from torch import nn

from edgetrain.board_hardware import ComputeThrottle
from edgetrain.data import make_batch
from edgetrain.training import DeviceCopies, compute_shard, model_device
from edgetrain.work import BoardProfile


def time_training_step(model: nn.Module, dataset, batch_size: int, limiter: ComputeThrottle, *,
                       repeats: int = 3, max_forward_batch: int = 0) -> float:
    """Fastest wall seconds of one forward + backward at `batch_size`, after one warm-up step.

    The minimum, not the median: interference from other work on the board only ever adds time.
    """
    indices = [i % len(dataset) for i in range(batch_size)]
    x, y = make_batch(dataset, indices, augment=False, seed=0, step=0)
    samples = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        with limiter.working():
            compute_shard(model, x, y, max_forward_batch)
        if i:
            samples.append(time.perf_counter() - started)
    return min(samples)


def profile_device(model: nn.Module, dataset, batch_sizes: Sequence[int], limiter: ComputeThrottle, *,
                   max_forward_batch: int = 0, memory: Callable[[], tuple[int, int]] | None = None) -> BoardProfile:
    """Time training at each batch size, the way shards are computed (in chunks of at most
    `max_forward_batch`); the model's weights are overwritten before real work."""
    timings = tuple((b, time_training_step(model, dataset, b, limiter, max_forward_batch=max_forward_batch))
                    for b in batch_sizes)
    if memory is None:
        host = psutil.virtual_memory()
        total, available = host.total, host.available
    else:  # an emulated board's cap
        total, available = memory()
    rss = psutil.Process(os.getpid()).memory_info().rss
    device = model_device(model)
    if device.type != "cuda":
        return BoardProfile(timings, total, available, rss)
    props = torch.cuda.get_device_properties(device)
    free = 0 if props.is_integrated else int(torch.cuda.mem_get_info(device)[0])  # a Jetson's is the board's
    return BoardProfile(timings, total, available, rss, device=f"{device} {props.name}" + (
        " (shares memory)" if props.is_integrated else ""), device_memory_bytes=free,
        copy_s_per_byte=time_copies(device))


COPY_BYTES = 8 << 20
"""What the copy timing moves: a few activations' worth, large enough that the per-call cost fades."""


def time_copies(device: torch.device, repeats: int = 3) -> float:
    """Fastest seconds per byte of a tensor's trip to `device` and back, as a stage's activations
    and gradients make it (through DeviceCopies)."""
    copies = DeviceCopies(device)
    tensor = torch.empty(COPY_BYTES // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        copies.to_host(copies.to_device(tensor))  # the copy back synchronises
        best = min(best, time.perf_counter() - started)
    return best / COPY_BYTES


def torch_threads_for(speed: float | None) -> int | None:
    """Threads for an emulated speed (whole cores it may use); None keeps torch's default."""
    return None if speed is None else max(1, int(speed + 0.999))


def set_threads(threads: int | None) -> None:
    """Apply a torch thread count if one is given."""
    if threads:
        torch.set_num_threads(threads)
