"""Channel-parallel stages (edgetrain.channels): the arithmetic, the plan form and the cost model.

The members of a channel group run here as threads of one process, their exchange a dictionary
(the boards' StagePeer exchange is exercised end to end in test_pipeline_integration): the sum of
the members' gradients equals the unsplit model's, for the BN-free small CNN (within the
pipeline tests' tolerance) and for MobileNetV2 (with BatchNorm: a channel group sees the whole
micro-batch, so it is exact too; relative to its largest gradient, ~7).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from coordinator.planning.cost import Problem, predict
from coordinator.planning.planner import plan_optimal
from coordinator.training.parameters import ParameterStore
from edgetrain.channels import ChannelSplit, split_parameters, splittable
from edgetrain.models import block_costs, build_model
from edgetrain.pipeline import channel_bounds, channel_shares, check_shares, routes
from edgetrain.plan import (
    BlockCost,
    BoardCost,
    ModelCost,
    Plan,
    StagePlan,
    plan_from_dict,
    plan_to_dict,
)
from edgetrain.tensors import unpack
from edgetrain.training import shard_tensor_names
from edgetrain.updates import UpdateFormats

TOLERANCE = {"small_cnn": 2e-5, "mobilenet_v2": 1e-4}
"""Of the largest gradient. MobileNetV2 runs channels-last (edgetrain.models.IMAGE_FORMATS), whose
oneDNN kernels sum a whole layer and its channel slices in orders further apart: one thread, seed 0,
2.1e-5 here against 1.3e-6 in the default layout (float32 gradients of this network differ from
float64's by 0.03-2% in norm)."""


class ThreadExchange:
    """The members' messages in one dictionary (key: micro-batch, tag, direction, from, to)."""

    def __init__(self, hub: dict, cond: threading.Condition, members: int, me: int) -> None:
        self.hub, self.cond, self.members, self.me = hub, cond, members, me

    def _put(self, key, tensor) -> None:
        with self.cond:
            self.hub[key] = tensor.clone()
            self.cond.notify_all()

    def _take(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.hub, timeout=60), f"no message {key}"
            return self.hub.pop(key)

    def gather(self, m, tag, local, bounds, dim):
        if bounds[self.me][1] > bounds[self.me][0]:
            for j in range(self.members):
                if j != self.me:
                    self._put((m, tag, "f", self.me, j), local)
        parts = [local if j == self.me else self._take((m, tag, "f", j, self.me))
                 for j, (lo, hi) in enumerate(bounds) if hi > lo]
        return torch.cat(parts, dim=dim)

    def all_reduce(self, m, tag, partial):
        for j in range(self.members):
            if j != self.me:
                self._put((m, tag, "b", self.me, j), partial)
        parts = [partial if j == self.me else self._take((m, tag, "b", j, self.me)) for j in range(self.members)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total


def grads_of_channel_group(model: nn.Module, x, y, weights, microbatches: int = 2):
    """Each member's gradients and losses after forward+backward of ``microbatches`` slices of x."""
    shares = channel_shares(weights)
    hub, cond = {}, threading.Condition()
    members = [copy.deepcopy(model) for _ in weights]
    losses, errors = [[] for _ in weights], []

    def run(k: int) -> None:
        try:
            m = members[k]
            m.train()
            blocks = m.block_modules()
            with ChannelSplit(blocks, shares, shares[k], ThreadExchange(hub, cond, len(weights), k)) as split:
                for mb, (xs, ys) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
                    split.microbatch = mb
                    loss = nn.functional.cross_entropy(m(xs), ys, reduction="sum") / len(x)
                    loss.backward()
                    losses[k].append(float(loss.detach()))
                if not split.leader:
                    for p in split.replicated_parameters(blocks):
                        p.grad = None
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(weights))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return members, losses


def summed_difference(reference: nn.Module, members) -> float:
    worst = 0.0
    for name, p in reference.named_parameters():
        total = sum(dict(m.named_parameters())[name].grad if dict(m.named_parameters())[name].grad is not None
                    else torch.zeros_like(p) for m in members)
        worst = max(worst, float((total - p.grad).abs().max()))
    return worst


@pytest.mark.parametrize(("model_name", "weights"), [
    ("small_cnn", [0.5, 0.3, 0.2]),
    ("small_cnn", [1.0, 1.0]),
    ("mobilenet_v2", [0.6, 0.4]),
])
def test_channel_group_gradients_sum_to_the_unsplit_models(model_name, weights):
    # Prepare: the same weights for the reference and every member; no dropout (its random
    # numbers would differ between the reference and the group)
    torch.manual_seed(0)
    model = build_model(model_name, seed=3)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    start = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    # Execute
    model.train()
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        (nn.functional.cross_entropy(model(xs), ys, reduction="sum") / len(x)).backward()
    members, losses = grads_of_channel_group(start, x, y, weights)

    # Assert: every member computed the same loss, and the gradients add up to the model's
    assert all(member_losses == losses[0] for member_losses in losses)
    largest = max(float(p.grad.abs().max()) for p in model.parameters())
    assert summed_difference(model, members) < TOLERANCE[model_name] * max(1.0, largest)  # float32 sums in other orders
    split_weight = next(m for m in members[-1].modules() if splittable(m)).weight
    lo, hi = channel_bounds(split_weight.shape[0], channel_shares(weights)[-1])
    assert split_weight.grad[:lo].abs().max() == 0 and split_weight.grad[lo:hi].abs().max() > 0
    for member in members:  # back to whole layers after the group
        assert "forward" not in next(m for m in member.modules() if splittable(m)).__dict__


def test_channel_shares_and_bounds_tile_every_layer():
    shares = channel_shares([0.5, 0.3, 0.2])
    assert shares == [(0.0, 0.5), (0.5, 51 / 64), (51 / 64, 1.0)]  # multiples of 1/64
    assert channel_shares([0.5001, 0.3, 0.2]) == shares  # a drifting speed estimate moves nothing
    assert channel_shares([0.999, 0.001])[1] == (63 / 64, 1.0)  # every member gets a step
    check_shares(shares)
    for bad in ([(0.0, 0.5), (0.6, 1.0)], [(0.1, 1.0)], [(0.0, 0.5), (0.5, 0.5), (0.5, 1.0)]):
        with pytest.raises(ValueError):
            check_shares(bad)
    for channels in (1, 3, 10, 64, 1280):
        bounds = [channel_bounds(channels, s) for s in shares]
        assert bounds[0][0] == 0 and bounds[-1][1] == channels
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError):
        channel_shares([1.0, 0.0])


def test_routes_send_from_a_channel_groups_leader_and_to_every_member():
    rows_group = [(0, 3), (3, 8)]
    channel_group = [(0, 8), (0, 8), (0, 8)]
    # sample-split group into a channel group: every member receives every row
    assert routes(rows_group, False, channel_group, True) == [
        (0, 0, 0, 3), (0, 1, 0, 3), (0, 2, 0, 3), (1, 0, 3, 8), (1, 1, 3, 8), (1, 2, 3, 8)]
    # channel group into a sample-split group: the leader alone sends, each receiver its rows
    assert routes(channel_group, True, rows_group, False) == [(0, 0, 0, 3), (0, 1, 3, 8)]
    assert routes(channel_group, True, channel_group[:2], True) == [(0, 0, 0, 8), (0, 1, 0, 8)]


def test_a_channel_group_round_trips_through_a_plans_plain_data():
    plan = Plan(stages=(StagePlan(0, 2, ("a",)), StagePlan(2, 4, ("b", "c"), "channels")), microbatches=2)
    data = plan_to_dict(plan)
    assert data["stages"][1] == {"blocks": 2, "boards": ["b", "c"], "split": "channels"}
    assert "split" not in data["stages"][0]
    assert plan_from_dict(data, where="t") == plan
    assert "blocks 2-3 on b+c (channels)" in plan.describe()
    with pytest.raises(ValueError, match="at least two boards"):
        plan_from_dict({"stages": [{"blocks": 4, "boards": ["a"], "split": "channels"}]}, where="t")
    with pytest.raises(ValueError, match="split"):
        plan_from_dict({"stages": [{"blocks": 4, "boards": ["a", "b"], "split": "columns"}]}, where="t")


def test_block_costs_measure_what_a_channel_group_splits():
    costs = block_costs(build_model("small_cnn"), batch_size=4)
    assert [c.channel_layers for c in costs] == [1, 1, 1, 1]
    assert all(c.channel_flops == c.forward_flops for c in costs)  # convolutions and the head: all split
    conv1 = costs[0]
    assert conv1.channel_input_bytes == 4 * 3 * 32 * 32 * 4 and conv1.channel_output_bytes == 4 * 16 * 32 * 32 * 4
    mobile = block_costs(build_model("mobilenet_v2"), batch_size=1)
    share = sum(c.channel_flops for c in mobile) / sum(c.forward_flops for c in mobile)
    assert 0.8 < share < 1.0  # depthwise convolutions stay whole on every member


def _model(blocks: int = 4) -> ModelCost:
    return ModelCost(tuple(BlockCost(name=f"b{i}", param_bytes=4e6, activation_bytes=2e5, forward_flops=5e8,
                                     channel_layers=2, channel_flops=4.5e8, channel_output_bytes=2e5,
                                     channel_input_bytes=2e5) for i in range(blocks)))


def _board(name: str, gflops: float = 10.0, mbit: float = 1000.0) -> BoardCost:
    return BoardCost(name=name, flops_per_s=gflops * 1e9, memory_bytes=2e9, mbit_per_s=mbit, rtt_s=0.001)


def test_the_cost_model_prices_a_channel_group_and_the_planner_may_be_told_not_to_use_them():
    fleet = [_board("a"), _board("b"), _board("c", 5.0)]
    model = _model()
    rows_plan = Plan(stages=(StagePlan(0, 4, ("a", "b")),), microbatches=4)
    chan_plan = Plan(stages=(StagePlan(0, 4, ("a", "b"), "channels"),), microbatches=4)
    rows, chan = predict(rows_plan, fleet, model, 32), predict(chan_plan, fleet, model, 32)
    # every member computes its half of the split layers and all of the rest, on every row ...
    f_rest, f_split = 4 * 3 * (5e8 - 4.5e8), 4 * 3 * 4.5e8  # training FLOPs per sample, 4 blocks
    assert chan.busy_s["a"] == pytest.approx(32 * (f_rest + f_split / 2) / 10e9, rel=1e-9)
    assert rows.busy_s["a"] == pytest.approx(16 * (f_rest + f_split) / 10e9, rel=1e-9)
    # ... keeps every row's activations and exchanges slices: slower here than splitting rows
    assert chan.step_s > rows.step_s
    assert chan.memory_bytes["a"] > rows.memory_bytes["a"]
    prob = Problem(fleet, model, 32)
    assert prob.stage(0, 4, fleet[:2]).split == "rows"
    assert Problem(fleet, model, 32, channel_groups=False).stage(0, 4, fleet[:2]).split == "rows"
    assert all(s.split == "rows" for s in plan_optimal(fleet, model, 32, channel_groups=False).stages)


def test_a_channel_group_needs_more_memory_and_time_than_rows_where_parameters_are_small():
    # a channel group keeps every row (so never fits where rows do not) and exchanges slices on
    # top of the same compute: with parameters as small as these, the chooser keeps rows
    model = _model(2)
    fleet = [_board("a"), _board("b")]
    prob = Problem(fleet, model, 16)
    rows, chan = prob.stage_as(0, 2, fleet, "rows"), prob.stage_as(0, 2, fleet, "channels")
    assert rows.split == "rows" and chan.split == "channels"
    assert chan.q < rows.q  # every row's activations on every member
    assert chan.gamma > rows.gamma  # the exchanges come on top of the same compute
    assert prob.stage(0, 2, fleet) == rows


def test_a_channel_group_member_moves_only_its_rows_of_the_split_layers():
    # Prepare: MobileNetV2's block 1 (a depthwise conv stays whole; two 1x1 convs are split)
    model = build_model("mobilenet_v2", seed=0)
    split = split_parameters(model)
    prefixes = ("blocks.features_1.",)
    formats = UpdateFormats(shard_tensor_names(model), split)
    share = channel_shares([0.7, 0.3])[1]
    grads = {n: torch.randn_like(t) for n, t in shard_tensor_names(model) if n.split(".", 1)[1].startswith(prefixes)}

    # Execute: the upload of the group's second member and of its leader; the download of a part
    member, leader = formats("none", prefixes, (share, False)), formats("none", prefixes, (channel_shares([0.7, 0.3])[0], True))
    back = member.decode(member.encode(grads, None)[0])
    store = ParameterStore(split=split)
    store.publish(0, dict(model.state_dict()))
    part = unpack(*store.part(0, prefixes, share))

    # Assert: the member sends its rows of the split gradients alone (no buffers, no whole
    # layers), decoded into layer-sized tensors with zeros elsewhere; the leader adds the rest
    assert set(back) == {"grad." + n for n in split if n.startswith(prefixes)}
    for name, tensor in back.items():
        begin, end = channel_bounds(split[name[5:]], share)
        assert torch.equal(tensor[begin:end], grads[name][begin:end]) and tensor[:begin].abs().sum() == 0
    assert member.wire_bytes() < 0.4 * leader.wire_bytes()
    assert "buf.blocks.features_1.conv.0.1.running_mean" in {m.name for m in leader.metas()}
    for name, tensor in part.items():
        expected = model.state_dict()[name]
        if name in split:
            expected = expected[slice(*channel_bounds(split[name], share))]
        assert torch.equal(tensor, expected), name


def test_the_planners_measured_model_cost_carries_what_a_channel_group_splits():
    from coordinator.planning.measure import model_cost

    cost = model_cost("small_cnn", batch=8, num_classes=10, threads=1)
    counted = block_costs(build_model("small_cnn"), batch_size=1)
    for block, measured in zip(cost.blocks, counted, strict=True):
        assert block.channel_layers == measured.channel_layers == 1
        assert block.channel_flops == pytest.approx(block.forward_flops)  # every FLOP is in a split layer
        assert block.channel_output_bytes == measured.channel_output_bytes > 0
        assert block.channel_param_bytes == measured.channel_param_bytes == block.param_bytes


def test_the_planner_chooses_a_channel_group_where_it_moves_fewer_parameters():
    # Prepare: a model whose second block is a large fully split layer with tiny activations (a
    # classifier-like block), boards on 100 Mbit/s links, stages not kept on the boards: a group
    # splitting samples moves the whole block down and up per member, a channel group only each
    # member's rows of it
    blocks = (BlockCost(name="body", param_bytes=1e6, activation_bytes=4e3, forward_flops=2e8),
              BlockCost(name="head", param_bytes=2e8, activation_bytes=40.0, forward_flops=1e8, channel_layers=1,
                        channel_flops=1e8, channel_param_bytes=2e8, channel_output_bytes=40.0,
                        channel_input_bytes=4e3))
    model = ModelCost(blocks)
    fleet = [BoardCost(name=n, flops_per_s=2e9, memory_bytes=4e9, mbit_per_s=100.0, rtt_s=0.001)
             for n in ("a", "b", "c")]

    # Execute
    chosen = plan_optimal(fleet, model, 32, stage_state="coordinator")
    without = plan_optimal(fleet, model, 32, stage_state="coordinator", channel_groups=False)

    # Assert: the head goes to a channel group, which the model predicts faster than any plan
    # without one; told not to, the planner keeps to sample-split groups and single hosts
    assert any(s.channels and s.end == 2 for s in chosen.stages), chosen.describe()
    assert not any(s.channels for s in without.stages)
    assert chosen.prediction.samples_per_s > 1.2 * without.prediction.samples_per_s
    assert "(channels)" in chosen.explain()


def test_a_channel_groups_forward_pass_draws_its_dropout_from_the_seed_alone():
    # Prepare: MobileNetV2's head has dropout (p 0.2). Every member seeds its forward pass the
    # same way (edge_client.stage._forward), so members (separate processes, each with its own
    # generator) draw the same masks as an unsplit pass under that seed. One member here (a
    # group's threads would share this process's generator)
    from edge_client.stage import _forward

    model = build_model("mobilenet_v2", seed=5)
    model.train()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            reference = model(x)
        exchange = ThreadExchange({}, threading.Condition(), 1, 0)
        with ChannelSplit(model.block_modules(), [(0.0, 1.0)], (0.0, 1.0), exchange) as split:
            torch.manual_seed(99)  # whatever the generator held before
            same = _forward(model.block_modules(), x, split, 1234)
            other = _forward(model.block_modules(), x, split, 4321)
            again = _forward(model.block_modules(), x, split, 1234)

    # Assert (BatchNorm uses the batch's statistics in training mode: no state between passes)
    assert torch.allclose(same, reference, atol=1e-5) and torch.equal(same, again)
    assert not torch.allclose(other, reference, atol=1e-3)  # another seed, other masks
