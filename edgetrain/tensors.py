"""Named-tensor bundles as dtype + shape + raw bytes, split into checksummed chunks.

A bundle is an ordered mapping name -> tensor. On the wire it is a header (one `TensorMeta`
per tensor: dtype, shape and byte range) followed by the concatenated raw bytes of all tensors,
sent in chunks of 256 KiB - 1 MiB, each with a zlib crc32. `ChunkAssembler` receives such a
stream, rejects bad chunks precisely and remembers the last good byte, so a broken transfer
resumes from there instead of from zero. Nothing here unpickles anything.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

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

MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 1024 * 1024


class TransferError(Exception):
    """A stream or bundle the receiver refuses. `kind` names the gRPC status it maps to."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        """One of: invalid_argument, data_loss, out_of_range."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor of a bundle lives in the payload, and what it is."""

    name: str
    """Tensor name, e.g. ``grad.blocks.stem.0.weight``."""
    dtype: str
    """One of `DTYPES`' keys."""
    shape: tuple[int, ...]
    """Tensor shape."""
    offset: int
    """First byte of the tensor in the payload."""
    nbytes: int
    """Byte length of the tensor."""


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
    """Header and payload (raw bytes of all tensors, in order) for `tensors`: one copy."""
    metas = bundle_metas(tensors)
    if not metas:
        return metas, memoryview(bytearray())
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])
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


def check_metas(received: Sequence[TensorMeta], expected: Sequence[TensorMeta], what: str) -> None:
    """Raise TransferError(invalid_argument) naming the first tensor that differs."""
    if len(received) != len(expected):
        raise TransferError(
            "invalid_argument", f"{what}: {len(received)} tensors, expected {len(expected)}")
    for got, want in zip(received, expected):
        if got.name != want.name:
            raise TransferError("invalid_argument", f"{what}: tensor {got.name!r}, expected {want.name!r}")
        if got.dtype != want.dtype:
            raise TransferError(
                "invalid_argument", f"{what}: tensor {got.name!r} dtype {got.dtype}, expected {want.dtype}")
        if got.shape != want.shape:
            raise TransferError(
                "invalid_argument",
                f"{what}: tensor {got.name!r} shape {list(got.shape)}, expected {list(want.shape)}")
        if (got.offset, got.nbytes) != (want.offset, want.nbytes):
            raise TransferError(
                "invalid_argument", f"{what}: tensor {got.name!r} byte range does not match its shape")


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise TransferError(invalid_argument) naming the first tensor with NaN or Inf values."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise TransferError(
                    "invalid_argument", f"{what}: tensor {name!r} has {bad} non-finite (NaN/Inf) values")


@dataclass(frozen=True)
class RawChunk:
    """One piece of a payload, with the crc32 of its bytes."""

    offset: int
    data: bytes
    crc32: int


def iter_chunks(payload: bytes | bytearray | memoryview, *, start: int = 0,
                chunk_bytes: int = 512 * 1024) -> Iterator[RawChunk]:
    """Chunks of `payload` from byte `start` on, each at most `chunk_bytes` long."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    view = memoryview(payload)
    for offset in range(start, len(view), chunk_bytes):
        data = bytes(view[offset : offset + chunk_bytes])
        yield RawChunk(offset, data, zlib.crc32(data))


class ChunkAssembler:
    """Receives a payload of known size chunk by chunk, in order, verifying each chunk.

    `received` is the resume point: every byte before it arrived and passed its checksum.
    A chunk that repeats bytes already held is ignored (a resumed sender may resend them).
    """

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.received = 0
        self._buffer = bytearray(total_bytes)

    @property
    def complete(self) -> bool:
        """True once every byte has arrived."""
        return self.received == self.total_bytes

    def add(self, offset: int, data: bytes, crc32: int) -> None:
        """Append one chunk, or raise TransferError saying why it is refused."""
        end = offset + len(data)
        if end > self.total_bytes:
            raise TransferError(
                "out_of_range",
                f"chunk [{offset}, {end}) runs past the declared {self.total_bytes} bytes")
        if offset > self.received:
            raise TransferError(
                "out_of_range", f"chunk at byte {offset} leaves a gap; resume from byte {self.received}")
        if zlib.crc32(data) != crc32:
            raise TransferError(
                "data_loss", f"chunk at byte {offset} failed its crc32 check; resume from byte {self.received}")
        if end <= self.received:
            return
        skip = self.received - offset
        self._buffer[self.received : end] = data[skip:]
        self.received = end

    def payload(self) -> bytearray:
        """The assembled payload; raises TransferError(data_loss) while bytes are missing."""
        if not self.complete:
            raise TransferError(
                "data_loss",
                f"stream ended at byte {self.received} of {self.total_bytes}; resume from byte {self.received}")
        return self._buffer
