"""The gradient noise scale estimator recovers a known noise scale from synthetic gradients."""

from __future__ import annotations

import pytest
import torch

from coordinator.training.noise_scale import NoiseScale, efficiency, fit


def test_the_estimate_recovers_a_known_noise_scale_within_ten_percent():
    # Prepare: a true gradient G and per-sample noise of variance sigma^2 per coordinate, so
    # S = d sigma^2 and phi = S / |G|^2; shards of unequal sizes, as a proportional split gives
    torch.manual_seed(0)
    d, sigma = 2000, 0.3
    true = torch.randn(d) * 0.05
    phi = d * sigma ** 2 / float(true @ true)
    sizes = [70, 39, 19, 4]
    estimator = NoiseScale()

    # Execute: 200 steps of shard gradients (mean over b_i noisy samples) and their weighted mean
    for _ in range(200):
        grads = [true + torch.randn(d) * sigma / b ** 0.5 for b in sizes]
        total = sum(b * g for b, g in zip(sizes, grads)) / sum(sizes)
        estimator.observe([(b, float(g @ g)) for b, g in zip(sizes, grads)], (sum(sizes), float(total @ total)))

    # Assert
    assert estimator.value == pytest.approx(phi, rel=0.10), (estimator.value, phi)
    assert estimator.gradient_sq == pytest.approx(float(true @ true), rel=0.10)


def test_one_batch_size_alone_tells_nothing_and_efficiency_is_pollux_s():
    assert fit([(32, 1.0), (32, 1.2)]) is None
    assert not NoiseScale().observe([(32, 1.0)], (32, 1.0)) and NoiseScale().value is None
    assert efficiency(100.0, 64, 64) == 1.0
    assert efficiency(100.0, 64, 256) == pytest.approx(164 / 356)
    assert efficiency(1e9, 64, 256) == pytest.approx(1.0, rel=1e-6)  # very noisy: a larger batch loses nothing
