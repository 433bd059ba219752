"""Pure conversions between the core's plain data and the wire messages (protos/)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from edgetrain.data import DatasetSpec
from edgetrain.errors import FailureKind
from edgetrain.streaming import WIRE_DTYPES, RawChunk, TensorMeta, TransferError
from edgetrain.telemetry import TelemetrySample
from protos import coordinator_pb2 as pb
from protos import tensor_pb2 as tpb

_DTYPE_TO_PROTO = {
    "float32": tpb.FLOAT32, "float16": tpb.FLOAT16, "bfloat16": tpb.BFLOAT16, "int64": tpb.INT64,
    "int32": tpb.INT32, "int8": tpb.INT8, "uint8": tpb.UINT8,
}
_DTYPE_FROM_PROTO = {v: k for k, v in _DTYPE_TO_PROTO.items()}
assert set(_DTYPE_TO_PROTO) == set(WIRE_DTYPES)


def header_to_proto(metas: Sequence[TensorMeta]) -> tpb.BundleHeader:
    """Bundle header message for `metas`."""
    return tpb.BundleHeader(
        tensors=[tpb.TensorSpec(name=m.name, dtype=_DTYPE_TO_PROTO[m.dtype], shape=list(m.shape),
                                offset=m.offset, nbytes=m.nbytes) for m in metas],
        total_bytes=sum(m.nbytes for m in metas),
    )


def header_from_proto(msg: tpb.BundleHeader) -> tuple[list[TensorMeta], int]:
    """Metas and declared total size; TransferError(invalid_argument) if inconsistent."""
    metas, offset = [], 0
    for spec in msg.tensors:
        if spec.dtype not in _DTYPE_FROM_PROTO:
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: unknown dtype {spec.dtype}")
        dtype = _DTYPE_FROM_PROTO[spec.dtype]
        if any(d < 0 for d in spec.shape):
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: negative dimension")
        metas.append(TensorMeta(spec.name, dtype, tuple(spec.shape), spec.offset, spec.nbytes))
        if spec.offset != offset:
            raise TransferError("invalid_argument", f"tensor {spec.name!r}: offset {spec.offset}, expected {offset}")
        offset += spec.nbytes
    if offset != msg.total_bytes:
        raise TransferError("invalid_argument", f"bundle declares {msg.total_bytes} bytes, tensors cover {offset}")
    return metas, msg.total_bytes


def chunk_to_proto(chunk: RawChunk) -> tpb.Chunk:
    """Chunk message."""
    return tpb.Chunk(offset=chunk.offset, data=chunk.data, crc32=chunk.crc32)


def parameter_stream(metas: Sequence[TensorMeta], chunks: Iterator[RawChunk]) -> Iterator[pb.ParameterMessage]:
    """A parameter download: the header, then the chunks."""
    yield pb.ParameterMessage(header=header_to_proto(metas))
    for chunk in chunks:
        yield pb.ParameterMessage(chunk=chunk_to_proto(chunk))


def dataset_to_proto(spec: DatasetSpec) -> pb.DatasetSpec:
    """Dataset description sent to clients (the data directory stays each board's own)."""
    return pb.DatasetSpec(name=spec.name, seed=spec.seed, train_size=spec.train_size or 0,
                          test_size=spec.test_size or 0, augment=spec.augment)


def dataset_from_proto(msg: pb.DatasetSpec, *, data_dir: str, download: bool) -> DatasetSpec:
    """The job's dataset, read from this board's own data directory."""
    return DatasetSpec(name=msg.name, seed=msg.seed, train_size=msg.train_size or None,
                       test_size=msg.test_size or None, augment=msg.augment, data_dir=data_dir,
                       download=download)


def telemetry_to_proto(sample: TelemetrySample) -> pb.Telemetry:
    """Telemetry message; unknown values stay unset."""
    return pb.Telemetry(**sample.known())


def telemetry_from_proto(msg: pb.Telemetry) -> TelemetrySample:
    """Telemetry sample; unset fields become None (unknown)."""
    known = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
             if f.name != "timestamp" and msg.HasField(f.name)}
    return TelemetrySample(timestamp=msg.timestamp, **known)


def failure_kind_from_proto(value: int) -> FailureKind:
    """The kind of a board's failure report; ValueError for a value this side does not know."""
    try:
        return FailureKind(value)
    except ValueError:
        raise ValueError(f"unknown failure kind {value}") from None
