"""A shard computed while its parameters arrive (edge_client.arriving) is the shard computed after
they arrived, bit for bit; each block waits for its own parameters only, and a broken download
ends the compute with the download's error.

The download here stands for the board's connection: it fills the bundle's buffer in two parts
and says how far it is, as transport.receive_bundle does; bytes past that point are still zero.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import wait_for

from edge_client.arriving import ArrivingParameters
from edgetrain.models import build_model
from edgetrain.streaming import TensorMeta, TransferError
from edgetrain.tensors import pack, unpack
from edgetrain.training import compute_shard, load_state_tensors, state_tensors

WAIT_S = 60.0
"""How long the download waits for the forward pass to reach a block (only a failure waits it out)."""


def served_state(model_name: str) -> tuple[list[TensorMeta], bytes]:
    """What a coordinator serves: another initialisation, its BatchNorm statistics moved by a pass."""
    source = build_model(model_name, seed=1)
    source.train()
    with torch.no_grad():
        source(torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2)))
    metas, payload = pack(state_tensors(source))
    return metas, bytes(payload)


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def end_of(metas: list[TensorMeta], prefix: str) -> int:
    """The byte after the last tensor whose name starts with `prefix`."""
    return max(m.offset + m.nbytes for m in metas if m.name.startswith(prefix))


@pytest.mark.parametrize("max_batch", [0, 8])
def test_a_shard_computed_while_its_parameters_arrive_equals_the_shard_computed_after(max_batch: int) -> None:
    # Prepare: MobileNetV2 (BatchNorm) and the bundle a coordinator would serve; the reference
    # board loads all of it, then computes (in chunks of 8 samples, or all 20 at once)
    metas, payload = served_state("mobilenet_v2")
    x, y = batch(20)
    reference = build_model("mobilenet_v2", seed=0)
    load_state_tensors(reference, unpack(metas, bytearray(payload)))
    torch.manual_seed(4)  # MobileNetV2's dropout draws the same masks in both
    expected = compute_shard(reference, x, y, max_batch)

    # the streamed board's download delivers the buffers and the first block, then waits until the
    # forward pass, having run the first block, waits for the second block's parameters, and only
    # then delivers the rest (bytes it has not delivered are zeros meanwhile)
    model = build_model("mobilenet_v2", seed=0)
    first, second = list(model.blocks)[:2]
    first_part, second_part = end_of(metas, f"blocks.{first}."), end_of(metas, f"blocks.{second}.")
    assert 0 < first_part < len(payload) // 10  # the buffers and the first block are a small head
    ran_first = threading.Event()
    model.blocks[first].register_forward_hook(lambda *_: ran_first.set())
    arriving: list[ArrivingParameters] = []

    def download(version: int, on_progress):
        assert version == 7
        buffer = bytearray(len(payload))
        buffer[:first_part] = payload[:first_part]
        on_progress(metas, buffer, first_part)
        wait_for(lambda: ran_first.is_set() and arriving[0].awaited == second_part, WAIT_S,
                 "the forward pass to run the first block and wait for the second's parameters", interval_s=0.01)
        buffer[first_part:] = payload[first_part:]
        on_progress(metas, buffer, len(buffer))
        return metas, buffer

    # Execute
    hooks_before = {k: len(b._forward_pre_hooks) for k, b in model.blocks.items()}
    arriving.append(ArrivingParameters(model, download, 7))
    arriving[0].start()
    torch.manual_seed(4)
    result = compute_shard(model, x, y, max_batch)
    got_metas, got_payload = arriving[0].finish()

    # Assert: the same gradients, statistics, loss and model state, bit for bit; the whole bundle
    assert (got_metas, bytes(got_payload)) == (metas, payload)
    assert result.tensors.keys() == expected.tensors.keys()
    for name, tensor in expected.tensors.items():
        assert torch.equal(result.tensors[name], tensor), name
    assert (result.loss, result.correct) == (expected.loss, expected.correct)
    for name, tensor in state_tensors(reference).items():
        assert torch.equal(state_tensors(model)[name], tensor), name
    assert arriving[0].waited_s > 0 and arriving[0].awaited is None
    assert {k: len(b._forward_pre_hooks) for k, b in model.blocks.items()} == hooks_before  # unhooked


def test_a_download_that_breaks_ends_the_compute_with_its_error() -> None:
    # Prepare: the download delivers the first block, then fails
    metas, payload = served_state("small_cnn")
    model = build_model("small_cnn", seed=0)
    first_part = end_of(metas, f"blocks.{list(model.blocks)[0]}.")

    def download(version: int, on_progress):
        buffer = bytearray(len(payload))
        buffer[:first_part] = payload[:first_part]
        on_progress(metas, buffer, first_part)
        raise TransferError("data_loss", "stream ended at byte 12; resume from byte 12")

    # Execute and assert: the forward pass raises the download's error instead of waiting forever
    arriving = ArrivingParameters(model, download, 1)
    arriving.start()
    x, y = batch(4)
    with pytest.raises(TransferError, match="stream ended at byte 12"):
        compute_shard(model, x, y)
    arriving.close()
    assert all(not block._forward_pre_hooks for block in model.blocks.values())


def test_a_download_that_breaks_after_its_last_byte_fails_the_step_with_its_error() -> None:
    # Prepare: every byte arrives (so every block loads and the forward pass runs to the end), then
    # the stream breaks before the call ends, as when the coordinator is killed at that moment
    metas, payload = served_state("small_cnn")
    model = build_model("small_cnn", seed=0)
    computed = threading.Event()

    def download(version: int, on_progress):
        on_progress(metas, bytearray(payload), len(payload))
        computed.wait(WAIT_S)  # the call is still retrying while the board computes
        raise TransferError("data_loss", "the coordinator went away")

    # Execute
    arriving = ArrivingParameters(model, download, 1)
    arriving.start()
    compute_shard(model, *batch(4))
    computed.set()

    # Assert: finishing raises the download's own error (a board then treats it as any broken
    # download), and no hook is left on the model
    with pytest.raises(TransferError, match="the coordinator went away"):
        arriving.finish()
    assert all(not block._forward_pre_hooks for block in model.blocks.values())


def test_parameters_that_do_not_fit_the_model_are_refused_naming_the_tensor() -> None:
    # Prepare: a bundle with one tensor of the wrong shape
    metas, payload = served_state("small_cnn")
    bad = [TensorMeta(m.name, m.dtype, (1, *m.shape), m.offset, m.nbytes) if i == len(metas) - 1 else m
           for i, m in enumerate(metas)]
    model = build_model("small_cnn", seed=0)

    def download(version: int, on_progress):
        on_progress(bad, bytearray(payload), len(payload))
        return bad, bytearray(payload)

    # Execute and assert
    arriving = ArrivingParameters(model, download, 1)
    arriving.start()
    with pytest.raises(TransferError, match=f"tensor '{metas[-1].name}' shape"):
        compute_shard(model, *batch(4))
    arriving.close()
