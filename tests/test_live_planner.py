"""Live re-planning decisions (pure logic) and `edgetrain plan` on a fleet file."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass, replace

import pytest

from coordinator.planning.command import spread
from coordinator.planning.live import LINK_CONFIRM_DECISIONS, LivePlanner
from coordinator.planning.planner import plan_optimal
from edgetrain.cli import main
from edgetrain.config import PlannerConfig
from edgetrain.plan import BlockCost, BoardCost, ModelCost

MODEL = ModelCost(tuple(BlockCost(name=f"b{i}", param_bytes=p, activation_bytes=a, forward_flops=f)
                        for i, (p, a, f) in enumerate([(1e5, 6e4, 4e7), (4e5, 3e4, 4e7), (2e6, 1e4, 3e7),
                                                       (8e6, 4e3, 2e7)])))


def _fleet(**changes) -> list[BoardCost]:
    boards = [BoardCost(name=n, flops_per_s=f, memory_bytes=4e9, mbit_per_s=m, idle_w=2.0, busy_w=6.0,
                        battery_percent=80.0, plugged=False)
              for n, f, m in (("a", 4e9, 100.0), ("b", 3e9, 100.0), ("c", 2e9, 50.0), ("d", 1e9, 20.0))]
    return [replace(b, **changes.get(b.name, {})) for b in boards]


def _planner(**cfg) -> LivePlanner:
    return LivePlanner(PlannerConfig(enabled=True, **cfg), MODEL, 64)


def _held(live: LivePlanner, step: int, fleet: list[BoardCost], **kw):
    """`live`'s decision at `step` on a fleet whose link change has held since LINK_CONFIRM_DECISIONS
    decisions: the earlier ones decide nothing."""
    for k in range(LINK_CONFIRM_DECISIONS - 1, 0, -1):
        assert live.decide(step - k, fleet, **kw) is None
    return live.decide(step, fleet, **kw)


def _used(plan) -> set[str]:
    return {n for s in plan.stages for n in s.boards} | set(plan.dp_boards)


def test_first_plan_then_nothing_until_the_fleet_changes():
    live = _planner()

    first = live.decide(0, _fleet())
    again = live.decide(1, _fleet())
    noise = live.decide(2, _fleet(b={"mbit_per_s": 100.0 * 1.2}))  # below the 30% threshold

    assert first.reasons == ("first plan",) and first.switched and first.current_cost is None
    assert again is None and noise is None


def test_plans_are_costed_as_the_job_keeps_stage_state():
    # Prepare: boards of 20 MB hold no whole model (21 MB of parameters and gradients) and block
    # 3 (8 MB) only alone: a pipeline [0, 3) [3, 4), each stage owned by its host
    fleet = [replace(b, memory_bytes=2e7, mbit_per_s=20.0) for b in _fleet()[:2]]

    # Execute
    replicated = _planner().decide(0, fleet).plan
    pulled = LivePlanner(PlannerConfig(enabled=True), MODEL, 64, "hosts", 50, replicate=False).decide(0, fleet).plan

    # Assert: block 3's host sends its 8 MB of gradients to the replica every step (σ = 4e-7 s/byte
    # at 20 Mbit/s) instead of its parameters and momenta every 50 steps
    assert [(s.begin, s.end) for s in replicated.stages] == [(s.begin, s.end) for s in pulled.stages] == [(0, 3), (3, 4)]
    assert replicated.prediction.step_s - pulled.prediction.step_s == pytest.approx(8e6 * 4e-7 * (1 - 2 / 50), rel=1e-9)


def test_a_link_drop_beyond_the_threshold_re_plans_and_the_board_loses_its_role():
    live = _planner()
    first = live.decide(0, _fleet())
    assert "b" in _used(first.plan)

    decision = _held(live, 5, _fleet(b={"mbit_per_s": 0.5}))

    assert decision.reasons == ("b link 100.0 -> 0.5 Mbit/s",)
    assert decision.switched and decision.candidate_cost < decision.current_cost
    assert "b" not in _used(decision.plan)
    assert live.decide(6, _fleet(b={"mbit_per_s": 0.55})) is None  # the new reference: no flapping


def test_a_link_reading_that_does_not_hold_plans_nothing():
    live = _planner()
    live.decide(0, _fleet())

    # a reading 200x lower, twice, then the rate as before: a busy CPU's reading, not a link change
    swings = [live.decide(1, _fleet(b={"mbit_per_s": 0.5})), live.decide(2, _fleet(b={"mbit_per_s": 0.5})),
              live.decide(3, _fleet()), live.decide(4, _fleet(b={"mbit_per_s": 0.5}))]

    assert swings == [None] * 4
    assert live.decide(5, _fleet(b={"mbit_per_s": 0.5})) is None
    assert live.decide(6, _fleet(b={"mbit_per_s": 0.5})).reasons == ("b link 100.0 -> 0.5 Mbit/s",)


def test_a_change_that_is_not_worth_a_switch_keeps_the_plan():
    live = _planner(min_gain=0.5)
    first = live.decide(0, _fleet())

    decision = _held(live, 3, _fleet(d={"mbit_per_s": 30.0}))  # 50% faster link on the weakest board

    assert decision is not None and not decision.switched
    assert decision.plan.stages == first.plan.stages and decision.plan.dp_boards == first.plan.dp_boards
    assert decision.candidate_cost >= 0.5 * decision.current_cost


def test_a_board_that_left_forces_a_new_plan_and_a_low_battery_takes_a_board_out():
    live = _planner(min_gain=0.9)  # a huge hysteresis does not keep a plan that cannot run
    first = live.decide(0, _fleet())
    gone = next(iter(_used(first.plan)))
    rest = [b for b in _fleet() if b.name != gone]

    left = live.decide(1, rest)
    low = live.decide(2, [replace(b, battery_percent=10.0) if b.name == "a" else b for b in rest])

    assert left.reasons == (f"{gone} left",) and left.switched and left.current_cost is None
    assert gone not in _used(left.plan)
    if gone != "a":
        assert low.reasons == ("a battery 10% unplugged",)
        assert "a" not in _used(low.plan) and dict(low.plan.left_out)["a"].startswith("battery 10%")


@dataclass
class Run:
    """What `edgetrain plan` printed and returned."""

    returncode: int
    stdout: str
    stderr: str


def _run_plan(*args: str) -> Run:
    """`edgetrain plan ARGS` in this process (the same entry point; no second torch import)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *args])
        except SystemExit as e:  # argparse refuses bad arguments this way
            code = e.code
    return Run(code, out.getvalue(), err.getvalue())


@pytest.fixture
def fleet_file(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("""
name: small
cluster: small
job: {model: small_cnn, training: {global_batch: 32}}
boards:
  - {name: fast, speed: 0.5, link: {mbit_per_s: 100}}
  - {name: mid, speed: 0.3, link: {mbit_per_s: 50}, battery: {capacity_wh: 20, idle_w: 2, busy_w: 5, plugged: true}}
  - {name: slow, speed: 0.2, link: {mbit_per_s: 1}}
""")
    return path


def test_edgetrain_plan_explains_the_plan_of_a_fleet_file(fleet_file):
    text = _run_plan(str(fleet_file))
    as_json = _run_plan(str(fleet_file), "--json", "--objective", "pareto")

    assert text.returncode == 0, text.stderr
    assert "plan:" in text.stdout and "predicted: step" in text.stdout and "of ideal" in text.stdout
    for board in ("fast", "mid", "slow"):
        assert board in text.stdout
    out = json.loads(as_json.stdout)
    assert out["model"] == "small_cnn" and out["global_batch"] == 32 and out["plans"]
    steps = [p["predicted_step_s"] for p in out["plans"]]
    energies = [p["predicted_energy_per_sample_j"] for p in out["plans"]]
    assert steps == sorted(steps) and energies == sorted(energies, reverse=True)  # a Pareto front
    assert all(p["predicted_samples_per_s"] <= out["ideal_samples_per_s"] for p in out["plans"])


def test_edgetrain_plan_without_replicas_costs_owned_stages_less(tmp_path):
    solo = tmp_path / "solo.yaml"
    solo.write_text("""
name: solo
job: {model: small_cnn, training: {global_batch: 32}}
boards:
  - {name: only, speed: 0.5, link: {mbit_per_s: 20}}
""")

    replicated = json.loads(_run_plan(str(solo), "--json").stdout)["plans"][0]
    pulled = json.loads(_run_plan(str(solo), "--json", "--no-replicate").stdout)["plans"][0]

    # the board owns the whole model as one stage: a replica takes its gradients every step
    assert replicated["stages"] == pulled["stages"] == [{"blocks": 4, "boards": ["only"]}]
    assert pulled["predicted_step_s"] < replicated["predicted_step_s"]


def test_pareto_text_explains_a_spread_of_the_front() -> None:
    assert spread(3, 8) == [0, 1, 2]
    assert spread(100, 8) == [0, 14, 28, 42, 57, 71, 85, 99]
    assert spread(9, 2) == [0, 8]


def test_edgetrain_plan_refuses_bad_input_clearly(fleet_file, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("boards: [unclosed\n")

    objective = _run_plan(str(fleet_file), "--objective", "fastest")
    broken = _run_plan(str(bad_yaml))

    assert objective.returncode == 2 and "--objective must be" in objective.stderr
    assert broken.returncode == 2 and "not valid YAML" in broken.stderr


def _judged_twice(changed: list, measured_over_predicted: float):
    """The first plan on `_fleet()`, then one re-planning on `changed` made twice: judged on
    predictions only, and with the plan in force measured at `measured_over_predicted` times its
    predicted step time. Returns (first, predictions only, measured)."""
    live, other = _planner(min_gain=0.05), _planner(min_gain=0.05)
    first = live.decide(0, _fleet())
    other.decide(0, _fleet())
    measured_step_s = measured_over_predicted * first.plan.prediction.step_s
    return first, _held(other, 4, changed), _held(live, 4, changed, measured_step_s=measured_step_s)


def test_a_plan_that_measures_better_than_predicted_is_not_swapped_for_a_close_candidate():
    # Prepare: a link change that makes some candidate look a little better
    changed = _fleet(c={"mbit_per_s": 5.0}, d={"mbit_per_s": 5.0})

    # Execute: the same decision, once judged on predictions only, once with the current plan
    # measured at half its predicted step time
    _, predicted_only, measured = _judged_twice(changed, 0.5)

    # Assert: the measurement halves the current plan's cost, so it is kept
    assert measured.current_cost == pytest.approx(0.5 * predicted_only.current_cost)
    assert not measured.switched


def test_a_plan_that_runs_slower_than_predicted_is_judged_by_its_prediction_as_the_candidate_is():
    # Prepare: a link change that makes some candidate look a little better (1.8%), not by min_gain
    changed = _fleet(c={"mbit_per_s": 10.0}, d={"mbit_per_s": 10.0})

    # Execute: judged on predictions only, and with the current plan measured at 1.5x its
    # predicted step time (the cost model is optimistic about it, so about the candidate too)
    first, predicted_only, slower = _judged_twice(changed, 1.5)

    # Assert: the measurement does not raise the current plan's cost; it is kept
    assert slower.current_cost == pytest.approx(predicted_only.current_cost)
    assert not predicted_only.switched and not slower.switched
    assert slower.plan == first.plan


def test_a_plan_running_far_over_its_prediction_is_planned_again_from_the_refined_speeds():
    # Prepare: boards a and b profiled at a tenth of their speed (a profile taken while the
    # machine was busy): the first plan is built around that
    live = _planner(overrun=0.5)
    first = live.decide(0, _fleet(a={"flops_per_s": 0.4e9}, b={"flops_per_s": 0.3e9}))
    predicted = first.plan.prediction.step_s

    # Execute: their steps have since refined the speeds; the step ran 2x its prediction
    unmeasured = live.decide(3, _fleet())  # a speed is not a fleet change: no re-plan without a measured step
    within = live.decide(3, _fleet(), measured_step_s=1.4 * predicted)
    over = live.decide(4, _fleet(), measured_step_s=2.0 * predicted)

    # Assert: re-planned once, for the overrun, onto a plan that uses a and b for what they are
    assert unmeasured is None and within is None
    assert over.reasons == (f"step {2 * predicted:.2f} s measured, {predicted:.2f} s predicted",)
    assert over.switched and over.plan != first.plan
    assert over.current_cost > over.candidate_cost
    assert over.plan.prediction.step_s < predicted / 2


def test_an_overrun_whose_candidate_is_the_plan_in_force_keeps_it_and_is_not_planned_again():
    # Prepare: right speeds, but the plan runs 3x its prediction (something the cost model misses)
    live = _planner(overrun=0.5)
    first = live.decide(0, _fleet())
    measured = 3.0 * first.plan.prediction.step_s

    # Execute
    over = live.decide(5, _fleet(), measured_step_s=measured)
    again = live.decide(9, _fleet(), measured_step_s=measured)

    # Assert: the candidate is the same plan (its prediction beats its own measurement, which says
    # nothing): kept, and its overrun is not re-planned every step
    assert over.reasons[0].startswith(f"step {measured:.2f} s measured") and not over.switched
    assert over.plan == first.plan
    assert again is None


def test_overrun_must_be_positive():
    with pytest.raises(ValueError, match="overrun"):
        PlannerConfig(enabled=True, overrun=0.0)


def test_a_board_whose_device_ran_out_of_memory_is_planned_with_less_and_its_stage_moves():
    # Prepare: 20 MB boards host a pipeline [0, 3) [3, 4) (the whole model does not fit one)
    fleet = [replace(b, memory_bytes=2e7, mbit_per_s=20.0) for b in _fleet()[:3]]
    live = _planner(min_gain=0.9)  # a huge hysteresis does not keep a plan that no longer fits
    first = live.decide(0, fleet).plan
    host = next(n for s in first.stages for n in s.boards if first.prediction.memory_bytes[n] > 5e6)

    # Execute: its device ran out of memory: the coordinator counts on 90% of what the stage needed
    cap = 0.9 * first.prediction.memory_bytes[host]
    decision = live.decide(4, [replace(b, memory_bytes=cap) if b.name == host else b for b in fleet])

    # Assert: planned again, and the new plan fits every board, that one included
    assert decision is not None and decision.switched
    assert any(r.startswith(f"{host} memory") for r in decision.reasons)
    assert decision.plan.prediction.fits and decision.plan.prediction.memory_bytes.get(host, 0.0) <= cap


def test_a_fleet_file_without_power_figures_is_priced_with_the_power_its_boards_report():
    from coordinator.planning.inputs import boards_from_fleet
    from edgetrain.fleet_file import load_fleet
    from edgetrain.power import default_power
    from edgetrain.split import SpeedEstimate

    fleet = load_fleet("experiments/fleets/compute.yaml")  # no idle_w / busy_w on any board
    boards = boards_from_fleet(list(fleet.boards), MODEL, SpeedEstimate(0.001, 400.0))
    for spec, board in zip(fleet.boards, boards):
        model = default_power(spec.speed)
        assert (board.idle_w, board.busy_w) == (model.idle_w, model.busy_w) and board.busy_w > board.idle_w > 0
    plan = _planner().decide(0, boards).plan
    assert plan.prediction.energy_per_sample_j > 0


def test_a_candidate_is_judged_by_the_boards_that_work_in_its_steps_so_a_measured_one_is_recognised():
    # Prepare: fast links, and a board so slow that data parallelism would give it a sixth of a
    # sample a step. A trial measured the alternatives (as coordinator.training.plan_sources does):
    # the fastest board alone 1.0 s a step, data parallelism 1.5 s; the board alone is in force
    fast = {n: {"mbit_per_s": 1000.0} for n in "abc"}
    fleet = _fleet(**fast, d={"flops_per_s": 5e7, "mbit_per_s": 100.0})
    raw = plan_optimal(fleet, MODEL, 64)
    assert "d" in raw.dp_boards and raw.prediction.share["d"] * 64 < 1  # the premise
    live = _planner()
    live.decide(0, fleet)
    alternatives = live.alternatives(1, fleet)
    dp, alone = alternatives[0], alternatives[-1]
    live.adopt(alone)
    live.note_measured(dp, 1.5, 5)
    live.note_measured(alone, 1.0, 5)

    # Execute: the slow board's link changes (and holds); data parallelism is still predicted faster
    decision = _held(live, 10, _fleet(**fast, d={"flops_per_s": 5e7, "mbit_per_s": 200.0}))

    # Assert: no plan gives a shard less than one sample a step (the weak board is out of data
    # parallelism), so the candidate is recognised as the structure measured slower, and it does
    # not replace the plan in force
    for plan in (decision.plan, *alternatives, *live.alternatives(11, fleet)):
        assert all(plan.prediction.share[b] * 64 >= 1 for b in plan.dp_boards)
    assert dp.kind == "dp" and set(dp.dp_boards) == {"a", "b", "c"}
    assert decision.candidate_cost < 0.95 * decision.current_cost  # predicted better by more than min_gain
    assert not decision.switched and _used(decision.plan) == {"a"}
    # without boards beside the steps too: the alternatives leave the sub-sample shard out
    bare = _planner(local_updates=False)
    bare.decide(0, fleet)
    assert all(p.prediction.share[b] * 64 >= 1 for p in bare.alternatives(1, fleet) for b in p.dp_boards)
