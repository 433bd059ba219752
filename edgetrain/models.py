"""CIFAR-10 models as ordered lists of named blocks, with the cost of each block.

A block is the unit a pipeline partition cuts at: a stage that owns blocks ``[start, stop)`` runs
``model.run_blocks(x, start, stop)``, and the planner prices a cut from ``block_costs``. The
ResNet-18 and MobileNetV2 blocks (CIFAR stems) are defined in ``edgetrain.cifar_nets`` as
torchvision defines them, so a board needs no torchvision; ``small_cnn`` has no BatchNorm or
dropout, so a pipeline or data-parallel run can be compared exactly with single-process training.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.catalog import MODEL_NAMES
from edgetrain.cifar_nets import NamedBlocks, mobilenet_v2_blocks, resnet18_blocks

logger = logging.getLogger(__name__)

_FLOAT32_BYTES = 4
_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

class BlockModel(nn.Module):
    """A network held as an ordered list of named blocks, so it can be cut between any two.

    Blocks are stored in ``self.blocks`` (an ordered ``nn.ModuleDict``) under their name with
    ``.`` replaced by ``_`` (module names cannot contain dots): block ``layer1.0`` owns parameters
    ``blocks.layer1_0.*``. Parameter names therefore depend only on the architecture and are the
    same in every process, which is what lets processes exchange state by name.
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], *,
                 image_format: torch.memory_format = torch.contiguous_format) -> None:
        super().__init__()
        if not blocks:
            raise ValueError("a BlockModel needs at least one block")
        names = [name for name, _ in blocks]
        keys = [name.replace(".", "_") for name in names]
        if len(set(keys)) != len(keys):
            raise ValueError(f"block names must be unique (after '.' -> '_'), got {names}")
        self._block_names = names
        self.blocks = nn.ModuleDict(zip(keys, (module for _, module in blocks), strict=True))
        self._layout_hooks: list = []
        self.image_format = image_format

    @property
    def image_format(self) -> torch.memory_format:
        """Memory layout a 4-D input is put in before each block runs (see `IMAGE_FORMATS`): a hook
        on every block, so a pipeline stage or a channel group running blocks on their own gets it too."""
        return self._image_format

    @image_format.setter
    def image_format(self, memory_format: torch.memory_format) -> None:
        for handle in self._layout_hooks:
            handle.remove()
        self._image_format = memory_format
        self._layout_hooks = [] if memory_format == torch.contiguous_format else [
            block.register_forward_pre_hook(functools.partial(_lay_out, memory_format))
            for block in self.blocks.values()]

    @property
    def block_names(self) -> list[str]:
        """The block names in execution order (e.g. ``stem``, ``layer1.0``, ..., ``head``)."""
        return list(self._block_names)

    def block_modules(self, start: int = 0, stop: int | None = None) -> list[nn.Module]:
        """The modules of blocks ``[start, stop)``: what a pipeline stage owns and optimises."""
        count = len(self._block_names)
        stop = count if stop is None else stop
        if not 0 <= start <= stop <= count:
            raise IndexError(f"need 0 <= start <= stop <= {count}, got start={start} stop={stop}")
        return list(self.blocks.values())[start:stop]

    def run_blocks(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Run blocks ``[start, stop)`` on ``x``: the forward pass of one pipeline stage."""
        for block in self.block_modules(start, stop):
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block in order."""
        return self.run_blocks(x, 0, len(self._block_names))


def _lay_out(memory_format: torch.memory_format, _block: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: a block's 4-D input in `memory_format` (no copy when it already is)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        return (args[0].contiguous(memory_format=memory_format), *args[1:])
    return None


def _small_cnn_blocks(num_classes: int) -> NamedBlocks:
    """A three-conv network without BatchNorm or dropout: fast on CPU and exactly reproducible.

    Convolutions get He initialisation (as torchvision's ResNets do); without BatchNorm, the
    PyTorch default shrinks activations layer by layer and SGD starts noticeably slower.
    """
    blocks: NamedBlocks = [
        ("conv1", nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))),
        ("conv2", nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))),
        (
            "conv3",
            nn.Sequential(
                nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
            ),
        ),
        ("head", nn.Linear(64, num_classes)),
    ]
    for _, block in blocks:
        for module in block.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
    return blocks


_BUILDERS: dict[str, Callable[[int], NamedBlocks]] = {
    "resnet18": resnet18_blocks,
    "mobilenet_v2": mobilenet_v2_blocks,
    "small_cnn": _small_cnn_blocks,
}

IMAGE_FORMATS: dict[str, torch.memory_format] = {"mobilenet_v2": torch.channels_last}
"""Models whose images (and so every activation after them) are laid out channels-last: on a CPU
that sends MobileNetV2's depthwise and 1x1 convolutions to oneDNN's kernels, which makes it train
much faster on one x86 core; ResNet-18's convolutions are oneDNN's in either layout, so it keeps
the default (scripts/bench_memory_format.py; docs/benchmarks.md#memory_format). The parameters keep their layout (MobileNetV2's 1x1 and depthwise weights are
the same bytes either way), so nothing on the wire changes; the arithmetic is the same up to float
rounding."""


def build_model(name: str, num_classes: int = 10, seed: int | None = None) -> BlockModel:
    """Build model ``name`` as a ``BlockModel``.

    With ``seed``, initialisation is a pure function of the seed, so every process that builds
    the model starts from the same weights; the global RNG state is left as it was.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    image_format = IMAGE_FORMATS.get(name, torch.contiguous_format)
    if seed is None:
        return BlockModel(_BUILDERS[name](num_classes), image_format=image_format)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BlockModel(_BUILDERS[name](num_classes), image_format=image_format)


@dataclass(kw_only=True, frozen=True)
class BlockCost:
    """What one block costs for a given batch: the planner's input for pricing a cut."""

    name: str
    """The block's name, as in ``BlockModel.block_names``."""
    params: int
    """Number of parameter elements the block owns."""
    param_bytes: int
    """Bytes of those parameters (what moving the block's weights costs)."""
    forward_flops: int
    """Forward-pass FLOPs for the whole batch, as counted by torch's FlopCounterMode."""
    output_shape: tuple[int, ...]
    """Shape of the block's output, batch dimension first."""
    output_bytes: int
    """Bytes of that output as float32: what a cut after this block sends per micro-batch."""
    channel_layers: int = 0
    """Layers a channel group splits (``edgetrain.channels.splittable``)."""
    channel_flops: int = 0
    """Forward FLOPs of those layers for the whole batch (a channel group divides them)."""
    channel_param_bytes: int = 0
    """Bytes of their parameters (a channel group member moves only its share of them)."""
    channel_output_bytes: int = 0
    """Bytes of their outputs for the whole batch (what a channel group gathers, forward)."""
    channel_input_bytes: int = 0
    """Bytes of their inputs for the whole batch (what a channel group sums, backward)."""

    def __post_init__(self) -> None:
        for field in ("params", "param_bytes", "forward_flops", "output_bytes", "channel_layers", "channel_flops",
                      "channel_param_bytes", "channel_output_bytes", "channel_input_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        if not self.output_shape or min(self.output_shape) < 1:
            raise ValueError(f"output_shape must be non-empty and positive: {self.output_shape}")


def count_params(model: nn.Module) -> int:
    """Number of parameter elements in ``model``."""
    return sum(p.numel() for p in model.parameters())


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm, whose batch statistics make sharded training inexact."""
    return any(isinstance(module, _BATCHNORM_TYPES) for module in model.modules())


def block_costs(
    model: BlockModel, batch_size: int, input_shape: tuple[int, ...] = (3, 32, 32)
) -> list[BlockCost]:
    """Parameters, FLOPs and output size of each block for a batch of ``batch_size``.

    Measures one sample in eval mode under ``no_grad`` (so BatchNorm running statistics are not
    touched) and scales FLOPs and activation bytes linearly with the batch. Every module's
    train/eval flag is restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return _measure_blocks(model, batch_size, torch.zeros(1, *input_shape))
    finally:
        for module, training in modes:
            module.training = training


def _measure_blocks(model: BlockModel, batch_size: int, x: torch.Tensor) -> list[BlockCost]:
    """Run ``x`` (one sample) through the blocks, recording each block's cost."""
    from edgetrain.channels import splittable

    costs = []
    for name, block in zip(model.block_names, model.block_modules(), strict=True):
        split = {"layers": 0, "flops": 0, "params": 0, "out": 0, "in": 0}

        def hook(module: nn.Module, args: tuple, out: torch.Tensor, split: dict = split) -> None:
            fan_in = module.weight[0].numel()  # FLOPs: a multiply and an add per weight per output
            split["layers"] += 1
            split["flops"] += 2 * fan_in * out.numel()
            split["params"] += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            split["out"] += out.numel() * _FLOAT32_BYTES
            split["in"] += args[0].numel() * _FLOAT32_BYTES

        handles = [m.register_forward_hook(hook) for m in block.modules() if splittable(m)]
        try:
            with FlopCounterMode(display=False) as counter:
                x = block(x)
        finally:
            for handle in handles:
                handle.remove()
        costs.append(
            BlockCost(
                name=name,
                params=count_params(block),
                param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
                forward_flops=counter.get_total_flops() * batch_size,
                output_shape=(batch_size, *x.shape[1:]),
                output_bytes=x.numel() * batch_size * _FLOAT32_BYTES,
                channel_layers=split["layers"],
                channel_flops=split["flops"] * batch_size,
                channel_param_bytes=split["params"],
                channel_output_bytes=split["out"] * batch_size,
                channel_input_bytes=split["in"] * batch_size,
            )
        )
    return costs
