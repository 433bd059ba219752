"""A board's update streamed during backward carries exactly the bytes of the update packed after
compute, and its chunks leave while backward still runs (edge_client.streamed)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from edge_client.streamed import StreamChoice, StreamedUpdate
from edgetrain.models import build_model
from edgetrain.streaming import ChunkAssembler, UploadAbandoned
from edgetrain.tensors import pack
from edgetrain.training import GRAD_PREFIX, compute_shard, shard_tensor_names
from edgetrain.updates import UpdateFormats
from edgetrain.work import StepReport

CHUNK = 4096
WAIT_S = 60.0
"""Longest a test waits for the other thread (a bound on a hang, not a timing)."""


def _batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


class _Receiver:
    """The upload side: takes the stream's chunks into an assembler, noting which arrived while
    backward still ran (`during_backward`)."""

    def __init__(self, update: StreamedUpdate) -> None:
        self.assembler = ChunkAssembler(update.nbytes)
        self.backward_done = threading.Event()
        self.first_chunk = threading.Event()
        self.during_backward = 0
        self.report: StepReport | None = None

    def __call__(self, update: StreamedUpdate) -> None:
        for chunk in update.chunks(0, CHUNK):
            self.assembler.add(chunk.offset, chunk.data, chunk.crc32)
            if not self.backward_done.is_set():
                self.during_backward += 1
            self.first_chunk.set()
        self.report = update.report()


@pytest.mark.parametrize(("model_name", "samples", "max_batch"), [
    ("small_cnn", 8, 0),
    ("small_cnn", 8, 3),          # three chunks through the model: only the last backward streams
    ("mobilenet_v2", 4, 0),       # BatchNorm: running statistics follow the gradients
], ids=["small-cnn", "small-cnn-chunked", "mobilenet-v2"])
def test_streamed_update_carries_the_bytes_of_the_packed_update(model_name, samples, max_batch):
    # Prepare: two copies of one model, one packed after compute, one streamed during it
    model = build_model(model_name, seed=0)
    twin = copy.deepcopy(model)
    x, y = _batch(samples)
    fmt = UpdateFormats(shard_tensor_names(model))("none")
    torch.manual_seed(0)  # MobileNetV2's dropout: the same masks in both computations
    packed = compute_shard(model, x, y, max_batch)
    wire, _ = fmt.encode(packed.tensors, None)
    metas, payload = pack(wire)

    update = StreamedUpdate(twin, fmt.metas())
    receiver = _Receiver(update)
    # the first layer's gradient is the last backward makes: by then the stream must have sent a
    # chunk (of later layers' gradients), or this waits out WAIT_S and the test fails
    def hold_the_last_gradient(param: torch.Tensor) -> None:
        if update._armed:
            receiver.first_chunk.wait(WAIT_S)

    next(twin.parameters()).register_post_accumulate_grad_hook(hold_the_last_gradient)

    # Execute
    update.start(receiver)
    torch.manual_seed(0)
    result = compute_shard(twin, x, y, max_batch, before_last_backward=update.arm)
    receiver.backward_done.set()
    update.complete(result.tensors)
    update.send_report(StepReport(samples=result.samples, loss=result.loss, correct=result.correct, compute_s=1.0))
    update.wait()

    # Assert
    assert update.metas == metas
    assert bytes(receiver.assembler.payload()) == bytes(payload)
    assert receiver.during_backward >= 1, "no chunk left while backward ran"
    assert receiver.report.samples == samples and receiver.report.upload_exposed_s >= 0.0
    assert [m.name for m in metas if m.name.startswith(GRAD_PREFIX)][-1] == GRAD_PREFIX + next(
        n for n, _ in model.named_parameters()), "gradients are not laid out last layer first"


def test_abandoned_update_ends_the_stream_without_a_report():
    # Prepare
    model = build_model("small_cnn", seed=0)
    fmt = UpdateFormats(shard_tensor_names(model))("none")
    update = StreamedUpdate(model, fmt.metas())
    outcome: list[BaseException] = []

    def send(u: StreamedUpdate) -> None:
        try:
            for _ in u.chunks(0, CHUNK):
                pass
            u.report()
        except UploadAbandoned as e:
            outcome.append(e)
            raise

    # Execute: abandoned before any gradient exists
    update.start(send)
    update.abandon()

    # Assert
    with pytest.raises(UploadAbandoned):
        update.wait()
    assert len(outcome) == 1
    assert update.abandoned


def test_only_float32_layouts_stream():
    model = build_model("small_cnn", seed=0)
    metas = UpdateFormats(shard_tensor_names(model))("fp16").metas()
    with pytest.raises(ValueError, match="float32"):
        StreamedUpdate(model, metas)


@pytest.mark.parametrize(("mode", "expected"), [("on", True), ("off", False)])
def test_on_and_off_ignore_what_uploads_measured(mode, expected):
    choice = StreamChoice(mode, cores=1.0)
    assert choice.stream() is expected
    choice.observe(streamed=False, wall_s=2.0, cpu_s=0.01)      # link-bound
    assert choice.stream() is expected
    choice.observe(streamed=False, wall_s=2.0, cpu_s=2.0)       # CPU-bound
    assert choice.stream() is expected


def test_auto_streams_while_uploads_wait_on_the_link():
    choice = StreamChoice("auto", cores=0.2)    # an emulated board at 0.2 of a core
    assert not choice.stream()                  # nothing measured yet: whole updates
    # CPU-bound: the process used all of its 0.2 core during the 0.5 s upload
    choice.observe(streamed=False, wall_s=0.5, cpu_s=0.1)
    assert choice.link_bound is False and not choice.stream()
    # link-bound: the same board, a slow link: 4 s for 0.1 s of CPU (an eighth of its 0.8 CPU-seconds)
    choice.observe(streamed=False, wall_s=4.0, cpu_s=0.1)
    assert choice.link_bound is True and choice.stream()
    # it streams for RECHECK_EVERY updates, then sends one whole to measure the link again
    for _ in range(StreamChoice.RECHECK_EVERY - 1):
        choice.observe(streamed=True, wall_s=0.01, cpu_s=0.01)
        assert choice.stream()
    choice.observe(streamed=True, wall_s=0.01, cpu_s=0.01)
    assert not choice.stream()
    choice.observe(streamed=False, wall_s=0.5, cpu_s=0.1)   # the link got faster: CPU-bound again
    assert not choice.stream()


def test_auto_counts_all_of_a_boards_cores():
    # 0.3 s of CPU in a 0.4 s upload: CPU-bound on one core, link-bound on four (0.3 of 1.6 s)
    one, four = StreamChoice("auto", cores=1), StreamChoice("auto", cores=4)
    for choice in (one, four):
        choice.observe(streamed=False, wall_s=0.4, cpu_s=0.3)
    assert not one.stream() and four.stream()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="on, off or auto"):
        StreamChoice("sometimes", cores=1)
