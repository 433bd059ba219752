"""The gradient noise scale of a run, estimated from the updates the coordinator already receives.

A gradient averaged over a batch of b samples has E|g_b|^2 = |G|^2 + S / b, where G is the true
gradient and S the trace of the per-sample gradients' covariance (McCandlish et al. 2018). A
data-parallel step gives both ends at once: each shard's gradient over its own b_i samples, and
their sample-weighted mean over the global batch B. A least-squares fit of |g|^2 against 1/b over
those points estimates |G|^2 and S; each is smoothed over steps (exponential moving averages) and
the **noise scale** is phi = S / |G|^2 (Pollux's and AdaptDL's estimator: the ratio of the
averages, not the average of ratios, which is biased). Pollux's **statistical efficiency** of a
batch M against the batch M0 a run started from is (phi + M0) / (phi + M): the fraction of the
progress per sample that the larger batch keeps.

It needs the shards' gradients as the boards computed them: uncompressed (a lossy codec adds its
own error to |g_i|^2) and not momenta (boards that keep momentum send that instead). Data-parallel
steps without those (and pipelines, whose hosts send partial gradients) are not observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SMOOTHING = 0.9
"""Weight of the past in the moving averages (AdaptDL's default of 0.9 keeps about ten steps)."""


def fit(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(|G|^2, S) from (batch size, |g|^2) points by least squares on |g|^2 = |G|^2 + S / b
    (None when the points do not span two batch sizes)."""
    xs = [1.0 / b for b, _ in points]
    ys = [y for _, y in points]
    n = len(points)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if n < 2 or var_x <= 1e-18 * max(mean_x ** 2, 1e-30):
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x
    return mean_y - slope * mean_x, slope


class NoiseScale:
    """The running estimate of a job's gradient noise scale (see the module docstring)."""

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        self.smoothing = smoothing
        self._sq = self._var = 0.0
        self._weight = 0.0
        """Sum of the moving averages' weights (their bias correction, as Adam's)."""

    def observe(self, shards: Sequence[tuple[int, float]], total: tuple[int, float]) -> bool:
        """One step: each shard's (samples, squared gradient norm) and the aggregate's over all
        of them. Returns whether the step was used (it needs two batch sizes)."""
        estimate = fit([*shards, total])
        if estimate is None:
            return False
        sq, var = estimate
        a = self.smoothing
        self._sq = a * self._sq + (1 - a) * sq
        self._var = a * self._var + (1 - a) * var
        self._weight = a * self._weight + (1 - a)
        return True

    @property
    def gradient_sq(self) -> float | None:
        """|G|^2, smoothed (None before the first observation)."""
        return self._sq / self._weight if self._weight else None

    @property
    def variance(self) -> float | None:
        """S, the per-sample gradient variance's trace, smoothed."""
        return self._var / self._weight if self._weight else None

    @property
    def value(self) -> float | None:
        """phi = S / |G|^2 in samples (None until estimated, or when |G|^2 is not positive)."""
        sq, var = self.gradient_sq, self.variance
        if sq is None or sq <= 0 or not math.isfinite(var / sq):
            return None
        return max(var / sq, 0.0)


def efficiency(phi: float, initial_batch: float, batch: float) -> float:
    """Pollux's statistical efficiency (phi + M0) / (phi + M) of batch `batch` against `initial_batch`."""
    return (phi + initial_batch) / (phi + batch)
