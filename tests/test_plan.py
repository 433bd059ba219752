"""Tests for edgetrain.plan: the plan's plain-data form (plan files, metrics), its checks, and the
schedule and pure-DP forms in ``explain``."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from coordinator.planning.cost import predict
from edgetrain.config import job_from_dict
from edgetrain.plan import (
    BlockCost,
    BoardCost,
    ModelCost,
    Plan,
    StagePlan,
    plan_from_dict,
    plan_to_dict,
)

pytestmark = pytest.mark.timeout(60)

FLEET = [BoardCost(name=n, flops_per_s=f, memory_bytes=1e9, mbit_per_s=100.0, idle_w=1.0, busy_w=4.0)
         for n, f in (("a", 4e9), ("b", 2e9), ("c", 1e9), ("d", 1e9))]
MODEL = ModelCost(tuple(BlockCost(name=f"b{i}", param_bytes=1e5, activation_bytes=1e4, forward_flops=1e7)
                        for i in range(4)))

PLANS = {
    "pipeline": Plan(stages=(StagePlan(0, 1, ("a",)), StagePlan(1, 4, ("b", "c"))), microbatches=8,
                     schedule="gpipe"),
    "hybrid": Plan(stages=(StagePlan(0, 2, ("a",)), StagePlan(2, 4, ("b",))), microbatches=4,
                   dp_boards=("c", "d"), dp_share=0.25),
    "dp": Plan(dp_boards=("a", "b"), dp_share=1.0),
    "dp on every board": Plan(dp_share=1.0),
}


# --- plain data --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PLANS))
def test_a_plan_round_trips_through_plain_data_and_yaml(name: str) -> None:
    # Prepare
    plan = replace(PLANS[name], left_out=(("z", "no gain"),))

    # Execute
    data = yaml.safe_load(yaml.safe_dump(plan_to_dict(plan)))
    back = plan_from_dict(data, where="plan.yaml")

    # Assert: boards left out and the prediction are not part of the plain form
    assert back == replace(plan, left_out=())
    assert plan_to_dict(back) == data


def test_stage_block_counts_become_consecutive_ranges_from_block_zero() -> None:
    # Prepare
    data = {"stages": [{"blocks": 2, "boards": ["a"]}, {"blocks": 1, "boards": ["b", "c"]},
                       {"blocks": 3, "boards": ["d"]}], "microbatches": 2}

    # Execute
    plan = plan_from_dict(data, where="plan.yaml")

    # Assert
    assert [(s.begin, s.end, s.boards) for s in plan.stages] == [(0, 2, ("a",)), (2, 3, ("b", "c")), (3, 6, ("d",))]
    assert (plan.microbatches, plan.schedule, plan.dp_boards, plan.dp_share) == (2, "1f1b", (), 0.0)


def test_keys_left_out_mean_what_they_mean_in_a_pipeline_section() -> None:
    # Execute
    nothing = plan_from_dict({}, where="plan.yaml")
    staged = plan_from_dict({"stages": [{"blocks": 4, "boards": ["a"]}]}, where="plan.yaml")
    shards = plan_from_dict({"dp_boards": ["a", "b"]}, where="plan.yaml")

    # Assert
    assert nothing == Plan(dp_share=1.0) and nothing.kind == "dp"
    assert (staged.microbatches, staged.schedule, staged.dp_share) == (4, "1f1b", 0.0)
    assert shards == Plan(dp_boards=("a", "b"), dp_share=1.0)


@pytest.mark.parametrize(("data", "message"), [
    ({"stages": [], "speed": 2}, "plan.yaml: speed=2: unknown key"),
    ({"stages": [{"blocks": 4, "boards": ["a"], "speed": 2}]}, "plan.yaml: stages[0].speed=2: unknown key"),
    ({"stages": [{"blocks": 0, "boards": ["a"]}]}, "plan.yaml: stages[0].blocks=0: must be an integer >= 1"),
    ({"stages": [{"blocks": 2, "boards": ["a"]}, {"blocks": -1, "boards": ["b"]}]}, "stages[1].blocks=-1"),
    ({"stages": [{"blocks": 2, "boards": ["a"]}, {"blocks": 2, "boards": ["b", "a"]}]},
     "plan.yaml: stages=['a']: a board can host only one stage or DP shard"),
    ({"stages": [{"blocks": 2, "boards": ["a", "a"]}]}, "plan.yaml: stages=['a']: a board can host only one"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "dp_boards": ["b", "a"], "dp_share": 0.5},
     "plan.yaml: dp_boards=['a']: a board can host only one"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "dp_share": 0.5}, "plan.yaml: dp_share=0.5: needs dp_boards"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "dp_boards": ["b"]}, "plan.yaml: dp_boards=['b']: need a dp_share"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "dp_boards": ["b"], "dp_share": 1.0}, "dp_share=1.0: must be in [0, 1)"),
    ({"dp_boards": ["a"], "dp_share": 0.5}, "plan.yaml: dp_share=0.5: must be 1 without stages"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "schedule": "zigzag"}, "plan.yaml: schedule='zigzag'"),
    ({"stages": [{"blocks": 4, "boards": ["a"]}], "microbatches": 0}, "plan.yaml: microbatches=0"),
    ({"stages": [{"blocks": 4, "boards": []}]}, "plan.yaml: stages[0].boards=[]"),
    ({"stages": {"blocks": 4}}, "plan.yaml: stages={'blocks': 4}"),
    (["a"], "plan.yaml: plan=['a']: must be a mapping"),
])
def test_bad_plain_data_names_the_key_and_the_value(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_from_dict(data, where="plan.yaml")


def test_the_pipeline_section_keeps_the_schedule_and_loads_as_a_job_pipeline() -> None:
    # Execute
    section = PLANS["pipeline"].to_pipeline_section()
    config = job_from_dict({"model": "small_cnn", "pipeline": section}).pipeline

    # Assert
    assert section == plan_to_dict(PLANS["pipeline"])
    assert (config.schedule, config.microbatches) == ("gpipe", 8)
    assert not job_from_dict({"model": "small_cnn",
                              "pipeline": PLANS["dp on every board"].to_pipeline_section()}).pipeline.enabled


# --- the plan's checks and explanation ---------------------------------------------------------

def test_a_stage_less_plan_is_pure_dp_with_the_whole_batch() -> None:
    with pytest.raises(ValueError, match="dp_share 1"):
        Plan(dp_boards=("a",), dp_share=0.5)
    with pytest.raises(ValueError, match="dp_share 1"):
        Plan()
    with pytest.raises(ValueError, match="schedule"):
        Plan(dp_share=1.0, schedule="zigzag")


def test_dp_over_every_board_is_predicted_as_dp_over_the_whole_fleet() -> None:
    # Execute
    every = predict(Plan(dp_share=1.0), FLEET, MODEL, 32)
    named = predict(Plan(dp_boards=tuple(k.name for k in FLEET), dp_share=1.0), FLEET, MODEL, 32)
    text = replace(Plan(dp_share=1.0), prediction=every).explain()

    # Assert
    assert every == named
    assert text.startswith("plan: pure data parallelism over every available board")
    assert all(any(line.split()[:2] == [k.name, "dp"] for line in text.splitlines()) for k in FLEET)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_explain_shows_the_schedule(schedule: str) -> None:
    # Prepare
    plan = replace(PLANS["pipeline"], schedule=schedule)

    # Execute
    text = replace(plan, prediction=predict(plan, FLEET, MODEL, 32)).explain()

    # Assert
    assert text.splitlines()[0] == f"plan: 2 stages, 8 micro-batches ({schedule})"


def test_the_plan_module_imports_no_torch() -> None:
    # Execute
    code = "import sys, edgetrain.plan; print(sorted(m for m in ('torch', 'yaml', 'grpc') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30,
                         cwd=Path(__file__).resolve().parents[1])

    # Assert
    assert out.stdout.strip() == "[]"
