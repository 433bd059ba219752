"""Gradient / delta codecs for the wire, with error feedback.

A `Codec` turns a fixed, ordered set of named float32 tensors (its *templates*) into wire tensors
and back. The wire layout (names, dtypes, shapes) depends only on the codec spec and the
templates, never on the values, so a receiver validates a header against `Codec.wire_metas()`
before reading a byte. Tensors with fewer than `MIN_COMPRESSED_NUMEL` elements (biases, norm
weights) always travel as dense float32 ``<name>``: they cost little and compress badly.

The spec that picks a codec (`CodecSpec`, read by `parse_codec`) is in ``edgetrain.catalog``, which
needs no torch, so a job file is checked without it.

Codecs and wire names, for a tensor ``<name>`` with at least `MIN_COMPRESSED_NUMEL` elements:

- ``none``: ``<name>`` float32, unchanged. Lossless.
- ``fp16`` / ``bf16``: ``<name>`` float16 / bfloat16, rounded to nearest (finite values beyond
  fp16's ±65504 saturate rather than become inf). Half the bytes.
- ``int8``: ``<name>:q`` int8 and ``<name>:scale`` float32 of shape (1,); symmetric per-tensor
  quantisation, ``scale = max|x| / 127``, ``q = round(x / scale)``, decoded as ``q * scale``.
  A quarter of the bytes; the error of each element is at most ``scale / 2``.
- ``topk:<ratio>``: ``<name>:idx`` int32 and ``<name>:val`` float32, both of shape (k,) with
  ``k = max(1, ceil(ratio * numel))``: the k entries of largest magnitude of the flattened tensor
  and their flat indices; every other entry decodes to zero. ``2 * ratio`` of the bytes.
- ``powersgd:<rank>`` (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression"):
  a tensor of shape (n, ...) is read as an n × m matrix M (m: the product of the other
  dimensions) and sent as ``<name>:p`` float32 (n, r) and ``<name>:q`` float32 (m, r), decoded as
  ``p @ q.T``: one power-iteration step, ``P = orth(M Q)``, ``Q = Mᵀ P``, from the Q of the
  encoder's previous message for that tensor (warm start; the first from a fixed random draw).
  ``r (n + m) / (n m)`` of the bytes. A tensor with one dimension, or whose factors would not be
  smaller than it (r (n + m) >= n m, e.g. a 2048 × 3 weight), travels dense float32. The encoder's warm start is its only state; decoding needs none.

Decoding is a pure function of the wire tensors, so the sender (which needs what the receiver
will see, for error feedback) and the receiver get bit-identical results.

Error feedback (Seide et al. 2014; Lin et al. 2018, "Deep Gradient Compression"; Karimireddy et
al. 2019, "Error Feedback Fixes SignSGD") keeps what a lossy codec dropped and adds it to the next
message, so nothing is lost, only delayed. With residual ``e`` and new gradient ``g``:
``p = e + g; Δ = C(p); e = p − Δ``, where ``C`` is the codec round trip (e.g. top-k) and ``Δ`` is
what is sent. `ErrorFeedback` holds ``e``; `encode_with_feedback` does one such step and hands
back the commit of ``e`` separately, to run only once the transfer succeeded.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from edgetrain.catalog import CodecSpec, parse_codec
from edgetrain.streaming import TensorMeta
from edgetrain.tensors import bundle_metas

MIN_COMPRESSED_NUMEL = 2048
"""Float tensors with fewer elements travel dense float32 under every codec."""

_FP16_MAX = float(torch.finfo(torch.float16).max)
_INT8_LEVELS = 127
# Top-k by sampled threshold pays off from about 16k elements, and only while k is a small fraction.
_TOPK_SAMPLED_MIN_NUMEL = 1 << 14
_TOPK_SAMPLED_MAX_FRACTION = 4
_TOPK_SAMPLE_STRIDE = 32


@dataclass(frozen=True)
class _Slot:
    """How one template tensor travels: its shape and the wire tensors (name, dtype, shape)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    """``dense`` (float32 as is) or the codec name that compresses it."""
    wire: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    k: int = 0
    """Top-k: elements kept; PowerSGD: the rank."""


def _topk_count(ratio: float, numel: int) -> int:
    """Elements top-k keeps of a tensor with `numel` elements."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def _plan_slot(spec: CodecSpec, name: str, shape: tuple[int, ...]) -> _Slot:
    """The wire layout of one template tensor under `spec`."""
    numel = math.prod(shape)
    if spec.name == "none" or numel < MIN_COMPRESSED_NUMEL:
        return _Slot(name, shape, "dense", ((name, torch.float32, shape),))
    if spec.name in ("fp16", "bf16"):
        dtype = torch.float16 if spec.name == "fp16" else torch.bfloat16
        return _Slot(name, shape, spec.name, ((name, dtype, shape),))
    if spec.name == "int8":
        return _Slot(name, shape, "int8", ((f"{name}:q", torch.int8, shape),
                                           (f"{name}:scale", torch.float32, (1,))))
    if spec.name == "powersgd":
        n, m = (shape[0], numel // shape[0]) if len(shape) >= 2 else (numel, 1)
        r = min(spec.rank, n, m)
        if len(shape) < 2 or r * (n + m) >= numel:
            return _Slot(name, shape, "dense", ((name, torch.float32, shape),))
        return _Slot(name, shape, "powersgd", ((f"{name}:p", torch.float32, (n, r)),
                                               (f"{name}:q", torch.float32, (m, r))), r)
    k = _topk_count(spec.ratio, numel)
    return _Slot(name, shape, "topk", ((f"{name}:idx", torch.int32, (k,)),
                                       (f"{name}:val", torch.float32, (k,))), k)


def _encode_fp16(x: torch.Tensor) -> torch.Tensor:
    """`x` as float16, saturating finite values beyond ±65504 (inf and NaN stay what they are)."""
    low, high = torch.aminmax(x)
    if bool(low < -_FP16_MAX) or bool(high > _FP16_MAX):
        x = torch.where(torch.isinf(x), x, x.clamp(-_FP16_MAX, _FP16_MAX))
    return x.to(torch.float16)


def _encode_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-tensor int8: (q, scale). Non-finite input gives a NaN scale (decodes to NaN)."""
    absmax = x.abs().max().reshape(1)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), absmax / _INT8_LEVELS)
    q = torch.div(x, scale).round_().clamp_(-_INT8_LEVELS, _INT8_LEVELS).to(torch.int8)
    return q, scale


def _topk_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the flat `magnitude`, exactly as `torch.topk` picks them.

    On large tensors a full top-k dominates the encode time, so a strided sample first sets a
    threshold that about 2k entries pass (the DGC trick), and the exact top-k runs on those
    candidates only; when fewer than k pass, it falls back to the full top-k.
    """
    numel = magnitude.numel()
    if numel < _TOPK_SAMPLED_MIN_NUMEL or k * _TOPK_SAMPLED_MAX_FRACTION > numel:
        return torch.topk(magnitude, k, sorted=False).indices
    sample = magnitude[::_TOPK_SAMPLE_STRIDE]
    sample_k = min(sample.numel(), 2 * math.ceil(k * sample.numel() / numel) + 8)
    threshold = torch.topk(sample, sample_k, sorted=False).values.min()
    # Not `>=`: NaN must stay a candidate, since torch.topk ranks it above everything.
    candidates = (~(magnitude < threshold)).nonzero().squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


def _encode_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices (int32) and values of the k entries of `x` with the largest magnitude."""
    flat = x.reshape(-1)
    idx = _topk_indices(flat.abs(), k)
    return idx.to(torch.int32), flat[idx]


class Codec:
    """Encodes a fixed set of named float32 tensors (given by templates) into wire tensors and back."""

    def __init__(self, spec: CodecSpec, templates: Mapping[str, torch.Tensor]) -> None:
        self.spec = spec
        """The codec and its parameters."""
        for name, tensor in templates.items():
            if not tensor.is_floating_point():
                raise ValueError(f"template {name!r} has dtype {tensor.dtype}; codecs encode float tensors")
        self._slots = [_plan_slot(spec, name, tuple(t.shape)) for name, t in templates.items()]
        example = {wname: torch.empty(wshape, dtype=dtype, device="meta")
                   for slot in self._slots for wname, dtype, wshape in slot.wire}
        if len(example) != sum(len(slot.wire) for slot in self._slots):
            raise ValueError(f"template names collide with the {spec} wire names (a name ending in ':q'?)")
        self._metas = bundle_metas(example)
        self._warm: dict[str, torch.Tensor] = {}
        """PowerSGD: each tensor's last Q (the encoder's warm start)."""

    def wire_metas(self) -> list[TensorMeta]:
        """The header of every encoded bundle: names, dtypes, shapes and byte ranges, in order."""
        return list(self._metas)

    def wire_bytes(self) -> int:
        """Payload bytes of one encoded bundle."""
        return sum(meta.nbytes for meta in self._metas)

    def dense_bytes(self) -> int:
        """Payload bytes of the templates as dense float32 (what ``none`` sends)."""
        return sum(4 * math.prod(slot.shape) for slot in self._slots)

    def encode(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Wire tensors for `tensors` (exactly the template names and shapes), laid out as `wire_metas`.

        Dense float32 entries may share memory with the inputs.
        """
        self._check_inputs(tensors)
        wire: dict[str, torch.Tensor] = {}
        for slot in self._slots:
            x = tensors[slot.name].detach().to(torch.float32)
            if slot.kind == "dense":
                wire[slot.name] = x
            elif slot.kind == "fp16":
                wire[slot.name] = _encode_fp16(x)
            elif slot.kind == "bf16":
                wire[slot.name] = x.to(torch.bfloat16)
            elif slot.kind == "int8":
                wire[f"{slot.name}:q"], wire[f"{slot.name}:scale"] = _encode_int8(x)
            elif slot.kind == "powersgd":
                wire[f"{slot.name}:p"], wire[f"{slot.name}:q"] = self._encode_powersgd(slot, x)
            else:
                wire[f"{slot.name}:idx"], wire[f"{slot.name}:val"] = _encode_topk(x, slot.k)
        return wire

    def decode(self, wire: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Dense float32 tensors with the template names and shapes, in template order.

        A pure function of `wire`; dense entries may share memory with it. Raises ValueError
        naming the tensor when the wire bundle does not match `wire_metas` or a top-k index is
        out of range.
        """
        self._check_wire(wire)
        out: dict[str, torch.Tensor] = {}
        for slot in self._slots:
            if slot.kind == "dense":
                out[slot.name] = wire[slot.name]
            elif slot.kind in ("fp16", "bf16"):
                out[slot.name] = wire[slot.name].to(torch.float32)
            elif slot.kind == "int8":
                q, scale = wire[f"{slot.name}:q"], wire[f"{slot.name}:scale"]
                out[slot.name] = q.to(torch.float32).mul_(scale)
            elif slot.kind == "powersgd":
                out[slot.name] = (wire[f"{slot.name}:p"] @ wire[f"{slot.name}:q"].T).reshape(slot.shape)
            else:
                out[slot.name] = self._decode_topk(slot, wire[f"{slot.name}:idx"], wire[f"{slot.name}:val"])
        return out

    def _encode_powersgd(self, slot: _Slot, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One warm-started power-iteration step: (P, Q) with orthonormal P and P Qᵀ ≈ x."""
        matrix = x.reshape(slot.shape[0], -1)
        q = self._warm.get(slot.name)
        if q is None or not bool(torch.isfinite(q).all()) or not bool(q.any()):
            generator = torch.Generator().manual_seed(zlib.crc32(slot.name.encode()))
            q = torch.randn(matrix.shape[1], slot.k, generator=generator)
        p = torch.linalg.qr(matrix @ q).Q  # reduced: n × r with orthonormal columns
        q = matrix.T @ p
        self._warm[slot.name] = q
        return p.contiguous(), q.contiguous()

    def _decode_topk(self, slot: _Slot, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        numel = math.prod(slot.shape)
        low, high = torch.aminmax(idx)
        if int(low) < 0 or int(high) >= numel:
            raise ValueError(
                f"tensor {slot.name + ':idx'!r} has indices in [{int(low)}, {int(high)}], "
                f"outside [0, {numel - 1}]")
        # index_add_ rather than a scatter: deterministic even if a peer repeats an index.
        dense = torch.zeros(numel, dtype=torch.float32)
        return dense.index_add_(0, idx.to(torch.int64), val).reshape(slot.shape)

    def _check_inputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError unless `tensors` has exactly the template names and shapes."""
        extra = set(tensors) - {slot.name for slot in self._slots}
        if extra:
            raise ValueError(f"tensors not in the codec templates: {sorted(extra)}")
        for slot in self._slots:
            if slot.name not in tensors:
                raise ValueError(f"tensor {slot.name!r} is missing")
            tensor = tensors[slot.name]
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(
                    f"tensor {slot.name!r} has shape {list(tensor.shape)}, expected {list(slot.shape)}")
            if not tensor.is_floating_point():
                raise ValueError(f"tensor {slot.name!r} has dtype {tensor.dtype}, expected a float dtype")

    def _check_wire(self, wire: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError unless `wire` has exactly the names, dtypes and shapes of `wire_metas`."""
        extra = set(wire) - {meta.name for meta in self._metas}
        if extra:
            raise ValueError(f"wire tensors not in the {self.spec} layout: {sorted(extra)}")
        for slot in self._slots:
            for wname, dtype, shape in slot.wire:
                if wname not in wire:
                    raise ValueError(f"wire tensor {wname!r} is missing")
                got = wire[wname]
                if got.dtype != dtype:
                    raise ValueError(f"wire tensor {wname!r} has dtype {got.dtype}, expected {dtype}")
                if tuple(got.shape) != shape:
                    raise ValueError(
                        f"wire tensor {wname!r} has shape {list(got.shape)}, expected {list(shape)}")


def make_codec(spec: CodecSpec | str, templates: Mapping[str, torch.Tensor]) -> Codec:
    """A codec for `templates`; a string spec goes through `parse_codec`."""
    return Codec(parse_codec(spec) if isinstance(spec, str) else spec, templates)


class ErrorFeedback:
    """Residual memory of a lossy codec (Karimireddy et al. 2019 / DGC): what was not sent goes next time."""

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}
        self._step: int | None = None
        self._before: dict[str, torch.Tensor] = {}
        """The residual as the update for `_step` began (its tensors are never changed in place)."""

    def begin(self, step: int) -> None:
        """An update for training step `step` begins. Another attempt of a step already begun
        starts from the residual the first attempt began with: a step is redone only when none
        of its earlier attempt's updates counted (a pipeline step is all or nothing), so what that
        attempt committed here was never applied."""
        if step == self._step:
            self._residual = dict(self._before)
        else:
            self._step, self._before = step, dict(self._residual)

    def compensate(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors + residual`` (a copy where there is no residual); the inputs are not changed."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            residual = self._residual.get(name)
            if residual is None:
                out[name] = tensor.detach().clone()
            elif residual.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {list(tensor.shape)}, its residual {list(residual.shape)}")
            else:
                out[name] = tensor.detach() + residual
        return out

    def commit(self, compensated: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> None:
        """Remember ``compensated - sent`` for each tensor in both; call once the transfer succeeded."""
        for name, tensor in compensated.items():
            if name in sent:
                self._residual[name] = tensor.detach() - sent[name]

    def clear(self) -> None:
        """The whole residual was sent (a lossless codec carried it)."""
        self._residual = {}

    def reset(self) -> None:
        """Forget the residual (e.g. when the model is replaced or the job restarts)."""
        self._residual.clear()
        self._step, self._before = None, {}

    def norm(self) -> float:
        """L2 norm of the whole residual (0.0 when empty), for metrics."""
        if not self._residual:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(r) for r in self._residual.values()])
        return float(torch.linalg.vector_norm(norms))


def encode_with_feedback(
    codec: Codec, feedback: ErrorFeedback | None, tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Wire tensors for `tensors` plus the residual, and a `commit` to call once they were delivered.

    Without feedback `tensors` are encoded as they are and `commit` does nothing. A lossless
    codec with a residual left by an earlier lossy one (the adaptive choice switched) sends the
    residual too and its commit clears it; without a residual it costs nothing extra.
    """
    if feedback is None or (not codec.spec.lossy and not feedback.norm()):
        return codec.encode(tensors), lambda: None
    if not codec.spec.lossy:
        wire = codec.encode(feedback.compensate(tensors))
        return wire, feedback.clear
    compensated = feedback.compensate(tensors)
    wire = codec.encode(compensated)

    def commit() -> None:
        feedback.commit(compensated, codec.decode(wire))

    return wire, commit
