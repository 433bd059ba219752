"""One fixed training workload that a board and the job server both time, to compare their CPUs.

A board joining the job server's lobby does not know which model it will train next, so it times
this workload instead; the job server times it on one of its own cores, and the ratio is the
board's speed as a fraction of that core (what fleet files and the planner's inputs use).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

REFERENCE_MODEL = "mobilenet_v2"
REFERENCE_BATCH = 4


def reference_seconds(working: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                      repeats: int = 3) -> float:
    """Fastest wall seconds of one forward + backward of MobileNetV2 (CIFAR shape, batch 4), after
    one warm-up; `working` wraps each burst (an emulated board's CPU limiter)."""
    from edgetrain.models import build_model

    model = build_model(REFERENCE_MODEL, seed=0)
    model.train()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(REFERENCE_BATCH, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (REFERENCE_BATCH,), generator=generator)
    best = float("inf")
    for i in range(repeats + 1):
        started = time.perf_counter()
        with working():
            torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        if i:
            best = min(best, time.perf_counter() - started)
    return best
