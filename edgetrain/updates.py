"""What travels for one training step, in both directions, when links are compressed.

Up: a board's update is its gradients (``grad.*``, or a federated round's parameter change)
through the step's codec, followed by its float buffers dense (BatchNorm running statistics must
arrive exactly: a top-k of a running mean is meaningless). `UpdateFormat` gives the exact wire
layout for a codec, so the coordinator validates a header before a byte of payload arrives.

Down: with a lossy downlink the coordinator serves a *view* of the parameters that boards can
rebuild exactly: view_v = view_{v-1} + decode(encode(master_v - view_{v-1})). The residual
master - view is carried into the next delta (error feedback on the coordinator's side), and a
board that holds view_b downloads only the encoded deltas b+1..v (`DeltaFormat`). Sender and
receiver run the same float32 decode and add in the same order, so their views are bit-identical.
Integer buffers (``num_batches_tracked``) travel as their new value.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch

from edgetrain.compression import Codec, CodecSpec, ErrorFeedback, encode_with_feedback, parse_codec
from edgetrain.streaming import TensorMeta
from edgetrain.tensors import bundle_metas
from edgetrain.training import GRAD_PREFIX

FORMATS_KEPT = 32
"""Update formats `UpdateFormats` keeps (codecs x stages x channel shares): the least recently
used go (a PowerSGD format's warm start with it)."""


def _layout(metas: Sequence[TensorMeta], prefix: str = "") -> dict[str, torch.Tensor]:
    """Empty tensors shaped like `metas` (for computing combined layouts)."""
    from edgetrain.tensors import DTYPES

    return {prefix + m.name: torch.empty(m.shape, dtype=DTYPES[m.dtype]) for m in metas}


class UpdateFormat:
    """One board's update on the wire: gradients through a codec, last layer first (the order
    backward produces them: an uncompressed update streams while backward runs, see
    edge_client.streamed), then float buffers dense float32."""

    def __init__(self, templates: Sequence[tuple[str, torch.Tensor]], spec: CodecSpec | str,
                 slices: Mapping[str, tuple[int, int]] | None = None) -> None:
        spec = parse_codec(spec) if isinstance(spec, str) else spec
        self._member = slices is not None
        """A channel group member's format: it sends the tensors of its templates only."""
        self._slices = {n: b for n, b in (slices or {}).items() if any(n == m for m, _ in templates)}
        """Gradients of which only rows [begin, end) travel (a channel group member's slices)."""
        self._full = {n: tuple(t.shape) for n, t in templates if n in self._slices}
        templates = [(n, t[slice(*self._slices[n])] if n in self._slices else t) for n, t in templates]
        grads = {n: t for n, t in reversed(templates) if n.startswith(GRAD_PREFIX)}
        self._grad_names = frozenset(grads)
        self._buffers = [(n, t) for n, t in templates if not n.startswith(GRAD_PREFIX)]
        self._buffer_names = frozenset(n for n, _ in self._buffers)
        self.codec = Codec(spec, grads)
        layout = _layout(self.codec.wire_metas())
        layout.update({n: torch.empty(t.shape, dtype=torch.float32) for n, t in self._buffers})
        self._metas = bundle_metas(layout)

    @property
    def spec(self) -> CodecSpec:
        """The gradient codec."""
        return self.codec.spec

    def metas(self) -> list[TensorMeta]:
        """The exact wire layout of an update in this format."""
        return list(self._metas)

    def wire_bytes(self) -> int:
        """Payload bytes of one update."""
        return sum(m.nbytes for m in self._metas)

    def encode(self, tensors: Mapping[str, torch.Tensor],
               feedback: ErrorFeedback | None) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        """Wire tensors for `tensors` (gradients and buffers) and the error-feedback commit."""
        grads = {n: t for n, t in tensors.items() if n.startswith(GRAD_PREFIX)}
        if self._member:  # a channel group member: its slices, and the rest only if the format has it
            grads = {n: t[slice(*self._slices[n])] if n in self._slices else t for n, t in grads.items()
                     if n in self._grad_names}
        encoded, commit = encode_with_feedback(self.codec, feedback, grads)
        wire = dict(encoded)  # the commit decodes `encoded`: buffers must not join it
        for name, _ in self._buffers:
            wire[name] = tensors[name]
        return wire, commit

    def decode(self, wire: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Dense gradients and buffers from wire tensors (ValueError on a malformed update)."""
        out = self.codec.decode({n: t for n, t in wire.items() if not self._is_buffer(n)})
        for name, (begin, end) in self._slices.items():  # a member's slice in a layer-sized gradient
            whole = torch.zeros(self._full[name], dtype=out[name].dtype)
            whole[begin:end] = out[name]
            out[name] = whole
        for name, _ in self._buffers:
            out[name] = wire[name]
        return out

    def _is_buffer(self, name: str) -> bool:
        return name in self._buffer_names


class UpdateFormats:
    """`UpdateFormat`s of one model, built once per codec (and per pipeline stage, and channel
    group member)."""

    def __init__(self, templates: Sequence[tuple[str, torch.Tensor]], split: Mapping[str, int] | None = None) -> None:
        self._templates = list(templates)
        self._split = dict(split or {})
        """Parameters a channel group splits, with their output channels (edgetrain.channels)."""
        self._formats: OrderedDict[tuple, UpdateFormat] = OrderedDict()

    def __call__(self, codec: str, prefixes: tuple[str, ...] | None = None,
                 member: tuple[tuple[float, float], bool] | None = None) -> UpdateFormat:
        """The format for `codec`; with `prefixes` (a stage's ``blocks.<key>.``), only those tensors;
        for a channel group `member` ((its share of the channels, whether it leads the group)),
        only its rows of the split parameters' gradients, and, unless it leads, nothing else."""
        key = (str(parse_codec(codec or "none")), prefixes, member)
        if key not in self._formats:
            templates = self._templates if prefixes is None else [
                (n, t) for n, t in self._templates if n.split(".", 1)[1].startswith(prefixes)]
            slices = None
            if member is not None:
                from edgetrain.pipeline import channel_bounds

                share, leader = member
                slices = {GRAD_PREFIX + n: channel_bounds(c, share) for n, c in self._split.items()}
                templates = [(n, t) for n, t in templates if leader or n in slices]
            self._formats[key] = UpdateFormat(templates, key[0], slices)
            while len(self._formats) > FORMATS_KEPT:
                self._formats.popitem(last=False)
        self._formats.move_to_end(key)
        return self._formats[key]


class DeltaFormat:
    """Parameter deltas on the wire: float state through a codec, integer state as new values."""

    def __init__(self, state: Mapping[str, torch.Tensor], spec: CodecSpec | str) -> None:
        spec = parse_codec(spec) if isinstance(spec, str) else spec
        self._floats = {n: t for n, t in state.items() if t.is_floating_point()}
        self._ints = {n: t for n, t in state.items() if not t.is_floating_point()}
        self.codec = Codec(spec, self._floats)
        one = _layout(self.codec.wire_metas())
        one.update({n: torch.empty(t.shape, dtype=t.dtype) for n, t in self._ints.items()})
        self._one = one

    def encode(self, master: Mapping[str, torch.Tensor], view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Wire tensors moving `view` toward `master`; `view` is advanced in place to what a board rebuilds."""
        wire = self.codec.encode({n: master[n] - view[n] for n in self._floats})
        self._apply_floats(view, wire)
        for name in self._ints:
            wire[name] = master[name].clone()
            view[name].copy_(master[name])
        return wire

    def apply(self, view: dict[str, torch.Tensor], wire: Mapping[str, torch.Tensor]) -> None:
        """Advance a board's `view` by one delta (ValueError on a malformed delta)."""
        self._apply_floats(view, {n: t for n, t in wire.items() if n not in self._ints})
        for name in self._ints:
            view[name].copy_(wire[name])

    def _apply_floats(self, view: dict[str, torch.Tensor], wire: Mapping[str, torch.Tensor]) -> None:
        for name, delta in self.codec.decode(wire).items():
            view[name].add_(delta)

    def chain_metas(self, base: int, version: int) -> list[TensorMeta]:
        """Wire layout of the deltas base+1 .. version, each tensor named ``v<u>/<name>``."""
        layout: dict[str, torch.Tensor] = {}
        for u in range(base + 1, version + 1):
            layout.update({f"v{u}/{n}": t for n, t in self._one.items()})
        return bundle_metas(layout)

    def apply_chain(self, view: dict[str, torch.Tensor], base: int, version: int,
                    tensors: Mapping[str, torch.Tensor]) -> None:
        """Advance `view` from `base` to `version` by the chained deltas in `tensors`."""
        for u in range(base + 1, version + 1):
            prefix = f"v{u}/"
            self.apply(view, {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})
