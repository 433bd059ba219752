"""How a global batch is divided across devices, and how device speed is estimated.

A device's time for a local batch of b samples is modelled as
`comm_s + overhead_s + b / samples_per_s`: its communication per step (parameters down,
gradients up — on a slow board mostly CPU spent copying and checksumming), a fixed compute cost
per step, and a per-sample cost. The compute part's shape (fixed against per-sample cost) is
fitted from the join-time profile and its scale, like the communication time, is refreshed from
the timings the device reports each step (refine_speed). The proportional split gives each device the share that
makes all devices finish together (LB-BSP / seed 000: b_i proportional to speed once overheads
are accounted for); the equal split is the framework-default baseline.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedEstimate:
    """Affine model of one device's time per step: comm_s + overhead_s + samples / samples_per_s."""

    overhead_s: float
    """Fixed compute cost per step, seconds."""
    samples_per_s: float
    """Marginal compute throughput, samples per second."""
    comm_s: float = 0.0
    """Communication time per step (observed; 0 until the first step)."""

    def seconds(self, samples: int) -> float:
        """Predicted time for a local batch of `samples` (0 when it gets none)."""
        return self.comm_s + self.overhead_s + samples / self.samples_per_s if samples else 0.0


def fit_speed(timings: Sequence[tuple[int, float]]) -> SpeedEstimate:
    """Least-squares fit of time = a + b / v over (batch_size, seconds) pairs.

    With a single batch size (or a fit that yields a negative overhead or throughput) it falls
    back to pure proportionality, which is never worse than ignoring the profile.
    """
    points = [(b, s) for b, s in timings if b > 0 and s > 0 and math.isfinite(s)]
    if not points:
        raise ValueError(f"no usable timings in {list(timings)}")
    if len({b for b, _ in points}) >= 2:
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


REFINE_WEIGHT = 0.3
"""Weight of one observed step in a device's speed estimate (an exponential moving average)."""

REFINE_CLIP = 2.0
"""Most one observed step counts as, as a multiple of its prediction. A one-off stall (a garbage
collection, a neighbour's burst on a shared machine, the first step after an evaluation) of 8x
its prediction would otherwise make the board predicted 3x slower at once, and the split starve
it for the steps the estimate takes to recover; a lasting slowdown still moves the estimate 1.3x
a step. Faster steps count as they are: stalls only ever slow a step, and a board's estimate must
recover at once from a slow first measurement."""


def refine_speed(estimate: SpeedEstimate, samples: int, compute_s: float, comm_s: float,
                 weight: float = REFINE_WEIGHT) -> SpeedEstimate:
    """Blend one observed step into the estimate (EMA of the compute model's scale and of the
    communication time).

    The compute model keeps its shape — the fixed cost per step against the cost per sample, as
    the join-time profile measured it over batch sizes far apart — and takes its scale from the
    steps: the predicted compute time for `samples` moves `weight` of the way to the observed
    one, its fixed and per-sample parts alike. A step's own samples hardly vary, so they cannot
    tell the two parts apart; fitting only the rate to them put all of a difference between run
    and profile on the per-sample cost and mispredicted every share a board had not run yet
    (docs/benchmarks.md#dp).

    The first observed communication time is taken as it is: blending it with the 0 that stood
    for "not observed yet" would under-predict a slow board's transfers for several steps (at
    weight 0.3, 30% of them after one step, 66% after three), and the split would keep giving
    it samples that make it the straggler. Later ones, like compute times, count as at most
    REFINE_CLIP times what the estimate predicted."""
    if not (math.isfinite(compute_s) and math.isfinite(comm_s)):
        return estimate
    if comm_s <= 0:
        comm = estimate.comm_s
    elif estimate.comm_s <= 0:
        comm = comm_s
    else:
        comm = estimate.comm_s * _blend(comm_s / estimate.comm_s, weight)
    overhead, rate = estimate.overhead_s, estimate.samples_per_s
    if samples > 0 and compute_s > 0:
        scale = _blend(compute_s / (overhead + samples / rate), weight)
        overhead, rate = overhead * scale, rate / scale
    return SpeedEstimate(overhead_s=overhead, samples_per_s=rate, comm_s=comm)


def _blend(ratio: float, weight: float) -> float:
    """The factor by which one observation, `ratio` x the prediction, moves an estimate."""
    return (1 - weight) + weight * min(ratio, REFINE_CLIP)


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


SHARE_CHANGE_GAIN = 0.02
"""A new proportional split replaces the shares in use only if it predicts a step at least this
much faster (at least: see share_change_gain). Every new local batch size costs the board time,
as the kernels and buffers for each new shape are set up anew (docs/benchmarks.md#dp)."""


def share_change_gain(rate_noise: float, devices: int, weight: float = REFINE_WEIGHT) -> float:
    """The gain a new split must predict to replace the shares in use, for `devices` whose measured
    per-step throughput scatters against each other's by `rate_noise` (relative standard
    deviation, step to step; coordinator.registry.DeviceRegistry.rate_noise).

    Each speed estimate is a moving average of those measurements, itself off by
    e = sqrt(weight / (2 - weight)) * rate_noise (0.42x at weight 0.3). The shares in use were fit
    to the estimates of some steps ago, so against the current ones each device's predicted time
    is off by up to sqrt(2) e, and the slowest of n such devices, the predicted step, by about
    sqrt(2 ln n) times that: a fresh split predicts a gain of 2 sqrt(ln n) e from noise alone. Below
    it a new split chases noise, re-splitting identical boards nearly every step, and every change
    of a local batch size costs its board (SHARE_CHANGE_GAIN). SHARE_CHANGE_GAIN is the floor."""
    if devices < 2 or not math.isfinite(rate_noise) or rate_noise <= 0:
        return SHARE_CHANGE_GAIN
    return max(SHARE_CHANGE_GAIN, 2 * math.sqrt(math.log(devices) * weight / (2 - weight)) * rate_noise)


def split_sticky(total: int, speeds: Mapping[str, SpeedEstimate], previous: Mapping[str, int] | None,
                 min_gain: float = SHARE_CHANGE_GAIN) -> dict[str, int]:
    """The proportional split, or `previous` (same devices, same total) when the fresh split
    would not shorten the predicted step by more than `min_gain` (a fraction)."""
    fresh = split_proportional(total, speeds)
    if not previous or set(previous) != set(speeds) or sum(previous.values()) != total:
        return fresh
    kept = predicted_step_seconds(previous, speeds)
    return dict(previous) if kept <= (1 + min_gain) * predicted_step_seconds(fresh, speeds) else fresh


def split_equal(total: int, devices: Sequence[str]) -> dict[str, int]:
    """Equal shares (the remainder goes one each to the first devices in order)."""
    if not devices:
        raise ValueError("cannot split a batch across zero devices")
    base, extra = divmod(total, len(devices))
    return {d: base + (1 if i < extra else 0) for i, d in enumerate(devices)}


def predicted_step_seconds(shares: Mapping[str, int], speeds: Mapping[str, SpeedEstimate]) -> float:
    """Compute time of the slowest device under `shares`."""
    return max((speeds[d].seconds(n) for d, n in shares.items() if n), default=0.0)
