"""Aggregation rules, screening, per-board codec choice and the parameter deltas, without sockets."""

from __future__ import annotations

import pytest
import torch

from coordinator.training.aggregator import Weighted, combine, screen, staleness_weight, update_norm
from coordinator.training.codec_policy import CodecPolicy
from coordinator.training.parameters import ParameterStore
from coordinator.training.steps import Contribution, StepBoard, StepError
from edgetrain.config import CompressionConfig
from edgetrain.models import build_model
from edgetrain.tensors import pack, unpack
from edgetrain.training import shard_tensor_names, state_tensors
from edgetrain.updates import DeltaFormat, UpdateFormats
from edgetrain.work import Assignment, StepReport


def contribution(device: str, samples: int, grad: torch.Tensor, *, version: int = 0,
                 buffer: torch.Tensor | None = None) -> Contribution:
    tensors = {"grad.w": grad.clone()}
    if buffer is not None:
        tensors["buf.b"] = buffer.clone()
    return Contribution(device_id=device, samples=samples, loss=1.0, correct=0, compute_s=0.1, download_s=0.0,
                        encode_s=0.0, upload_s=0.0, tensors=tensors, param_version=version)


# --- staleness ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tau", "exponent", "want"), [(0, 0.5, 1.0), (3, 0.5, 0.5), (1, 1.0, 0.5), (8, 0.0, 1.0)])
def test_staleness_weight_is_one_over_one_plus_tau_to_the_p(tau, exponent, want):
    assert staleness_weight(tau, exponent) == pytest.approx(want)


def test_staleness_weight_refuses_negative_staleness():
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1, 0.5)


def test_fresh_updates_combine_to_the_sample_weighted_mean():
    # Prepare
    a = contribution("a", 3, torch.tensor([1.0, 0.0]), buffer=torch.tensor([2.0]))
    b = contribution("b", 1, torch.tensor([0.0, 4.0]), buffer=torch.tensor([6.0]))

    # Execute
    out = combine([a, b])

    # Assert
    assert torch.allclose(out["grad.w"], torch.tensor([0.75, 1.0]))
    assert torch.allclose(out["buf.b"], torch.tensor([3.0]))


def test_a_stale_update_is_down_weighted_but_buffers_stay_an_average():
    # Prepare: b is 3 steps late, s(3) = 0.5 with p = 0.5
    a = contribution("a", 2, torch.tensor([1.0]), buffer=torch.tensor([0.0]))
    b = contribution("b", 2, torch.tensor([1.0]), buffer=torch.tensor([3.0]))

    # Execute
    out = combine([Weighted(a), Weighted(b, 3, staleness_weight(3, 0.5))])

    # Assert: gradient (2*1 + 2*0.5*1) / 4; buffer (2*0 + 1*3) / 3
    assert out["grad.w"].item() == pytest.approx(0.75)
    assert out["buf.b"].item() == pytest.approx(1.0)


# --- screening ------------------------------------------------------------------------------------

def test_outlier_is_rejected_with_its_norm_and_the_median():
    # Prepare
    updates = [contribution(d, 4, torch.full((10,), v)) for d, v in (("a", 1.0), ("b", 1.1), ("c", 0.9), ("d", 50.0))]

    # Execute
    result = screen(updates, outlier_factor=5.0)

    # Assert
    assert [c.device_id for c in result.kept] == ["a", "b", "c"]
    assert set(result.rejected) == {"d"}
    assert result.rejected["d"].startswith("outlier: update norm 158.1 is")
    assert "median" in result.rejected["d"] and "limit 5x" in result.rejected["d"]


def test_outliers_need_three_updates_to_be_judged():
    updates = [contribution("a", 4, torch.ones(4)), contribution("b", 4, torch.full((4,), 100.0))]
    assert not screen(updates, outlier_factor=5.0).rejected


def test_clipping_scales_an_update_to_the_norm_limit():
    # Prepare
    big = contribution("a", 4, torch.full((4,), 3.0))  # norm 6

    # Execute
    result = screen([big], clip_norm=1.5)

    # Assert
    assert result.clipped == {"a": pytest.approx(6.0)}
    assert update_norm(result.kept[0]) == pytest.approx(1.5)


# --- step board: late tickets under bounded staleness ---------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _board(clock) -> tuple[StepBoard, UpdateFormats]:
    model = build_model("small_cnn", seed=0)
    formats = UpdateFormats(shard_tensor_names(model))
    return StepBoard(formats, model.block_names, clock=clock), formats


def _upload(board: StepBoard, formats: UpdateFormats, device: str, step: int, samples: int) -> None:
    fmt = formats("none")
    wire = {m.name: torch.zeros(m.shape) for m in fmt.metas()}
    metas, payload = pack(wire)
    report = StepReport(samples=samples, loss=1.0, correct=0, compute_s=0.1)
    assembler = board.begin_upload(device, step, 0, metas, report, 0)
    assembler.add(0, bytes(payload), __import__("zlib").crc32(bytes(payload)))
    board.complete_upload(device, step, 0)


def _assign(step: int, device_indices: dict[str, int]) -> dict[str, Assignment]:
    return {d: Assignment(step, 0, step, tuple(range(n)), False, 0) for d, n in device_indices.items()}


def test_a_late_ticket_stays_open_and_its_update_arrives_with_its_version():
    # Prepare: step 0 for fast and slow; only fast answers before the deadline
    clock = Clock()
    board, formats = _board(clock)
    board.open_attempt(_assign(0, {"fast": 4, "slow": 2}))
    _upload(board, formats, "fast", 0, 4)

    # Execute
    outcome = board.wait_attempt(0, 0, deadline=0.0, is_alive=lambda d: True, keep_late=True)
    busy = board.busy()
    board.open_attempt(_assign(1, {"fast": 6}))
    _upload(board, formats, "slow", 0, 2)
    late, rejected = board.take_late(oldest_step=0)

    # Assert
    assert set(outcome.accepted) == {"fast"} and outcome.late == ["slow"] and outcome.missing == []
    assert busy == {"slow"}
    assert [(c.device_id, c.param_version, c.samples) for c in late] == [("slow", 0, 2)]
    assert rejected == {}
    with pytest.raises(StepError, match="step 0 attempt 0 is closed"):
        _upload(board, formats, "slow", 0, 2)


def test_a_ticket_past_the_staleness_bound_is_closed_and_refuses_its_upload():
    # Prepare
    clock = Clock()
    board, formats = _board(clock)
    board.open_attempt(_assign(0, {"slow": 2}))
    board.wait_attempt(0, 0, deadline=0.0, is_alive=lambda d: True, keep_late=True)

    # Execute: by step 3 with bound 2, tickets of step 0 are too old
    late, _ = board.take_late(oldest_step=1)

    # Assert
    assert late == [] and board.busy() == set()
    with pytest.raises(StepError, match="step 0 attempt 0 is closed"):
        _upload(board, formats, "slow", 0, 2)


def test_without_keep_late_an_unanswered_ticket_is_missing_and_closed():
    clock = Clock()
    board, _ = _board(clock)
    board.open_attempt(_assign(0, {"slow": 2}))
    outcome = board.wait_attempt(0, 0, deadline=0.0, is_alive=lambda d: True)
    assert outcome.missing == ["slow"] and outcome.late == [] and board.busy() == set()


# --- codec choice -----------------------------------------------------------------------------------

def _policy(**cfg) -> CodecPolicy:
    sizes = {"none": 9_000_000, "fp16": 4_500_000, "int8": 2_250_000, "powersgd:4": 750_000, "topk:0.01": 180_000}
    return CodecPolicy(CompressionConfig(uplink="adaptive", downlink="int8", **cfg), lambda c: sizes[c],
                       full_bytes=9_000_000, delta_bytes=2_250_000)


@pytest.mark.parametrize(("mbit", "want"), [(10_000, "none"), (400, "fp16"), (160, "int8"), (60, "int8"),
                                            (30, "powersgd:4"), (20, "topk:0.01")])
def test_adaptive_picks_the_least_lossy_codec_that_fits_the_budget(mbit, want):
    # budget: 0.25 x 1.0 s compute, limit 1.0 s; none moves 18 MB, fp16 6.75 MB, int8 4.5 MB,
    # PowerSGD 3 MB, top-k 2.43 MB per step (60 Mbit/s: int8 takes 0.6 s, over budget, within the
    # limit; 30 Mbit/s: int8 1.2 s, PowerSGD 0.8 s; 20 Mbit/s: PowerSGD 1.2 s, top-k the fewest bytes)
    choice = _policy().choose("a", mbit, compute_s=1.0)
    assert choice.codec == want
    assert choice.delta_codec == ("" if want == "none" else "int8")


def test_adaptive_keeps_its_choice_within_the_hysteresis_band_and_switches_beyond_it():
    # Prepare
    policy = _policy(hysteresis=0.3)
    first = policy.choose("a", 250, compute_s=1.0).codec

    # Execute
    jitter = [policy.choose("a", mbit, compute_s=1.0).codec for mbit in (200, 300, 180)]
    dropped = policy.choose("a", 20, compute_s=1.0).codec

    # Assert: 200 or 180 would choose int8 on their own, but are within 30% of 250
    assert first == "fp16" and jitter == ["fp16"] * 3 and dropped == "topk:0.01"


def test_fixed_codecs_ignore_bandwidth():
    policy = CodecPolicy(CompressionConfig(uplink="int8", downlink="fp16"), lambda c: 1, 1, 1)
    assert policy.choose("a", 1.0, 1.0).codec == "int8" and policy.choose("a", None, 1.0).delta_codec == "fp16"


def test_without_a_bandwidth_measurement_adaptive_starts_uncompressed():
    assert _policy().choose("a", None, compute_s=1.0).codec == "none"


# --- parameter deltas -------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["int8", "fp16", "topk:0.05"])
def test_a_board_rebuilds_the_served_view_bit_exactly_from_chained_deltas(codec):
    # Prepare: a model whose parameters drift over 6 versions; the board holds version 1
    torch.manual_seed(0)
    model = build_model("small_cnn", seed=0)
    store = ParameterStore(codec, keep=8)
    board_view = None
    for version in range(7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        store.publish(version, state_tensors(model))
        if version == 1:
            metas, payload = store.full(1)
            board_view = {n: t.clone() for n, t in unpack(metas, bytearray(payload)).items()}

    # Execute
    metas, payload = store.deltas(1, 6)
    fmt = DeltaFormat(state_tensors(model), codec)
    fmt.apply_chain(board_view, 1, 6, unpack(metas, bytearray(payload)))
    served = unpack(*store.full(6))

    # Assert: identical bits, and the view tracks the master within the codec's error
    assert [m.name for m in metas] == [m.name for m in fmt.chain_metas(1, 6)]
    for name, tensor in served.items():
        assert torch.equal(board_view[name], tensor), name
    master = state_tensors(model)
    drift = max(float((master[n] - served[n]).abs().max()) for n in master if master[n].is_floating_point())
    assert drift < 0.05
    full_bytes = sum(t.numel() * t.element_size() for t in master.values())
    assert len(payload) < 5 * full_bytes * (0.6 if codec == "fp16" else 0.3)


def test_deltas_no_longer_kept_are_failed_precondition():
    model = build_model("small_cnn", seed=0)
    store = ParameterStore("int8", keep=2)
    for version in range(5):
        store.publish(version, state_tensors(model))
    with pytest.raises(StepError, match="deltas from version 1 to 4 are not kept") as caught:
        store.deltas(1, 4)
    assert caught.value.kind == "failed_precondition"
    store.deltas(2, 4)


def test_with_downlink_none_the_served_parameters_are_the_masters():
    model = build_model("small_cnn", seed=0)
    store = ParameterStore("none")
    store.publish(0, state_tensors(model))
    served = unpack(*store.full(0))
    assert all(torch.equal(served[n], t) for n, t in state_tensors(model).items())
    with pytest.raises(StepError, match="sends full parameters"):
        store.deltas(0, 0)


def test_update_formats_shrink_the_update_by_the_codec_factor():
    model = build_model("mobilenet_v2", seed=0)
    formats = UpdateFormats(shard_tensor_names(model))
    dense = formats("none").wire_bytes()
    ratios = {c: formats(c).wire_bytes() / dense for c in ("fp16", "int8", "topk:0.01")}
    assert 0.49 < ratios["fp16"] < 0.53
    assert 0.24 < ratios["int8"] < 0.28
    assert ratios["topk:0.01"] < 0.06  # small tensors and BN statistics travel dense


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk:0.01"])
def test_a_model_with_batchnorm_encodes_and_commits_its_error_feedback(codec):
    # Prepare: MobileNetV2's update has BN running statistics next to the gradients
    from edgetrain.compression import ErrorFeedback

    model = build_model("mobilenet_v2", seed=0)
    fmt = UpdateFormats(shard_tensor_names(model))(codec)
    tensors = {n: torch.randn_like(t) for n, t in shard_tensor_names(model)}
    feedback = ErrorFeedback()

    # Execute
    wire, commit = fmt.encode(tensors, feedback)
    commit()
    decoded = fmt.decode(wire)

    # Assert: the buffers travel dense and exactly; the residual is what the codec did not send
    assert [m.name for m in fmt.metas()] == list(wire)
    for name, tensor in tensors.items():
        if name.startswith("buf."):
            assert torch.equal(decoded[name], tensor)
    assert feedback.norm() > 0


def test_two_updates_of_one_board_in_a_step_are_each_judged_on_their_own_norm():
    # A late update and a fresh one from board "a" (staleness rule), beside two ordinary ones
    late = contribution("a", 4, torch.tensor([1.0]), version=0)
    fresh = contribution("a", 4, torch.tensor([100.0]), version=2)
    others = [contribution("b", 4, torch.tensor([1.0])), contribution("c", 4, torch.tensor([1.2]))]

    screening = screen([late, fresh, *others], outlier_factor=5.0)

    assert fresh not in screening.kept and late in screening.kept
    assert "outlier" in screening.rejected["a"]
