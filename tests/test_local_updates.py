"""Heterogeneity-aware local updates: boards that take unequal local steps (a shared time budget at
their own speed), FedNova's normalisation of their updates, and DiLoCo's outer momentum.

The arithmetic is checked on quadratics: board i's loss is f_i(w) = |w - c_i|^2 / 2, so local SGD
from w moves it to c_i + (1 - lr)^tau (w - c_i) in tau steps, and the minimum of sum_i p_i f_i is
sum_i p_i c_i. FedNova's normalisation is first order in the local learning rate (a board's change
is about lr * tau_i * gradient), so the local rate is small here and the server's large. The server side is the coordinator's own (aggregator.combine, apply_update, the
aggregator's outer optimiser); an end-to-end run gives boards of different speeds different steps.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_metrics, small_job
from torch import nn

from coordinator.training.aggregator import Weighted, apply_update, combine, normalized_factors
from coordinator.training.data_parallel import local_steps
from coordinator.training.steps import Contribution
from edgetrain.config import FederatedConfig, OptimizerConfig
from edgetrain.split import SpeedEstimate
from edgetrain.training import GRAD_PREFIX, make_optimizer

CENTRES = {"a": torch.tensor([4.0, 0.0]), "b": torch.tensor([0.0, 4.0]), "c": torch.tensor([-2.0, -2.0])}
STEPS = {"a": 20, "b": 5, "c": 1}
"""Unequal local steps: board a is 20 times as fast as board c."""
DATA = {"a": 100, "b": 100, "c": 100}
LOCAL_LR, BATCH = 0.001, 8


class Point(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


def local_change(w: torch.Tensor, board: str) -> torch.Tensor:
    """w_round - w_local after the board's local SGD on its quadratic."""
    local = w.clone()
    for _ in range(STEPS[board]):
        local -= LOCAL_LR * (local - CENTRES[board])
    return w - local


def rounds(model: Point, optimizer, count: int, *, normalize: bool) -> torch.Tensor:
    """`count` federated rounds with the coordinator's combine and outer step; the final w."""
    for _ in range(count):
        w = model.w.detach().clone()
        done = {b: Contribution(device_id=b, samples=STEPS[b] * BATCH, loss=0.0, correct=0, compute_s=0.0,
                                download_s=0.0, encode_s=0.0, upload_s=0.0,
                                tensors={GRAD_PREFIX + "w": local_change(w, b)}) for b in CENTRES}
        factors = normalized_factors(STEPS, DATA, {b: c.samples for b, c in done.items()}) if normalize else {}
        apply_update(model, optimizer, combine([Weighted(c, 0, factors.get(b, 1.0)) for b, c in done.items()]))
    return model.w.detach()


def outer(lr: float = 1.0, momentum: float = 0.0) -> tuple[Point, torch.optim.Optimizer]:
    model = Point()
    fed = FederatedConfig(server_lr=lr, server_momentum=momentum)
    return model, make_optimizer(model, OptimizerConfig(lr=fed.server_lr, momentum=fed.server_momentum,
                                                        nesterov=fed.server_momentum > 0, weight_decay=0.0,
                                                        schedule="constant"))


def test_fednova_reaches_the_true_minimum_where_plain_averaging_does_not():
    true_minimum = torch.stack(list(CENTRES.values())).mean(dim=0)  # equal data: the mean of the centres

    plain = rounds(*outer(lr=50.0), 300, normalize=False)
    nova = rounds(*outer(lr=50.0), 300, normalize=True)

    # plain averaging weights each change by the samples the board went through (its steps), and
    # settles near the fast board's centre; FedNova settles at the minimum of the fleet's loss (up to
    # its first-order error in the local rate: lr * tau = 0.02 here)
    assert (nova - true_minimum).norm() < 0.02, nova
    assert (plain - true_minimum).norm() > 1.0, plain
    assert (plain - CENTRES["a"]).norm() < (plain - CENTRES["c"]).norm()


def test_fednova_weights_follow_the_boards_data_not_their_steps():
    data = {"a": 300, "b": 100, "c": 100}
    factors = normalized_factors(STEPS, data, {b: STEPS[b] * BATCH for b in STEPS})
    total = sum(STEPS[b] * BATCH for b in STEPS)
    weights = {b: STEPS[b] * BATCH * factors[b] / total for b in STEPS}  # what combine applies to each change
    tau_eff = sum(data[b] / 500 * STEPS[b] for b in STEPS)
    for b in STEPS:
        assert weights[b] == pytest.approx(data[b] / 500 * tau_eff / STEPS[b])
    # with equal steps it is plain sample-weighted averaging
    equal = normalized_factors(dict.fromkeys(STEPS, 5), DATA, dict.fromkeys(STEPS, 40))
    assert all(f == pytest.approx(1.0) for f in equal.values())


def test_outer_nesterov_momentum_gets_closer_in_as_many_rounds_than_server_lr_one_alone():
    # Prepare: boards that barely move each round (one small local step), FedNova on
    true_minimum = torch.stack(list(CENTRES.values())).mean(dim=0)
    STEPS_BEFORE = dict(STEPS)
    STEPS.update(a=1, b=1, c=1)
    try:
        plain = rounds(*outer(lr=1.0), 20, normalize=True)
        diloco = rounds(*outer(lr=0.7, momentum=0.9), 20, normalize=True)
    finally:
        STEPS.update(STEPS_BEFORE)

    # Assert: in 20 rounds the outer momentum covered several times the distance server_lr 1 did
    start = true_minimum.norm()
    assert start - (diloco - true_minimum).norm() > 3 * (start - (plain - true_minimum).norm()) > 0


def test_a_time_budget_gives_each_board_steps_in_proportion_to_its_speed():
    fed = FederatedConfig(local_batch=16, local_time_s=2.0)
    fast, slow = SpeedEstimate(0.0, 160.0), SpeedEstimate(0.0, 40.0)
    assert (local_steps(fed, fast), local_steps(fed, slow)) == (20, 5)
    assert local_steps(fed, SpeedEstimate(0.5, 1.0)) == 1  # at least one step
    assert local_steps(FederatedConfig(local_steps=7), slow) == 7  # no budget: the fixed steps


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_boards_of_different_speeds_take_different_local_steps_and_the_round_still_applies(coordinator_factory,
                                                                                           client_factory):
    # Prepare: a time budget per round; FedNova and outer momentum on
    job = small_job(training={"steps": 4, "min_clients": 2, "global_batch": 32},
                    aggregation={"rule": "fedavg"},
                    federated={"local_time_s": 0.5, "local_batch": 8, "normalize": True, "server_lr": 0.7,
                               "server_momentum": 0.9, "partitions": 2})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "quick", 0.6)
    client_factory(coordinator.address, "slow", 0.15)

    # Execute
    summary = coordinator.wait(timeout=200)

    # Assert: every round applied, the faster board took more samples (more local steps of 8)
    steps = read_metrics(coordinator.run_dir)
    assert len(steps) == 4 and summary["steps_applied"] == 4
    for record in steps:
        shares = {d.rsplit("-", 1)[0]: n for d, n in record["shares"].items()}
        assert shares["quick"] % 8 == 0 and shares["slow"] % 8 == 0
        assert shares["quick"] > shares["slow"]
    assert json.loads((coordinator.run_dir / "summary.json").read_text())["test_accuracy"] is not None
