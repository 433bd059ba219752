"""Pipeline plans: validation of the YAML, one step's assignments, merging a pipeline's results."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from coordinator.training.pipeline_work import (
    Host,
    assign,
    check_covers,
    merge_pipelines,
    missing_boards,
)
from coordinator.training.steps import Contribution
from edgetrain.config import ConfigError, PipelineConfig, job_from_dict, load_plan
from edgetrain.models import build_model
from edgetrain.split import SpeedEstimate

PLAN = {"stages": [{"blocks": 1, "boards": ["a"]}, {"blocks": 2, "boards": ["b", "c"]}, {"blocks": 1, "boards": ["d"]}],
        "microbatches": 3}


def settings(**extra) -> PipelineConfig:
    return job_from_dict({"model": "small_cnn", "pipeline": {**PLAN, **extra}}).pipeline


def plan(**extra):
    return settings(**extra).plan()


@pytest.mark.parametrize(("pipeline", "message"), [
    ({"stages": [{"blocks": 2, "boards": "a"}]}, "stages[0].boards='a': must be a non-empty list of board names"),
    ({"stages": [{"blocks": 0, "boards": ["a"]}]}, "stages[0].blocks=0: must be an integer >= 1"),
    ({"stages": [{"blocks": 2, "boards": ["a"]}, {"blocks": 2, "boards": ["a"]}]}, "a board can host only one"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "schedule": "zigzag"}, "schedule='zigzag'"),
    ({"stages": [{"blocks": 4, "boards": ["a"], "speed": 2}]}, "stages[0].speed=2: unknown key"),
])
def test_bad_pipeline_sections_name_the_key(pipeline, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        job_from_dict({"model": "small_cnn", "pipeline": pipeline})


@pytest.mark.parametrize(("job", "message"), [
    ({"aggregation": {"rule": "staleness"}}, "stage hosts apply their own gradients"),
    ({"aggregation": {"clip_norm": 5.0}}, "stage hosts apply their own gradients"),
    ({"planner": {"enabled": True}}, "leave pipeline.stages and pipeline.plan_file empty"),
    ({"pipeline": {"stage_state": "board"}}, "stage_state='board'"),
    ({"pipeline": {"sync_every": 0}}, "sync_every=0"),
])
def test_pipeline_jobs_refuse_settings_that_do_not_fit_together(job, message):
    data = {"model": "small_cnn", "pipeline": dict(PLAN), **job}
    data["pipeline"] = {**PLAN, **job.get("pipeline", {})}
    with pytest.raises(ConfigError, match=re.escape(message)):
        job_from_dict(data)
    if "aggregation" in job:  # with the coordinator keeping stage state, the same job is fine
        job_from_dict({**data, "pipeline": {**data["pipeline"], "stage_state": "coordinator"}})


def test_federated_rounds_refuse_a_pipeline():
    with pytest.raises(ConfigError, match="federated rounds train the whole model on each board"):
        job_from_dict({"model": "small_cnn", "aggregation": {"rule": "fedavg"},
                       "pipeline": {**PLAN, "stage_state": "coordinator"}})


def test_a_plan_must_cover_the_models_blocks_exactly():
    with pytest.raises(ValueError, match="sum to 5, but the model has 4 blocks"):
        check_covers(plan(stages=[{"blocks": 3, "boards": ["a"]}, {"blocks": 2, "boards": ["b"]}]),
                     build_model("small_cnn").block_names)


def test_a_plan_file_with_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("stages: [blocks: 1\n")
    with pytest.raises(ConfigError, match="plan.yaml: not valid YAML"):
        load_plan(path)


def test_a_plan_file_holds_only_the_plan_and_loads_into_the_same_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(PLAN))
    assert load_plan(path) == plan()
    path.write_text(yaml.safe_dump({**PLAN, "stage_timeout_s": 5}))
    with pytest.raises(ConfigError, match=re.escape("plan.yaml: stage_timeout_s=5: unknown key")):
        load_plan(path)


def _hosts(speeds: dict[str, float]) -> dict[str, Host]:
    return {n: Host(f"{n}-1", f"127.0.0.1:{5000 + i}", SpeedEstimate(0.0, v)) for i, (n, v) in enumerate(speeds.items())}


def test_assignments_split_micro_batches_between_a_stage_group_by_speed():
    # Prepare
    hosts = _hosts({"a": 10, "b": 30, "c": 10, "d": 10})

    # Execute
    out = assign(plan(), settings(), step=3, attempt=0, indices=list(range(100, 124)), block_names=["c1", "c2", "c3", "head"],
                 hosts=hosts, augment=False, data_seed=0)

    # Assert: 24 samples in micro-batches of 8; b gets 3/4 of every micro-batch of stage 1
    a, b, c, d = (out[f"{n}-1"] for n in "abcd")
    assert a.stage.microbatch_sizes == (8, 8, 8) and a.stage.pipeline_samples == 24
    assert [h.rows for h in b.stage.hosts] == [((0, 6),) * 3, ((6, 8),) * 3]
    assert sorted(b.indices + c.indices) == list(range(100, 124)) == sorted(a.indices) == sorted(d.indices)
    assert (a.stage.first_block, a.stage.end_block, b.stage.first_block, d.stage.end_block) == (0, 1, 1, 4)
    assert b.stage.prev_hosts == a.stage.hosts and b.stage.next_hosts == d.stage.hosts


def test_dp_shards_take_their_share_of_the_batch_next_to_the_pipeline():
    hosts = _hosts({"a": 10, "b": 10, "c": 10, "d": 10, "e": 10})
    out = assign(plan(dp_boards=["e"], dp_share=0.25), settings(), step=0, attempt=0, indices=list(range(32)),
                 block_names=["c1", "c2", "c3", "head"], hosts=hosts, augment=False, data_seed=0)
    assert out["e-1"].stage is None and out["e-1"].indices == tuple(range(24, 32))
    assert out["a-1"].stage.pipeline_samples == 24


def test_missing_boards_are_named():
    assert missing_boards(plan(), _hosts({"a": 1, "b": 1, "d": 1})) == ["c"]


def test_merging_a_pipeline_sums_its_hosts_partial_gradients():
    # Prepare: stage 1 hosted by b (6 rows) and c (2 rows); d is the last stage
    stage_plan = assign(plan(), settings(), step=0, attempt=0, indices=list(range(8)), block_names=["c1", "c2", "c3", "head"],
                        hosts=_hosts({"a": 1, "b": 3, "c": 1, "d": 1}), augment=False, data_seed=0)

    def part(name: str, grad: float, loss: float = 0.0) -> Contribution:
        a = stage_plan[f"{name}-1"]
        return Contribution(device_id=f"{name}-1", samples=len(a.indices), loss=loss, correct=len(a.indices) // 2,
                            compute_s=0.1, download_s=0.0, encode_s=0.0, upload_s=0.0,
                            tensors={f"grad.blocks.{name}.w": torch.tensor([grad]), "grad.shared": torch.tensor([grad])},
                            stage=a.stage)

    # Execute
    merged = merge_pipelines([part("a", 1.0), part("b", 2.0), part("c", 3.0), part("d", 4.0, loss=2.5)])

    # Assert
    assert len(merged) == 1
    pipe = merged[0]
    assert pipe.samples == 8 and pipe.loss == 2.5 and pipe.correct == 4
    assert pipe.tensors["grad.shared"].item() == 10.0
    assert pipe.tensors["grad.blocks.b.w"].item() == 2.0
