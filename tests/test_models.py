"""Tests for edgetrain.models: block structure, determinism, stage execution and block costs."""

import pytest
import torch
from torch import nn

from edgetrain.models import (
    MODEL_NAMES,
    BlockCost,
    BlockModel,
    block_costs,
    build_model,
    count_params,
    has_batchnorm,
)

RESNET18_BLOCKS = ["stem"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["head"]
MOBILENET_V2_BLOCKS = [f"features.{i}" for i in range(19)] + ["head"]
SMALL_CNN_BLOCKS = ["conv1", "conv2", "conv3", "head"]


@pytest.fixture(scope="module")
def models() -> dict[str, BlockModel]:
    return {name: build_model(name, seed=0) for name in MODEL_NAMES}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_output_shape_for_cifar_input(models, name):
    # Prepare
    model = models[name].eval()

    # Execute
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))

    # Assert
    assert logits.shape == (2, 10)


def test_num_classes_sets_output_width():
    model = build_model("small_cnn", num_classes=7, seed=0)

    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 7)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("resnet18", RESNET18_BLOCKS),
        ("mobilenet_v2", MOBILENET_V2_BLOCKS),
        ("small_cnn", SMALL_CNN_BLOCKS),
    ],
)
def test_block_names(models, name, expected):
    assert models[name].block_names == expected


def test_parameter_names_are_stable(models):
    names = list(dict(models["resnet18"].named_parameters()))

    assert names[0] == "blocks.stem.0.weight"
    assert "blocks.layer1_0.conv1.weight" in names
    assert names[-1] == "blocks.head.2.bias"


def test_resnet18_has_cifar_stem(models):
    stem_conv = models["resnet18"].blocks["stem"][0]

    assert (stem_conv.kernel_size, stem_conv.stride, stem_conv.padding) == ((3, 3), (1, 1), (1, 1))
    assert stem_conv.bias is None
    assert not any(isinstance(m, nn.MaxPool2d) for m in models["resnet18"].modules())


def test_mobilenet_v2_stem_has_stride_one(models):
    assert models["mobilenet_v2"].blocks["features_0"][0].stride == (1, 1)


def test_mobilenet_v2_runs_channels_last_with_the_same_arithmetic_and_parameters():
    # Prepare: the catalog's MobileNetV2 and a copy run in the default layout
    fast = build_model("mobilenet_v2", seed=0).train()
    plain = build_model("mobilenet_v2", seed=0).train()
    plain.image_format = torch.contiguous_format
    x, y = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 10

    # Act
    first = fast.run_blocks(x, 0, 1)
    losses = []
    for model in (fast, plain):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same dropout mask for both
            losses.append(nn.functional.cross_entropy(model(x), y))
        losses[-1].backward()

    # Assert: activations are channels-last, parameters and their gradients keep their layout,
    # and loss and gradients agree with the default layout's up to float rounding (float32
    # gradients of this BatchNorm network already differ from float64's by 0.03-2% in norm)
    assert fast.image_format == torch.channels_last
    assert first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()
    assert all(p.is_contiguous() and p.grad.is_contiguous() for p in fast.parameters())
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    a, b = (torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (fast, plain))
    assert (a - b).norm() / b.norm() < 0.05


def test_resnet18_and_small_cnn_keep_the_default_layout(models):
    assert models["resnet18"].image_format == torch.contiguous_format
    assert models["small_cnn"].image_format == torch.contiguous_format


def test_has_batchnorm(models):
    assert has_batchnorm(models["resnet18"])
    assert has_batchnorm(models["mobilenet_v2"])
    assert not has_batchnorm(models["small_cnn"])


def test_small_cnn_has_no_dropout(models):
    assert not any(isinstance(m, nn.Dropout) for m in models["small_cnn"].modules())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seed_makes_initialisation_deterministic(name):
    first = build_model(name, seed=3).state_dict()
    second = build_model(name, seed=3).state_dict()
    other = build_model(name, seed=4).state_dict()

    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


def test_seeded_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)

    build_model("small_cnn", seed=0)

    assert torch.equal(torch.rand(4), expected)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="resnet18.*mobilenet_v2.*small_cnn"):
        build_model("vgg16")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_run_blocks_in_two_stages_equals_forward(models, name):
    # Prepare
    model = models[name].eval()
    x = torch.randn(2, 3, 32, 32)
    cut = len(model.block_names) // 2

    # Execute
    with torch.no_grad():
        staged = model.run_blocks(model.run_blocks(x, 0, cut), cut, len(model.block_names))
        whole = model(x)

    # Assert
    assert torch.equal(staged, whole)


def test_run_blocks_rejects_bad_range(models):
    with pytest.raises(IndexError):
        models["small_cnn"].run_blocks(torch.randn(1, 3, 32, 32), 3, 2)


def test_block_model_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        BlockModel([("a.b", nn.ReLU()), ("a_b", nn.ReLU())])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_block_costs_account_for_every_parameter(models, name):
    costs = block_costs(models[name], batch_size=4)

    assert [c.name for c in costs] == models[name].block_names
    assert sum(c.params for c in costs) == count_params(models[name])
    assert sum(c.param_bytes for c in costs) == 4 * count_params(models[name])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_block_costs_scale_linearly_with_batch(models, name):
    # Execute
    single = block_costs(models[name], batch_size=1)
    batch = block_costs(models[name], batch_size=8)

    # Assert
    for one, eight in zip(single, batch, strict=True):
        assert one.forward_flops > 0
        assert eight.forward_flops == 8 * one.forward_flops
        assert eight.output_shape == (8, *one.output_shape[1:])
        assert eight.output_bytes == 8 * one.output_bytes


def test_block_cost_output_matches_real_activations(models):
    # Prepare
    model = models["small_cnn"]
    x = torch.randn(5, 3, 32, 32)

    # Execute
    costs = block_costs(model, batch_size=5)

    # Assert
    with torch.no_grad():
        for index, cost in enumerate(costs):
            x = model.run_blocks(x, index, index + 1)
            assert cost.output_shape == tuple(x.shape)
            assert cost.output_bytes == x.numel() * 4
    assert costs[-1].output_shape == (5, 10)


def test_small_cnn_flops_match_hand_count(models):
    costs = block_costs(models["small_cnn"], batch_size=1)

    assert costs[0].forward_flops == 2 * (3 * 9) * 16 * 32 * 32
    assert costs[-1].forward_flops == 2 * 64 * 10


def test_block_costs_leave_batchnorm_buffers_and_mode_alone():
    # Prepare
    model = build_model("resnet18", seed=0).train()
    before = {key: value.clone() for key, value in model.state_dict().items()}

    # Execute
    block_costs(model, batch_size=16)

    # Assert
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert all(module.training for module in model.modules())


def test_block_costs_restore_eval_mode(models):
    model = models["small_cnn"].eval()

    block_costs(model, batch_size=2)

    assert not any(module.training for module in model.modules())


def test_block_cost_validation():
    with pytest.raises(ValueError, match="params"):
        BlockCost(
            name="x", params=-1, param_bytes=0, forward_flops=0, output_shape=(1,), output_bytes=4
        )


def _torchvision_blocks(name: str, num_classes: int) -> list[tuple[str, nn.Module]]:
    """The blocks as torchvision builds these networks (with the CIFAR stems)."""
    from torchvision import models as tv

    if name == "resnet18":
        net = tv.resnet18(num_classes=num_classes)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        blocks = [("stem", nn.Sequential(net.conv1, net.bn1, net.relu))]
        for layer in ("layer1", "layer2", "layer3", "layer4"):
            blocks += [(f"{layer}.{i}", b) for i, b in enumerate(getattr(net, layer))]
        return blocks + [("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.fc))]
    net = tv.mobilenet_v2(num_classes=num_classes)
    net.features[0][0].stride = (1, 1)
    return [(f"features.{i}", f) for i, f in enumerate(net.features)] + [
        ("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.classifier))]


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_the_networks_are_torchvisions_without_needing_it(name):
    # Prepare: our network with random weights and running statistics, and torchvision's
    pytest.importorskip("torchvision")
    from edgetrain.models import BlockModel

    ours = build_model(name, num_classes=7, seed=3)
    theirs = BlockModel(_torchvision_blocks(name, 7), image_format=ours.image_format)
    with torch.no_grad():
        for buffer in ours.buffers():
            if buffer.is_floating_point():
                buffer.uniform_(0.5, 1.5)

    # Execute: the same state in both
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=True)

    # Assert: the same names, shapes and arithmetic, in training and in evaluation
    assert not missing and not unexpected
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    x = torch.randn(4, 3, 32, 32)
    for train in (False, True):
        ours.train(train)
        theirs.train(train)
        torch.manual_seed(0)
        a = ours(x)
        torch.manual_seed(0)
        b = theirs(x)
        assert torch.allclose(a, b, atol=1e-5), (train, (a - b).abs().max())


def test_a_board_builds_every_model_without_torchvision():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torchvision'] = None\n"  # importing it now fails
            "from edgetrain.models import build_model\n"
            "for name in ('resnet18', 'mobilenet_v2', 'small_cnn'): build_model(name, seed=0)\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
