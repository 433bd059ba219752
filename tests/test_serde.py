"""Serde pairs: every core object survives the wire unchanged, and a malformed message is refused.

Round trips go through serialized bytes, as a peer sees them. A refusal is a ValueError (a
TransferError of kind invalid_argument for bundle headers), which servers answer with
INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from edgetrain import serde
from edgetrain.catalog import DatasetSpec
from edgetrain.errors import FailureKind
from edgetrain.streaming import WIRE_DTYPES, TransferError
from edgetrain.telemetry import TelemetrySample
from edgetrain.tensors import DTYPES, bundle_metas
from edgetrain.work import (
    Assignment,
    BoardJob,
    BoardProfile,
    Finished,
    LocalWork,
    StageHost,
    StageWork,
    StateRequest,
    StepReport,
)
from protos import coordinator_pb2 as pb
from protos import stage_pb2 as spb
from protos import tensor_pb2 as tpb

STAGE = StageWork(
    pipeline=1, stage=1, stages=3, first_block=1, end_block=3, schedule="1f1b", indices=(40, 41, 42, 43, 44),
    microbatch_sizes=(3, 2),
    hosts=(StageHost("b-2", "10.0.0.2:7001", ((0, 2), (0, 1)), "board-two"),
           StageHost("b-3", "10.0.0.3:7001", ((2, 3), (1, 2)), "board-three")),
    prev_hosts=(StageHost("b-1", "10.0.0.1:7001", ((0, 3), (0, 2)), "board-one"),),
    next_hosts=(StageHost("b-4", "10.0.0.4:7001", ((0, 3), (0, 2)), "board-four"),),
    pipeline_samples=5, timeout_s=12.5, owned=True, lr=0.05, commit_step=6, commit_attempt=1)
DP = Assignment(step=7, attempt=2, param_version=7, indices=(3, 1, 4, 1, 5), augment=True, data_seed=11,
                codec="topk:0.05", delta_codec="int8")
LOCAL = LocalWork(steps=4, batch_size=8, lr=0.1, momentum=0.9, weight_decay=5e-4, prox_mu=0.01)


def _wire(message):
    """`message` as the peer parses it from the bytes on the wire."""
    return type(message).FromString(message.SerializeToString())


# --- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("work", [
    pytest.param(DP, id="data-parallel"),
    pytest.param(replace(DP, local=LOCAL, codec="none", delta_codec=""), id="federated"),
    pytest.param(replace(DP, stage=STAGE, codec="none", delta_codec=""), id="pipeline-stage"),
    pytest.param(Finished("all 6 steps done"), id="finished"),
    pytest.param(None, id="idle"),
])
def test_work_survives_the_wire(work):
    # Execute
    message = _wire(serde.work_to_proto(work))

    # Assert
    assert serde.work_from_proto(message) == work
    kind = {Assignment: "step", Finished: "finished", type(None): "idle"}[type(work)]
    assert message.WhichOneof("work") == kind


@pytest.mark.parametrize("report", [
    pytest.param(StepReport(samples=24, loss=2.25, correct=5, compute_s=0.75, download_s=0.125, encode_s=0.0625,
                            energy_j=3.5, wait_s=0.25, peak_activation_bytes=1 << 20, peer_bytes=4096),
                 id="with-energy"),
    pytest.param(StepReport(samples=24, loss=2.25, correct=5, compute_s=0.75, upload_exposed_s=0.03125,
                            download_overlap_s=0.5, download_streamed=True), id="streamed-download"),
    pytest.param(StepReport(samples=24, loss=2.25, correct=5, compute_s=0.75), id="energy-unknown"),
    pytest.param(StepReport(samples=24, loss=2.25, correct=5, compute_s=0.75, energy_j=0.0), id="zero-energy"),
])
def test_step_report_survives_the_wire_and_unknown_energy_stays_unknown(report):
    # Execute
    message = _wire(serde.step_report_to_proto(report))

    # Assert
    assert serde.step_report_from_proto(message) == report
    assert message.HasField("energy_j") == (report.energy_j is not None)


def test_board_job_survives_the_wire_but_its_data_directory_stays_the_boards():
    # Prepare
    dataset = DatasetSpec(name="synthetic", data_dir="/srv/coordinator-data", seed=3, train_size=512,
                          test_size=None, augment=False)
    job = BoardJob(job_id="j-1", model="small_cnn", num_classes=10, dataset=dataset, profile_batch_sizes=(3, 12),
                   heartbeat_interval_s=0.5, chunk_bytes=4096, max_forward_batch=32, error_feedback=True,
                   board_momentum=0.9)

    # Execute
    received = serde.board_job_from_proto(_wire(serde.board_job_to_proto(job)))

    # Assert
    assert received == replace(job, dataset=replace(dataset, data_dir=DatasetSpec.data_dir))


@pytest.mark.parametrize(("sent", "taken"), [("on", "on"), ("auto", "auto"), ("off", "off"), ("", "off"),
                                             ("sometimes", "off")])
@pytest.mark.parametrize("key", ["stream_upload", "stream_download"])
def test_a_stream_mode_the_board_does_not_know_counts_as_off(sent, taken, key):
    dataset = DatasetSpec(name="synthetic", seed=3, train_size=512, test_size=None, augment=False)
    job = BoardJob(job_id="j-1", model="small_cnn", num_classes=10, dataset=dataset, profile_batch_sizes=(3,),
                   heartbeat_interval_s=0.5, chunk_bytes=4096, max_forward_batch=32, error_feedback=True,
                   board_momentum=0.0)
    message = serde.board_job_to_proto(job)
    setattr(message, key, sent)
    assert getattr(serde.board_job_from_proto(_wire(message)), key) == taken


def test_board_profile_survives_the_wire_with_its_device():
    # Prepare
    profile = BoardProfile(((3, 0.015), (12, 0.0425)), memory_total_bytes=2**31, memory_available_bytes=2**30,
                           peak_rss_bytes=3 << 27)

    # Execute
    message = _wire(serde.profile_to_proto("board-7", profile))

    # Assert
    assert message.device_id == "board-7"
    assert serde.profile_from_proto(message) == profile


def test_state_request_survives_the_wire():
    # Prepare
    request = StateRequest(job_id="j-1", first_block=1, end_block=3, version=9, commit_step=8, commit_attempt=2,
                           supersede_attempt=1, momentum=0.9, weight_decay=5e-4, nesterov=True, release=True,
                           offset=4096)

    # Execute
    received = serde.state_request_from_proto(_wire(serde.state_request_to_proto(request)))

    # Assert
    assert received == request


def test_telemetry_keeps_what_the_board_knows_including_falsy_values_and_nothing_else():
    # Prepare: zero and False are values a board reported, not unknowns
    sample = TelemetrySample(timestamp=1_700_000_000.5, cpu_percent=0.0, battery_charging=False, plugged=False,
                             energy_j=0.0, link_mbit_per_s=12.5, memory_used_bytes=0)

    # Execute
    received = serde.telemetry_from_proto(_wire(serde.telemetry_to_proto(sample)))

    # Assert
    assert received == sample
    assert received.battery_percent is None and received.temperature_c is None and received.rtt_ms is None


def test_an_empty_telemetry_message_is_a_sample_with_every_value_unknown():
    assert serde.telemetry_from_proto(pb.Telemetry(timestamp=5.0)) == TelemetrySample(timestamp=5.0)


@given(st.lists(st.tuples(st.sampled_from(WIRE_DTYPES), st.lists(st.integers(0, 5), max_size=3)), max_size=6))
def test_a_bundle_header_survives_the_wire(tensors):
    # Prepare
    metas = bundle_metas({f"t{i}": torch.empty(shape, dtype=DTYPES[dtype]) for i, (dtype, shape) in enumerate(tensors)})

    # Execute
    received, total = serde.header_from_proto(_wire(serde.header_to_proto(metas)))

    # Assert
    assert received == metas
    assert total == sum(m.nbytes for m in metas)


def test_failure_kinds_map_value_for_value():
    for kind in FailureKind:
        assert serde.failure_kind_from_proto(int(kind)) is kind


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("hosts", ["hosts", "prev_hosts", "next_hosts"])
def test_a_stage_host_whose_rows_do_not_match_the_micro_batches_is_refused(hosts):
    # Prepare: the first host of the list loses the rows of its second micro-batch
    message = serde.stage_work_to_proto(STAGE)
    host = getattr(message, hosts)[0]
    del host.row_begin[1], host.row_end[1]

    # Execute / Assert
    with pytest.raises(ValueError, match=rf"stage host '{host.device_id}': rows for 1 micro-batches, the stage has 2"):
        serde.stage_work_from_proto(message)


@pytest.mark.parametrize("fields", [
    pytest.param({"stage": 3}, id="stage-past-the-last"),
    pytest.param({"end_block": 1}, id="empty-block-range"),
    pytest.param({"first_block": 3, "end_block": 2}, id="reversed-block-range"),
    pytest.param({"microbatch_sizes": []}, id="no-micro-batches"),
    pytest.param({"hosts": []}, id="no-hosts"),
])
def test_work_that_does_not_describe_a_stage_is_refused(fields):
    # Prepare
    message = serde.stage_work_to_proto(STAGE)
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(message, name)[:]
        else:
            setattr(message, name, value)

    # Execute / Assert
    with pytest.raises(ValueError, match="does not describe a stage"):
        serde.work_from_proto(pb.WorkAssignment(step=pb.StepWork(step=1, stage=message)))


@pytest.mark.parametrize(("first", "end"), [(2, 2), (3, 1)])
def test_a_state_request_with_an_empty_block_range_is_refused(first, end):
    with pytest.raises(ValueError, match=rf"blocks \[{first}, {end}\) are an empty range"):
        serde.state_request_from_proto(spb.StateRequest(job_id="j", first_block=first, end_block=end))


@pytest.mark.parametrize("timing", ["compute_s", "download_s", "encode_s", "wait_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -0.5])
def test_a_report_with_a_timing_not_finite_and_non_negative_is_refused(timing, value):
    # Prepare
    message = pb.StepReport(samples=24, loss=2.0, correct=3, compute_s=0.5)
    setattr(message, timing, value)

    # Execute / Assert
    with pytest.raises(ValueError, match="step report timings must be finite and >= 0"):
        serde.step_report_from_proto(message)


@pytest.mark.parametrize("field_value", [
    pytest.param(("loss", math.nan), id="nan-loss"),
    pytest.param(("loss", math.inf), id="inf-loss"),
    pytest.param(("energy_j", math.nan), id="nan-energy"),
])
def test_a_report_with_a_non_finite_loss_or_energy_is_refused(field_value):
    # Prepare
    name, value = field_value
    message = pb.StepReport(samples=24, loss=2.0, correct=3, compute_s=0.5)
    setattr(message, name, value)

    # Execute / Assert
    with pytest.raises(ValueError):
        serde.step_report_from_proto(message)


@pytest.mark.parametrize("timings", [
    pytest.param([], id="none"),
    pytest.param([(0, 0.1)], id="zero-batch"),
    pytest.param([(4, 0.0)], id="zero-seconds"),
    pytest.param([(4, -0.1)], id="negative-seconds"),
    pytest.param([(4, math.nan)], id="nan-seconds"),
    pytest.param([(4, math.inf)], id="inf-seconds"),
    pytest.param([(4, 0.1), (8, math.nan)], id="one-bad-of-two"),
])
def test_a_profile_with_unusable_timings_is_refused(timings):
    # Prepare
    message = pb.ProfileReport(device_id="b-1", timings=[pb.BatchTiming(batch_size=b, seconds=s) for b, s in timings])

    # Execute / Assert
    with pytest.raises(ValueError, match="a profile needs timings with batch_size > 0 and finite seconds > 0"):
        serde.profile_from_proto(message)


@pytest.mark.parametrize("value", [len(FailureKind), 99])
def test_an_unknown_failure_kind_is_refused(value):
    with pytest.raises(ValueError, match=f"unknown failure kind {value}"):
        serde.failure_kind_from_proto(value)


def _spec(name: str, offset: int, nbytes: int, *, dtype: int = tpb.FLOAT32, shape=None) -> tpb.TensorSpec:
    return tpb.TensorSpec(name=name, dtype=dtype, shape=[nbytes // 4] if shape is None else shape, offset=offset,
                          nbytes=nbytes)


@pytest.mark.parametrize(("header", "fragment"), [
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8), _spec("b", 12, 8)], total_bytes=20),
                 "tensor 'b': offset 12, expected 8", id="gap"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8), _spec("b", 4, 8)], total_bytes=12),
                 "tensor 'b': offset 4, expected 8", id="overlap"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 4, 8)], total_bytes=12),
                 "tensor 'a': offset 4, expected 0", id="not-from-zero"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8)], total_bytes=16),
                 "bundle declares 16 bytes, tensors cover 8", id="total-too-large"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8)], total_bytes=4),
                 "bundle declares 4 bytes, tensors cover 8", id="total-too-small"),
    pytest.param(tpb.BundleHeader(total_bytes=4), "bundle declares 4 bytes, tensors cover 0", id="no-tensors"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8, dtype=tpb.DTYPE_UNSPECIFIED)], total_bytes=8),
                 "tensor 'a': unknown dtype 0", id="unspecified-dtype"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8, dtype=42)], total_bytes=8),
                 "tensor 'a': unknown dtype 42", id="unknown-dtype"),
    pytest.param(tpb.BundleHeader(tensors=[_spec("a", 0, 8, shape=[2, -1])], total_bytes=8),
                 "tensor 'a': negative dimension", id="negative-dimension"),
])
def test_an_inconsistent_bundle_header_is_refused(header, fragment):
    # Execute
    with pytest.raises(TransferError) as caught:
        serde.header_from_proto(_wire(header))

    # Assert
    assert caught.value.kind == "invalid_argument"
    assert fragment in str(caught.value)


@pytest.mark.parametrize(("dtype", "shape", "nbytes"), [
    pytest.param(tpb.FLOAT32, [2, 3], 4, id="fewer-bytes-than-the-shape"),
    pytest.param(tpb.FLOAT32, [2], 16, id="more-bytes-than-the-shape"),
    pytest.param(tpb.INT64, [3], 12, id="bytes-of-another-dtype"),
])
def test_a_tensor_whose_bytes_do_not_match_its_shape_and_dtype_is_refused(dtype, shape, nbytes):
    # Prepare
    header = tpb.BundleHeader(tensors=[_spec("w", 0, nbytes, dtype=dtype, shape=shape)], total_bytes=nbytes)

    # Execute
    with pytest.raises(TransferError) as caught:
        serde.header_from_proto(header)

    # Assert
    assert caught.value.kind == "invalid_argument"
