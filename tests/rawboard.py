"""A hand-driven board speaking raw gRPC through the generated stubs, for tests that need a
client to misbehave on purpose. It computes real gradients for the samples it is assigned, so
anything the coordinator refuses is refused on its own merits."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import torch

import edgetrain
from edgetrain import serde
from edgetrain.data import load_dataset, make_batch
from edgetrain.models import build_model
from edgetrain.streaming import ChunkAssembler, RawChunk, iter_chunks
from edgetrain.tensors import pack, unpack
from edgetrain.training import GRAD_PREFIX, compute_shard, load_state_tensors
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from protos import tensor_pb2 as tpb

NAME = "raw-board"
CHUNK = 4096
"""Upload chunk size: the small CNN's ~95 KiB gradient travels in ~24 chunks."""
RPC_TIMEOUT_S = 15.0


# --- a raw client ------------------------------------------------------------------------------

@dataclass
class Board:
    """One registered, profiled device driven by hand."""

    stub: pb_grpc.CoordinatorStub
    device_id: str
    job: pb.JobSpec


@dataclass
class Gradient:
    """A real gradient upload for one step: header fields, tensors and packed payload."""

    work: pb.StepWork
    tensors: dict[str, torch.Tensor]
    bundle: tpb.BundleHeader
    payload: bytes
    report: pb.StepReport


def register(stub: pb_grpc.CoordinatorStub, name: str = NAME,
             protocol_version: int = edgetrain.PROTOCOL_VERSION) -> pb.RegisterReply:
    request = pb.RegisterRequest(
        device=pb.DeviceInfo(name=name, hostname="test", arch="x86_64", os="linux", cpu_count=1),
        versions=pb.SoftwareVersions(edgetrain=edgetrain.__version__),
        protocol_version=protocol_version)
    return stub.Register(request, timeout=RPC_TIMEOUT_S)


def join(stub: pb_grpc.CoordinatorStub, name: str = NAME) -> Board:
    """Register and report a profile, so the trainer may give this board work."""
    reply = register(stub, name)
    timings = [pb.BatchTiming(batch_size=b, seconds=0.01 + b * 0.001) for b in reply.job.profile_batch_sizes]
    stub.ReportProfile(pb.ProfileReport(device_id=reply.device_id, timings=timings,
                                        memory_total_bytes=2**30, memory_available_bytes=2**29),
                       timeout=RPC_TIMEOUT_S)
    return Board(stub, reply.device_id, reply.job)


def next_step(board: Board, timeout_s: float = 20.0) -> pb.StepWork:
    """Poll GetWork until it hands out a step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        work = board.stub.GetWork(pb.WorkRequest(device_id=board.device_id, max_wait_s=1.0),
                                  timeout=RPC_TIMEOUT_S)
        kind = work.WhichOneof("work")
        assert kind != "finished", work.finished.reason
        if kind == "step":
            return work.step
    raise AssertionError(f"no work for {board.device_id} within {timeout_s} s")


def download(board: Board, version: int) -> dict[str, torch.Tensor]:
    metas, assembler = [], None
    request = pb.ParameterRequest(device_id=board.device_id, version=version)
    for message in board.stub.DownloadParameters(request, timeout=RPC_TIMEOUT_S):
        if message.WhichOneof("kind") == "header":
            metas, total = serde.header_from_proto(message.header)
            assembler = ChunkAssembler(total)
        else:
            assembler.add(message.chunk.offset, message.chunk.data, serde.chunk_crc32(message.chunk))
    return unpack(metas, assembler.payload())


def compute_gradient(board: Board, work: pb.StepWork, tmp_path: Path) -> Gradient:
    """What a real board computes for `work`: gradients of the mean loss over its samples."""
    model = build_model(board.job.model, num_classes=board.job.num_classes)
    load_state_tensors(model, download(board, work.param_version))
    spec = replace(serde.dataset_from_proto(board.job.dataset), data_dir=str(tmp_path / "data"))
    x, y = make_batch(load_dataset(spec, train=True), list(work.indices), augment=work.augment,
                      seed=work.data_seed, step=work.step)
    result = compute_shard(model, x, y)
    return gradient_of(work, result.tensors, pb.StepReport(
        samples=result.samples, loss=result.loss, correct=result.correct, compute_s=0.01))


def gradient_of(work: pb.StepWork, tensors: dict[str, torch.Tensor], report: pb.StepReport) -> Gradient:
    """An upload of `tensors` (gradients and buffers, in the model's order) laid out as on the
    wire: gradients last layer first, then the buffers."""
    metas, payload = pack(wire_order(tensors))
    return Gradient(work, tensors, serde.header_to_proto(metas), bytes(payload), report)


def wire_order(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An uncompressed update's tensors (in the model's order) as the wire lays them out:
    gradients last layer first, then the buffers (edgetrain.updates.UpdateFormat)."""
    grads = [(n, t) for n, t in tensors.items() if n.startswith(GRAD_PREFIX)]
    return dict(grads[::-1] + [(n, t) for n, t in tensors.items() if not n.startswith(GRAD_PREFIX)])


def header(board: Board, grad: Gradient, *, resume_offset: int = 0, **fields) -> pb.UploadHeader:
    """The upload header for `grad`; `fields` override device_id / step / attempt."""
    values = {"device_id": board.device_id, "step": grad.work.step, "attempt": grad.work.attempt, **fields}
    return pb.UploadHeader(bundle=grad.bundle, report=grad.report, resume_offset=resume_offset, **values)


def chunks(grad: Gradient, start: int = 0, stop: int | None = None) -> list[RawChunk]:
    """Good chunks of the payload covering [start, stop)."""
    end = len(grad.payload) if stop is None else stop
    return [c for c in iter_chunks(grad.payload, start=start, chunk_bytes=CHUNK) if c.offset < end]


Piece = RawChunk | tpb.Chunk
"""A chunk to send: a good one from `chunks`, or a hand-made (possibly bad) message."""


def stream(head: pb.UploadHeader | None, pieces: Iterable[Piece]) -> Iterator[pb.UploadMessage]:
    if head is not None:
        yield pb.UploadMessage(header=head)
    for piece in pieces:
        chunk = piece if isinstance(piece, tpb.Chunk) else serde.chunk_to_proto(piece)
        yield pb.UploadMessage(chunk=chunk)


def upload(board: Board, head: pb.UploadHeader | None, pieces: Iterable[Piece]) -> pb.UploadReply:
    return board.stub.UploadGradient(stream(head, pieces), timeout=RPC_TIMEOUT_S)


def upload_good(board: Board, grad: Gradient) -> pb.UploadReply:
    return upload(board, header(board, grad), chunks(grad))


def refused(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError `call` fails with (the test fails if it succeeds)."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def train_records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


