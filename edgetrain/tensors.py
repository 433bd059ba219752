"""Named-tensor bundles as dtype + shape + raw bytes: packing tensors into one payload and back.

The wire side without torch (metadata, checksummed chunks, reassembly) is edgetrain.streaming.
Nothing here unpickles anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from edgetrain.streaming import WIRE_DTYPES, TensorMeta, TransferError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
assert set(DTYPES) == set(WIRE_DTYPES)


def bundle_metas(tensors: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """The header describing `tensors` packed in order."""
    metas, offset = [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return metas


def pack(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorMeta], memoryview]:
    """Header and payload (raw bytes of all tensors, in order) for `tensors`: one copy, made on
    the tensors' device (a GPU's come back to the host in one transfer)."""
    metas = bundle_metas(tensors)
    if not metas:
        return metas, memoryview(bytearray())
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    if len({p.device for p in parts}) > 1:
        parts = [p.cpu() for p in parts]
    flat = torch.cat(parts).cpu()  # no copy when it is on the host already
    return metas, memoryview(flat.numpy()).cast("B")


def unpack(metas: Sequence[TensorMeta], payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors described by `metas`, viewing the payload when it is writable (no copy)."""
    out: dict[str, torch.Tensor] = {}
    view = memoryview(payload)
    if view.readonly:
        view = memoryview(bytearray(view))
    for meta in metas:
        dtype = DTYPES[meta.dtype]
        if meta.nbytes:
            tensor = torch.frombuffer(view, dtype=dtype, offset=meta.offset,
                                      count=meta.nbytes // torch.empty(0, dtype=dtype).element_size())
        else:
            tensor = torch.empty(0, dtype=dtype)
        out[meta.name] = tensor.reshape(meta.shape)
    return out


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise TransferError(invalid_argument) naming the first tensor with NaN or Inf values.

    A NaN or Inf anywhere makes the sum of the tensors' sums NaN or Inf, so one reduction clears
    the usual, finite case (a quarter of the time of testing every element); only a sum that is
    not finite (a bad value, or finite values overflowing it) is looked at element by element.
    """
    floats = [t for t in tensors.values() if t.is_floating_point()]
    if not floats or bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in floats]).sum())):
        return
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise TransferError(
                    "invalid_argument", f"{what}: tensor {name!r} has {bad} non-finite (NaN/Inf) values")
