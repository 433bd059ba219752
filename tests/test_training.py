"""Tests for edgetrain.training.compute_shard: a shard computed in chunks (gradient accumulation)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgetrain.models import build_model, has_batchnorm
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX, compute_shard

pytestmark = pytest.mark.timeout(120)


def _batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 10))


@pytest.mark.parametrize("max_batch", [1, 7, 16, 37])
def test_chunked_shard_gives_the_whole_shard_gradient_on_a_batchnorm_free_model(max_batch: int) -> None:
    model = build_model("small_cnn", seed=0)
    assert not has_batchnorm(model)
    x, y = _batch(37)
    whole = compute_shard(copy.deepcopy(model), x, y)
    chunked = compute_shard(copy.deepcopy(model), x, y, max_batch)
    assert chunked.samples == whole.samples == 37
    assert chunked.correct == whole.correct
    assert chunked.loss == pytest.approx(whole.loss, rel=1e-5)
    assert chunked.tensors.keys() == whole.tensors.keys()
    for name, grad in whole.tensors.items():
        torch.testing.assert_close(chunked.tensors[name], grad, rtol=1e-4, atol=1e-6)


def test_chunked_shard_averages_the_chunks_running_statistics_from_the_same_start() -> None:
    model, x, y = _bn_net(), *_batch(10, seed=1)
    expected = {}
    for begin, end in ((0, 3), (3, 6), (6, 10)):  # 3 equal chunks; each one's update from the start, by samples
        alone = copy.deepcopy(model).train()
        alone(x[begin:end])
        for name, b in alone.named_buffers():
            if b.is_floating_point():
                expected[name] = expected.get(name, 0) + b * (end - begin) / 10
    result = compute_shard(model, x, y, 4)
    stats = {k.removeprefix(BUFFER_PREFIX): v for k, v in result.tensors.items() if k.startswith(BUFFER_PREFIX)}
    assert stats.keys() == expected.keys() and stats
    for name, value in expected.items():
        torch.testing.assert_close(stats[name], value)
        torch.testing.assert_close(dict(model.named_buffers())[name], value)  # the model holds them too


def test_chunked_shard_normalises_each_chunk_with_its_own_statistics() -> None:
    model, x, y = _bn_net(), *_batch(8, seed=2)
    chunked = compute_shard(copy.deepcopy(model), x, y, 4)
    halves = [compute_shard(copy.deepcopy(model), x[i:i + 4], y[i:i + 4]) for i in (0, 4)]
    for name in chunked.tensors:
        if name.startswith(GRAD_PREFIX):  # the mean gradient of the two halves, each normalised alone
            torch.testing.assert_close(chunked.tensors[name], (halves[0].tensors[name] + halves[1].tensors[name]) / 2,
                                       rtol=1e-4, atol=1e-6)
    assert chunked.loss == pytest.approx((halves[0].loss + halves[1].loss) / 2, rel=1e-5)


def test_a_fedprox_round_is_the_hand_computed_proximal_sgd() -> None:
    # Prepare: a 2 x 2 linear model (no bias), two samples, two local steps of one sample each
    from edgetrain.training import local_train

    w0 = [[0.5, -0.2], [0.1, 0.3]]
    xs, ys = [[1.0, 2.0], [-1.0, 0.5]], [1, 0]
    lr, mu = 0.1, 0.5
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(w0))

    # Execute
    result = local_train(model, torch.tensor(xs), torch.tensor(ys), steps=2, batch_size=1, lr=lr, prox_mu=mu)

    # Assert: by hand, with floats: the cross-entropy gradient (softmax - one-hot) x^T plus the
    # proximal term mu (w - w0), one SGD step per sample
    import math

    w = [row[:] for row in w0]
    for x, y in zip(xs, ys):
        logits = [sum(w[i][j] * x[j] for j in range(2)) for i in range(2)]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        probs = [e / sum(exps) for e in exps]
        grad = [[(probs[i] - (i == y)) * x[j] + mu * (w[i][j] - w0[i][j]) for j in range(2)] for i in range(2)]
        w = [[w[i][j] - lr * grad[i][j] for j in range(2)] for i in range(2)]
    expected_change = torch.tensor([[w0[i][j] - w[i][j] for j in range(2)] for i in range(2)])
    torch.testing.assert_close(result.tensors[GRAD_PREFIX + "weight"], expected_change, rtol=1e-6, atol=1e-7)
    # and the proximal term mattered: without it the second step differs
    plain = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        plain.weight.copy_(torch.tensor(w0))
    fedavg = local_train(plain, torch.tensor(xs), torch.tensor(ys), steps=2, batch_size=1, lr=lr)
    assert not torch.allclose(fedavg.tensors[GRAD_PREFIX + "weight"], expected_change, atol=1e-4)
