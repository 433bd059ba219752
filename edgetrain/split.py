"""How a global batch is divided across devices, and how device speed is estimated.

A device's time for a local batch of b samples is modelled as `overhead_s + b / samples_per_s`
(fixed per-step cost plus per-sample cost), fitted from its join-time profile and refreshed from
the compute times it reports each step. The proportional split gives each device the share that
makes all devices finish together (LB-BSP / seed 000: b_i proportional to speed once overheads
are accounted for); the equal split is the framework-default baseline.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedEstimate:
    """Affine model of one device's compute time per step: overhead_s + samples / samples_per_s."""

    overhead_s: float
    """Fixed per-step cost, seconds."""
    samples_per_s: float
    """Marginal throughput, samples per second."""

    def seconds(self, samples: int) -> float:
        """Predicted compute time for a local batch of `samples`."""
        return self.overhead_s + samples / self.samples_per_s if samples else 0.0


def fit_speed(timings: Sequence[tuple[int, float]]) -> SpeedEstimate:
    """Least-squares fit of time = a + b / v over (batch_size, seconds) pairs.

    With a single batch size (or a fit that yields a negative overhead or throughput) it falls
    back to pure proportionality, which is never worse than ignoring the profile.
    """
    points = [(b, s) for b, s in timings if b > 0 and s > 0]
    if not points:
        raise ValueError(f"no usable timings in {list(timings)}")
    sizes = {b for b, _ in points}
    if len(sizes) >= 2:
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_s = sum(s for _, s in points) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (s - mean_s) for b, s in points) / var_b
        intercept = mean_s - slope * mean_b
        if slope > 0 and intercept >= 0:
            return SpeedEstimate(overhead_s=intercept, samples_per_s=1.0 / slope)
    total_b = sum(b for b, _ in points)
    total_s = sum(s for _, s in points)
    return SpeedEstimate(overhead_s=0.0, samples_per_s=total_b / total_s)


def refine_speed(estimate: SpeedEstimate, samples: int, seconds: float,
                 weight: float = 0.3) -> SpeedEstimate:
    """Blend one observed step (samples in seconds) into the estimate's throughput (EMA)."""
    work_s = seconds - estimate.overhead_s
    if samples <= 0 or work_s <= 0:
        return estimate
    observed = samples / work_s
    blended = (1 - weight) * estimate.samples_per_s + weight * observed
    return SpeedEstimate(overhead_s=estimate.overhead_s, samples_per_s=blended)


def split_proportional(total: int, speeds: Mapping[str, SpeedEstimate]) -> dict[str, int]:
    """Integer shares minimising the slowest device's predicted time (all finish together).

    Greedy over samples: each next sample goes to the device that would finish it soonest. For
    affine time models this is optimal for the min-max objective. Devices too slow to help get 0.
    """
    if not speeds:
        raise ValueError("cannot split a batch across zero devices")
    shares = dict.fromkeys(speeds, 0)
    heap = [(speeds[d].seconds(1), d) for d in sorted(speeds)]
    heapq.heapify(heap)
    for _ in range(total):
        _, device = heapq.heappop(heap)
        shares[device] += 1
        heapq.heappush(heap, (speeds[device].seconds(shares[device] + 1), device))
    return shares


def split_equal(total: int, devices: Sequence[str]) -> dict[str, int]:
    """Equal shares (the remainder goes one each to the first devices in order)."""
    if not devices:
        raise ValueError("cannot split a batch across zero devices")
    base, extra = divmod(total, len(devices))
    return {d: base + (1 if i < extra else 0) for i, d in enumerate(devices)}


def predicted_step_seconds(shares: Mapping[str, int], speeds: Mapping[str, SpeedEstimate]) -> float:
    """Compute time of the slowest device under `shares`."""
    return max((speeds[d].seconds(n) for d, n in shares.items() if n), default=0.0)
