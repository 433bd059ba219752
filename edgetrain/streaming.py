"""Bundles on the wire without torch: tensor metadata, checksummed chunks, their reassembly.

A bundle is an ordered mapping name -> tensor. On the wire it is a header (one `TensorMeta` per
tensor: dtype, shape and byte range) followed by the concatenated raw bytes of all tensors, sent
in chunks of 256 KiB - 1 MiB, each with a zlib crc32 unless the channel is TLS (whose records are
authenticated already: the checksum would cost a board milliseconds of its core per MobileNetV2
transfer, each way, for nothing). `ChunkAssembler` receives such a stream,
rejects bad chunks precisely and remembers the last good byte, so a broken transfer resumes from
there instead of from zero (edgetrain.transport runs those resumable loops). Nothing here
unpickles anything; edgetrain.tensors turns payloads into tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1,
                               "uint8": 1}
"""The tensor dtypes a bundle may carry, with their element sizes (edgetrain.tensors maps them to
torch dtypes)."""
WIRE_DTYPES = tuple(DTYPE_BYTES)
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 1024 * 1024


class TransferError(Exception):
    """A stream or bundle the receiver refuses. `kind` names the gRPC status it maps to."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        """One of: invalid_argument, data_loss, out_of_range."""


class UploadAbandoned(Exception):
    """An update being streamed will not be sent after all (its compute failed, or the step is
    being redone without it): the stream ends without its report."""


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


@dataclass(frozen=True)
class RawChunk:
    """One piece of a payload, with the crc32 of its bytes (None: not checksummed, on TLS)."""

    offset: int
    data: bytes
    crc32: int | None


def iter_chunks(payload: bytes | bytearray | memoryview, *, start: int = 0,
                chunk_bytes: int = 512 * 1024, checksum: bool = True) -> Iterator[RawChunk]:
    """Chunks of `payload` from byte `start` on, each at most `chunk_bytes` long; with their
    crc32 unless `checksum` is False (the channel is TLS)."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    view = memoryview(payload)
    for offset in range(start, len(view), chunk_bytes):
        data = bytes(view[offset : offset + chunk_bytes])
        yield RawChunk(offset, data, zlib.crc32(data) if checksum else None)


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
    def buffer(self) -> bytearray:
        """The buffer the payload is assembled in: bytes before `received` are final."""
        return self._buffer

    @property
    def complete(self) -> bool:
        """True once every byte has arrived."""
        return self.received == self.total_bytes

    def add(self, offset: int, data: bytes, crc32: int | None) -> None:
        """Append one chunk (checked against `crc32` when given), or raise TransferError saying
        why it is refused."""
        end = offset + len(data)
        if end > self.total_bytes:
            raise TransferError(
                "out_of_range",
                f"chunk [{offset}, {end}) runs past the declared {self.total_bytes} bytes")
        if offset > self.received:
            raise TransferError(
                "out_of_range", f"chunk at byte {offset} leaves a gap; resume from byte {self.received}")
        if crc32 is not None and zlib.crc32(data) != crc32:
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
