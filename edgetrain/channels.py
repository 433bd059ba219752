"""Channel-parallel stages: a group of boards splits each layer's output channels among them.

In a **channel group** every member holds the stage's blocks and runs every row of every
micro-batch, but computes only its slice of the output channels of each *split layer*: every
``nn.Conv2d`` with ``groups == 1`` and every ``nn.Linear`` (``splittable``), the layers that
carry almost all of a CNN's FLOPs and parameters. Member k's slice of a layer with C output
channels is ``[round(lo_k C), round(hi_k C))``, the shares ``(lo_k, hi_k)`` tiling [0, 1) in
proportion to the members' speed (``edgetrain.pipeline.channel_shares``, ``channel_bounds``).
Around each split layer:

- forward: the members exchange their output slices (an all-gather), so each holds the full
  output and runs the layers that are not split (BatchNorm, activations, depthwise convolutions,
  pooling, residual additions) on it, identically;
- backward: the gradient of the gathered output is the same on every member (what follows is
  identical everywhere), so each takes its own slice without communicating; the gradient of the
  layer's input is a partial sum over the members' channels, which the members add up (an
  all-reduce) before it flows further back.

Each member's gradient of a split layer's weight is exact for its slice and zero outside it, so
the sum of the members' gradients is the layer's gradient; layers that are not split get the
same gradient on every member (the group's leader, the member whose share starts at 0, reports
them). With BatchNorm the batch statistics are those of the whole micro-batch — a channel group
is exact where a sample-split group is not.

``ChannelSplit`` installs this on a stage's modules; an ``Exchange`` moves the tensors (a board
uses its StagePeer endpoint, edge_client.stage). Plain torch: no sockets or clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from edgetrain.pipeline import channel_bounds


def splittable(module: nn.Module) -> bool:
    """Whether a channel group splits this layer's output channels among its members: plain
    ``Conv2d`` (groups 1) and ``Linear`` layers only (a subclass may be used through its weight
    without calling its forward, e.g. attention's output projection)."""
    return (type(module) is nn.Conv2d and module.groups == 1) or type(module) is nn.Linear


def split_parameters(model: nn.Module) -> dict[str, int]:
    """Names of the parameters a channel group splits (weights and biases of split layers), each
    with its output channels (its first dimension): a member holds, downloads and uploads rows
    ``channel_bounds(C, share)`` of them."""
    out = {}
    for prefix, module in model.named_modules():
        if splittable(module):
            for name, p in module.named_parameters(recurse=False):
                out[f"{prefix}.{name}" if prefix else name] = p.shape[0]
    return out


def member_slices(split: dict[str, int], share: tuple[float, float]) -> dict[str, tuple[int, int]]:
    """A member's rows [begin, end) of each split parameter (``split_parameters``)."""
    return {name: channel_bounds(channels, share) for name, channels in split.items()}


class Exchange(Protocol):
    """How the members of a channel group move tensors for one micro-batch.

    ``tag`` numbers the split-layer calls of the micro-batch in order (1, 2, ...): every member
    calls the same layers in the same order, so equal tags meet."""

    def gather(self, microbatch: int, tag: int, local: torch.Tensor, bounds: Sequence[tuple[int, int]],
               dim: int) -> torch.Tensor:
        """Every member's output slice, concatenated along ``dim`` in channel order (``bounds``:
        each member's channels; ``local`` is this member's)."""

    def all_reduce(self, microbatch: int, tag: int, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every member's ``partial`` (a gradient of the layer's input)."""


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, exchange, microbatch, tag, bounds, me, dim):  # type: ignore[override]
        ctx.slice, ctx.dim = bounds[me], dim
        return exchange.gather(microbatch, tag, local.detach(), bounds, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        lo, hi = ctx.slice
        return grad.narrow(ctx.dim, lo, hi - lo), None, None, None, None, None, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exchange, microbatch, tag):  # type: ignore[override]
        ctx.exchange, ctx.microbatch, ctx.tag = exchange, microbatch, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.exchange.all_reduce(ctx.microbatch, ctx.tag, grad.contiguous()), None, None, None


class ChannelSplit:
    """This member's part of a channel group over ``modules`` (a stage's blocks), while installed.

    ``share`` is the member's fraction of each split layer's output channels, ``shares`` every
    member's (the member is ``shares.index(share)``). Set ``microbatch`` before each forward:
    split-layer calls are numbered per micro-batch. Use as a context manager: on exit the
    layers compute their whole output again."""

    def __init__(self, modules: Iterable[nn.Module], shares: Sequence[tuple[float, float]],
                 share: tuple[float, float], exchange: Exchange) -> None:
        self.layers = [m for block in modules for m in block.modules() if splittable(m)]
        self.shares = list(shares)
        self.me = self.shares.index(tuple(share))
        self.exchange = exchange
        self.microbatch = 0
        self._calls: dict[int, int] = {}

    @property
    def leader(self) -> bool:
        """Whether this member reports what every member computed alike (its share starts at 0)."""
        return self.me == 0

    def __enter__(self) -> ChannelSplit:
        for layer in self.layers:
            layer.forward = self._forward_of(layer)  # an instance attribute: the class's forward stays
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)

    def replicated_parameters(self, modules: Iterable[nn.Module]) -> list[nn.Parameter]:
        """Parameters of ``modules`` every member computes in full (those of layers not split)."""
        split = {id(p) for layer in self.layers for p in layer.parameters(recurse=False)}
        return [p for block in modules for p in block.parameters() if id(p) not in split]

    def _next_tag(self) -> int:
        self._calls[self.microbatch] = self._calls.get(self.microbatch, 0) + 1
        return self._calls[self.microbatch]

    def _forward_of(self, layer: nn.Module):
        out_channels = layer.out_channels if isinstance(layer, nn.Conv2d) else layer.out_features
        bounds = [channel_bounds(out_channels, s) for s in self.shares]
        lo, hi = bounds[self.me]
        conv = isinstance(layer, nn.Conv2d)

        def forward(x: torch.Tensor) -> torch.Tensor:
            m, tag = self.microbatch, self._next_tag()
            if x.requires_grad:
                x = _ReduceGrad.apply(x, self.exchange, m, tag)
            weight = layer.weight[lo:hi]
            bias = layer.bias[lo:hi] if layer.bias is not None else None
            local = layer._conv_forward(x, weight, bias) if conv else F.linear(x, weight, bias)
            return _Gather.apply(local, self.exchange, m, tag, bounds, self.me, 1 if conv else -1)

        return forward
