"""Tests for edgetrain.tensors: packing, chunking, resumable assembly and header checks."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.streaming import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    ChunkAssembler,
    TensorMeta,
    TransferError,
    check_metas,
    iter_chunks,
)
from edgetrain.tensors import DTYPES, bundle_metas, check_finite, pack, unpack

pytestmark = pytest.mark.timeout(60)


def _bits(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (so NaN payloads and -0.0 compare exactly)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same_bundle(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert _bits(got[name]) == _bits(tensor), name


def _chunk(payload: bytes, offset: int, length: int) -> tuple[int, bytes, int]:
    data = payload[offset : offset + length]
    return offset, data, zlib.crc32(data)


# --- pack / unpack -----------------------------------------------------------------------------

def test_pack_unpack_round_trip_over_dtypes_and_shapes() -> None:
    # Prepare: every supported dtype, a 0-d tensor, an empty tensor and a non-contiguous one
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=gen),
        "f16": torch.randn(5, generator=gen).half(),
        "bf16": torch.randn(2, 2, 2, generator=gen).bfloat16(),
        "i64": torch.tensor([-(2**62), 0, 2**62]),
        "i32": torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([[0, 255]], dtype=torch.uint8),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
    }

    # Execute
    metas, payload = pack(tensors)
    restored = unpack(metas, bytes(payload))

    # Assert
    _assert_same_bundle(restored, tensors)
    assert [m.name for m in metas] == list(tensors)
    assert metas[0].offset == 0
    assert all(a.offset + a.nbytes == b.offset for a, b in zip(metas, metas[1:]))
    assert len(payload) == sum(m.nbytes for m in metas)
    assert next(m for m in metas if m.name == "scalar").shape == ()
    assert next(m for m in metas if m.name == "empty").nbytes == 0


def test_unpack_returns_views_of_the_payload_without_copying() -> None:
    # Prepare
    metas, payload = pack({"x": torch.ones(4)})
    buffer = bytearray(payload)

    # Execute
    restored = unpack(metas, buffer)
    buffer[:] = bytes(len(buffer))

    # Assert: decoding a 45 MB gradient costs no copy; the tensors live in the payload
    assert torch.equal(restored["x"], torch.zeros(4))


def test_bundle_metas_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match=r"'c'.*complex64"):
        bundle_metas({"c": torch.zeros(2, dtype=torch.complex64)})


_shapes = st.lists(st.integers(min_value=0, max_value=6), min_size=0, max_size=3).map(tuple)
_bundles = st.dictionaries(
    keys=st.text(alphabet="abcdefghij.", min_size=1, max_size=8),
    values=st.tuples(st.sampled_from(sorted(DTYPES)), _shapes, st.integers(0, 2**31 - 1)),
    min_size=1, max_size=6,
)


def _make_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes of the right size reinterpreted as `dtype` (any bit pattern, NaN included)."""
    dtype = DTYPES[dtype_name]
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(bundle=_bundles, chunk_bytes=st.integers(MIN_CHUNK_BYTES, 3 * MIN_CHUNK_BYTES),
       big=st.integers(0, 5000))
def test_round_trip_through_chunks_property(bundle, chunk_bytes: int, big: int) -> None:
    # Prepare: the random bundle plus one tensor big enough to need several chunks
    tensors = {name: _make_tensor(*spec) for name, spec in bundle.items()}
    tensors["big"] = _make_tensor("float32", (big,), seed=big)

    # Execute
    metas, payload = pack(tensors)
    assembler = ChunkAssembler(len(payload))
    for chunk in iter_chunks(payload, chunk_bytes=chunk_bytes):
        assembler.add(chunk.offset, chunk.data, chunk.crc32)
    restored = unpack(metas, assembler.payload())

    # Assert
    assert assembler.complete
    _assert_same_bundle(restored, tensors)


# --- iter_chunks -------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes", [0, MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1])
def test_iter_chunks_rejects_chunk_size_out_of_bounds(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match=f"got {chunk_bytes}"):
        next(iter_chunks(b"x" * 10, chunk_bytes=chunk_bytes))


@pytest.mark.parametrize("chunk_bytes", [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES])
def test_iter_chunks_accepts_the_bounds(chunk_bytes: int) -> None:
    assert [c.offset for c in iter_chunks(b"x" * 10, chunk_bytes=chunk_bytes)] == [0]


@pytest.mark.parametrize("size", [0, 1, MIN_CHUNK_BYTES, 3 * MIN_CHUNK_BYTES + 17])
def test_iter_chunks_cover_the_payload_exactly(size: int) -> None:
    # Prepare
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)

    # Execute
    chunks = list(iter_chunks(payload, chunk_bytes=MIN_CHUNK_BYTES))

    # Assert
    assert b"".join(c.data for c in chunks) == payload
    assert [c.offset for c in chunks] == list(range(0, size, MIN_CHUNK_BYTES))
    assert all(len(c.data) <= MIN_CHUNK_BYTES for c in chunks)
    assert all(c.crc32 == zlib.crc32(c.data) for c in chunks)


def test_iter_chunks_starts_at_the_resume_offset() -> None:
    # Prepare
    payload = bytes(i % 251 for i in range(10_000))

    # Execute
    chunks = list(iter_chunks(payload, start=5_000, chunk_bytes=MIN_CHUNK_BYTES))
    past_end = list(iter_chunks(payload, start=len(payload), chunk_bytes=MIN_CHUNK_BYTES))

    # Assert
    assert [c.offset for c in chunks] == [5_000, 5_000 + MIN_CHUNK_BYTES]
    assert b"".join(c.data for c in chunks) == payload[5_000:]
    assert past_end == []


# --- ChunkAssembler ----------------------------------------------------------------------------

PAYLOAD = bytes(i * 7 % 256 for i in range(1000))


def test_assembler_in_order() -> None:
    # Prepare
    assembler = ChunkAssembler(len(PAYLOAD))

    # Execute
    for offset in range(0, len(PAYLOAD), 300):
        assembler.add(*_chunk(PAYLOAD, offset, 300))

    # Assert
    assert assembler.complete
    assert assembler.received == len(PAYLOAD)
    assert bytes(assembler.payload()) == PAYLOAD


def test_assembler_empty_payload_is_complete_at_once() -> None:
    assembler = ChunkAssembler(0)
    assert assembler.complete
    assert bytes(assembler.payload()) == b""


def test_assembler_ignores_duplicate_and_takes_tail_of_overlapping_chunk() -> None:
    # Prepare: 400 bytes held, then a resumed sender repeats and overlaps them
    assembler = ChunkAssembler(len(PAYLOAD))
    assembler.add(*_chunk(PAYLOAD, 0, 400))

    # Execute
    assembler.add(*_chunk(PAYLOAD, 100, 200))  # entirely held: ignored
    held_after_duplicate = assembler.received
    assembler.add(*_chunk(PAYLOAD, 300, 400))  # [300, 700): only [400, 700) is new
    assembler.add(*_chunk(PAYLOAD, 700, 300))

    # Assert
    assert held_after_duplicate == 400
    assert assembler.complete
    assert bytes(assembler.payload()) == PAYLOAD


def test_assembler_gap_is_out_of_range_and_names_resume_byte() -> None:
    # Prepare
    assembler = ChunkAssembler(len(PAYLOAD))
    assembler.add(*_chunk(PAYLOAD, 0, 200))

    # Execute
    with pytest.raises(TransferError) as caught:
        assembler.add(*_chunk(PAYLOAD, 300, 100))

    # Assert
    assert caught.value.kind == "out_of_range"
    assert "chunk at byte 300 leaves a gap; resume from byte 200" in str(caught.value)
    assert assembler.received == 200


def test_assembler_bad_crc_is_data_loss_and_keeps_received() -> None:
    # Prepare
    assembler = ChunkAssembler(len(PAYLOAD))
    assembler.add(*_chunk(PAYLOAD, 0, 200))
    offset, data, crc = _chunk(PAYLOAD, 200, 200)

    # Execute
    with pytest.raises(TransferError) as caught:
        assembler.add(offset, data, crc ^ 1)

    # Assert
    assert caught.value.kind == "data_loss"
    assert "chunk at byte 200 failed its crc32 check; resume from byte 200" in str(caught.value)
    assert assembler.received == 200
    assembler.add(offset, data, crc)  # the good chunk is still accepted afterwards
    assert assembler.received == 400


def test_assembler_corrupted_data_is_data_loss() -> None:
    # Prepare: the crc was computed before a byte flipped in transit
    assembler = ChunkAssembler(len(PAYLOAD))
    offset, data, crc = _chunk(PAYLOAD, 0, 200)
    flipped = bytes([data[0] ^ 0xFF]) + data[1:]

    # Execute
    with pytest.raises(TransferError) as caught:
        assembler.add(offset, flipped, crc)

    # Assert
    assert caught.value.kind == "data_loss"
    assert assembler.received == 0


def test_assembler_overflow_past_total_is_out_of_range() -> None:
    # Prepare
    assembler = ChunkAssembler(100)
    assembler.add(*_chunk(PAYLOAD, 0, 50))

    # Execute
    with pytest.raises(TransferError) as caught:
        assembler.add(*_chunk(PAYLOAD, 50, 60))

    # Assert
    assert caught.value.kind == "out_of_range"
    assert "chunk [50, 110) runs past the declared 100 bytes" in str(caught.value)
    assert assembler.received == 50


def test_assembler_payload_while_incomplete_is_data_loss_naming_resume_byte() -> None:
    # Prepare
    assembler = ChunkAssembler(len(PAYLOAD))
    assembler.add(*_chunk(PAYLOAD, 0, 300))

    # Execute
    with pytest.raises(TransferError) as caught:
        assembler.payload()

    # Assert
    assert caught.value.kind == "data_loss"
    assert f"stream ended at byte 300 of {len(PAYLOAD)}; resume from byte 300" in str(caught.value)
    assert not assembler.complete


# --- check_metas / check_finite ----------------------------------------------------------------

EXPECTED = [
    TensorMeta("grad.w", "float32", (4, 3), 0, 48),
    TensorMeta("grad.b", "float32", (4,), 48, 16),
]


@pytest.mark.parametrize(("received", "fragments"), [
    pytest.param([TensorMeta("grad.w", "float32", (3, 4), 0, 48), EXPECTED[1]],
                 ["'grad.w'", "shape [3, 4]", "expected [4, 3]"], id="shape"),
    pytest.param([TensorMeta("grad.w", "int32", (4, 3), 0, 48), EXPECTED[1]],
                 ["'grad.w'", "dtype int32", "expected float32"], id="dtype"),
    pytest.param([EXPECTED[0], TensorMeta("grad.bias", "float32", (4,), 48, 16)],
                 ["'grad.bias'", "expected 'grad.b'"], id="name"),
    pytest.param([EXPECTED[0]], ["1 tensors", "expected 2"], id="count"),
    pytest.param([EXPECTED[0], TensorMeta("grad.b", "float32", (4,), 48, 32)],
                 ["'grad.b'", "byte range"], id="byte-range"),
])
def test_check_metas_names_the_mismatch(received: list[TensorMeta], fragments: list[str]) -> None:
    # Execute
    with pytest.raises(TransferError) as caught:
        check_metas(received, EXPECTED, "upload from dev-1")

    # Assert
    assert caught.value.kind == "invalid_argument"
    message = str(caught.value)
    assert message.startswith("upload from dev-1: ")
    for fragment in fragments:
        assert fragment in message


def test_check_metas_accepts_identical_headers() -> None:
    check_metas(list(EXPECTED), EXPECTED, "upload")


@pytest.mark.parametrize(("values", "bad"), [
    ([0.0, float("nan"), 1.0, float("nan")], 2),
    ([float("inf"), 1.0, float("-inf")], 2),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_finite_names_tensor_and_counts_bad_values(values, bad: int, dtype) -> None:
    # Prepare
    tensors = {"grad.ok": torch.ones(3), "grad.bad": torch.tensor(values, dtype=dtype)}

    # Execute
    with pytest.raises(TransferError) as caught:
        check_finite(tensors, "upload from dev-1")

    # Assert
    assert caught.value.kind == "invalid_argument"
    assert f"tensor 'grad.bad' has {bad} non-finite (NaN/Inf) values" in str(caught.value)


def test_check_finite_ignores_integer_tensors_and_finite_floats() -> None:
    check_finite({"n": torch.tensor([2**62]), "x": torch.tensor([1e30, -0.0]), "e": torch.empty(0)}, "x")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_check_finite_accepts_finite_values_whose_sum_overflows(dtype) -> None:
    # Prepare: every value finite, their sum past the dtype's (and float32's) largest value
    big = torch.finfo(dtype).max
    tensors = {"a": torch.tensor([big, big], dtype=dtype), "b": torch.tensor([-big, big / 2], dtype=dtype)}

    # Execute / Assert: no error (the quick sum is not finite; the element-wise look finds nothing)
    check_finite(tensors, "x")


def test_chunks_without_a_checksum_are_assembled_and_a_wrong_one_is_still_refused():
    # Prepare
    payload = bytes(range(256)) * 64
    bare = list(iter_chunks(payload, chunk_bytes=4096, checksum=False))
    checked = list(iter_chunks(payload, chunk_bytes=4096))
    assembler, strict = ChunkAssembler(len(payload)), ChunkAssembler(len(payload))

    # Execute
    for chunk in bare:
        assembler.add(chunk.offset, chunk.data, chunk.crc32)
    strict.add(checked[0].offset, checked[0].data, checked[0].crc32)
    with pytest.raises(TransferError) as caught:
        strict.add(checked[1].offset, checked[1].data, checked[1].crc32 ^ 1)

    # Assert
    assert [c.crc32 for c in bare] == [None] * 4 and all(c.crc32 == zlib.crc32(c.data) for c in checked)
    assert bytes(assembler.payload()) == payload
    assert caught.value.kind == "data_loss" and strict.received == 4096
