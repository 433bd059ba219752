"""Boards beside the steps (asynchronous local updates) and measured plan trials, without sockets.

- A board's local work is sized to land within the staleness bound, and none is given when even
  its transfers do not fit.
- The planner puts a board it leaves out for no gain beside the steps, and the plan says so.
- A local update of one SGD step, turned into gradient units, is the gradient of its samples.
- The step board neither waits for nor closes the tickets of boards beside the step; past the
  bound they are closed and refuse their upload.
- A trial runs each candidate for its steps and keeps the best measured goodput.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_aggregation import Clock, _assign, _board, _upload

from coordinator.planning.local_members import (
    add_local_members,
    local_work_size,
    weighted_rate,
    without_local_members,
)
from coordinator.planning.planner import ONE_BOARD_ALONE, plan_alternatives, plan_optimal
from coordinator.planning.trials import Trial, distinct, efficiency, structure
from coordinator.training.aggregator import as_gradient
from coordinator.training.steps import Contribution, StepError
from edgetrain.models import build_model
from edgetrain.plan import NO_GAIN, BlockCost, BoardCost, ModelCost, Plan
from edgetrain.training import GRAD_PREFIX, local_train, shard_tensor_names
from edgetrain.work import LocalWork

# --- sizing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 1, 2, 5])
def test_local_work_lands_within_the_staleness_bound(bound):
    size = local_work_size(overhead_s=0.2, samples_per_s=20.0, transfer_s=0.3, step_s=0.5, staleness_bound=bound,
                           staleness_exponent=0.5, local_batch=16)
    if bound == 0:  # half a step: 0.25 s, less than its transfers
        assert size is None
        return
    assert size is not None and size.staleness(0.5) <= bound
    assert size.seconds <= (bound + 0.5) * 0.5 + 1e-9
    assert size.samples >= 4


def test_the_size_chosen_adds_the_most_weighted_samples_of_any_window():
    kw = {"overhead_s": 0.05, "samples_per_s": 40.0, "transfer_s": 0.4, "step_s": 0.5, "staleness_exponent": 0.5,
          "local_batch": 8}
    best = local_work_size(staleness_bound=6, **kw)
    for bound in range(7):
        other = local_work_size(staleness_bound=bound, **kw)
        if other is not None:
            assert weighted_rate(best, 0.5, 0.5) >= weighted_rate(other, 0.5, 0.5) - 1e-12


def test_a_board_whose_transfers_take_longer_than_the_bound_allows_gets_no_local_work():
    assert local_work_size(overhead_s=0.0, samples_per_s=100.0, transfer_s=10.0, step_s=1.0, staleness_bound=2,
                           staleness_exponent=0.5, local_batch=16) is None


# --- the planner's plans ---------------------------------------------------------------------------

def _model() -> ModelCost:
    return ModelCost(tuple(BlockCost(name=f"b{i}", param_bytes=400_000, activation_bytes=40_000, forward_flops=2e7)
                           for i in range(4)))


def _fleet(slow_rate: float = 1e9) -> list[BoardCost]:
    fast = [BoardCost(name=n, flops_per_s=2e10, memory_bytes=4e9, mbit_per_s=1000.0, overhead_s=0.01) for n in "ab"]
    return fast + [BoardCost(name="slow", flops_per_s=slow_rate, memory_bytes=4e9, mbit_per_s=1000.0, overhead_s=0.3)]


def test_a_board_left_out_for_no_gain_trains_beside_the_steps():
    # Prepare: the slow board would only lengthen every step
    plan = plan_optimal(_fleet(), _model(), 64)
    assert "slow" in dict(plan.left_out) or plan.prediction.share["slow"] * 64 < 1

    # Execute
    beside = add_local_members(plan, _fleet(), _model(), global_batch=64, staleness_bound=8, staleness_exponent=0.5,
                               local_batch=16)

    # Assert: it is beside the steps, its samples counted, and the steps are unchanged
    assert beside.local_boards == ("slow",) and "slow" not in dict(beside.left_out)
    assert beside.prediction.local_samples_per_s["slow"] > 0
    assert beside.prediction.step_s == plan.prediction.step_s
    assert "local" in beside.explain() and "local updates from slow" in beside.describe()
    assert dict(without_local_members(beside).left_out)["slow"] == NO_GAIN


def test_with_a_bound_too_short_the_board_stays_out_and_the_plan_says_why():
    plan = plan_optimal(_fleet(), _model(), 64)
    kept = add_local_members(plan, _fleet(), _model(), global_batch=64, staleness_bound=0, staleness_exponent=0.5,
                             local_batch=16)
    assert kept.local_boards == ()
    assert "does not fit 0 step(s) of staleness" in dict(kept.left_out)["slow"]


def test_a_board_in_the_steps_cannot_also_be_beside_them():
    with pytest.raises(ValueError, match="either in the steps or beside them"):
        Plan(dp_share=1.0, dp_boards=("a",), local_boards=("a",))


def test_the_alternatives_differ_in_structure_and_include_one_board_alone():
    plans = distinct([plan_optimal(_fleet(), _model(), 64), *plan_alternatives(_fleet(), _model(), 64)])
    assert len(plans) >= 2
    alone = [p for p in plans if dict(p.left_out).get("slow") == ONE_BOARD_ALONE]
    assert len(alone) == 1
    working = {b for s in alone[0].stages for b in s.boards} | set(alone[0].dp_boards)
    assert len(working) == 1 and working <= {"a", "b"}  # one of the fast ones, whichever way is faster
    assert all(p.prediction is not None and p.prediction.fits for p in plans)


# --- a local update in gradient units --------------------------------------------------------------

def test_local_sgd_steps_in_gradient_units_are_the_mean_of_their_gradients():
    # Prepare: three plain SGD steps by hand, keeping each step's gradient, and the same three
    # steps as a board's local training
    torch.manual_seed(0)
    x, y = torch.randn(24, 3, 32, 32), torch.randint(0, 10, (24,))
    reference = build_model("small_cnn", seed=0)
    want: dict[str, torch.Tensor] = {}
    for i in range(3):
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(x[8 * i: 8 * i + 8]), y[8 * i: 8 * i + 8]).backward()
        with torch.no_grad():
            for w, ref in shard_tensor_names(reference):
                if w.startswith(GRAD_PREFIX):
                    want[w] = want.get(w, 0) + ref.grad / 3
                    ref.sub_(0.1 * ref.grad)
    local = build_model("small_cnn", seed=0)
    result = local_train(local, x, y, steps=3, batch_size=8, lr=0.1)
    work = LocalWork(steps=3, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0, prox_mu=0.0)
    c = Contribution(device_id="slow", samples=24, loss=0.0, correct=0, compute_s=0.0, download_s=0.0, encode_s=0.0,
                     upload_s=0.0, tensors=dict(result.tensors), local=work)

    # Execute
    as_gradient(c)

    # Assert
    worst = max(float((c.tensors[n] - g).abs().max()) for n, g in want.items())
    assert worst < 1e-5, worst


# --- the step board: tickets beside the step --------------------------------------------------------

def test_a_ticket_beside_the_step_is_not_waited_for_and_its_update_arrives_later():
    # Prepare: step 0 for a fast board in the step and a slow one beside it
    clock = Clock()
    board, formats = _board(clock)
    board.open_attempt(_assign(0, {"fast": 4, "slow": 2}))
    _upload(board, formats, "fast", 0, 4)

    # Execute: the attempt ends as soon as the fast board answered (the deadline is far away)
    outcome = board.wait_attempt(0, 0, deadline=math.inf, is_alive=lambda d: True, beside={"slow"})
    busy = board.busy()
    board.open_attempt(_assign(1, {"fast": 4}))
    _upload(board, formats, "slow", 0, 2)
    late, _ = board.take_late(oldest_step=0)

    # Assert
    assert set(outcome.accepted) == {"fast"} and outcome.missing == [] and outcome.late == []
    assert busy == {"slow"}
    assert [(c.device_id, c.param_version) for c in late] == [("slow", 0)]


def test_a_ticket_beside_the_step_past_the_bound_is_closed_and_refuses_its_upload():
    clock = Clock()
    board, formats = _board(clock)
    board.open_attempt(_assign(0, {"fast": 4, "slow": 2}))
    _upload(board, formats, "fast", 0, 4)
    board.wait_attempt(0, 0, deadline=math.inf, is_alive=lambda d: True, beside={"slow"})
    late, _ = board.take_late(oldest_step=1)  # step 3 under bound 2
    assert late == [] and board.busy() == set()
    with pytest.raises(StepError, match="step 0 attempt 0 is closed"):
        _upload(board, formats, "slow", 0, 2)


# --- trials ----------------------------------------------------------------------------------------

def test_efficiency_is_one_without_a_noise_scale_and_falls_with_the_batch():
    assert efficiency(None, 64, 128) == 1.0
    assert efficiency(64.0, 64, 64) == 1.0
    assert efficiency(64.0, 64, 192) == pytest.approx(0.5)


def test_a_trial_runs_each_candidate_in_turn_and_keeps_the_fastest_measured():
    # Prepare: two candidates, 2 scored steps each after a hand-over step
    fleet, model = _fleet(), _model()
    first = plan_optimal(fleet, model, 64)
    second = plan_alternatives(fleet, model, 64)[-1]
    trial = Trial(10, [first, second], steps=2)

    # Execute: the second measures twice as fast
    assert [trial.plan_for(s) is first for s in range(10, 13)] == [True] * 3
    assert [trial.plan_for(s) is second for s in range(13, 16)] == [True] * 3
    assert trial.plan_for(16) is None
    trial.observe([(9, 5.0), (10, 9.0), (11, 1.0), (12, 1.0), (13, 9.0), (14, 0.5), (15, 0.5)])

    # Assert: hand-over steps are not scored; the second wins
    scores = trial.scores(64, None)
    assert scores[0]["measured_step_s"] == 1.0 and scores[1]["measured_step_s"] == 0.5
    assert trial.best(64, None) == 1
    assert trial.seconds() == pytest.approx(21.0)


def test_a_candidate_that_cannot_run_is_skipped_and_the_next_runs_in_its_place():
    # Prepare: three candidates, 2 scored steps each after a hand-over step
    fleet, model = _fleet(), _model()
    plans = plan_alternatives(fleet, model, 64)
    first, second, third = plans[0], plans[1], plans[-1]
    trial = Trial(10, [first, second, third], steps=2)

    # Execute: the second's board is not ready after its hand-over step (step 14)
    trial.skip(14, "b1 not ready at step 14")

    # Assert: its turn ends there, the third runs from step 14, and the second keeps the step it ran
    assert [trial.plan_for(s) for s in range(10, 18)] == [first] * 3 + [second] + [third] * 3 + [None]
    assert trial.end_step == 17
    trial.observe([(k, 1.0) for k in range(10, 17)])
    scores = trial.scores(64, None)
    assert [s["steps"] for s in scores] == [[10, 11, 12], [13], [14, 15, 16]]
    assert scores[1]["skipped"] == "b1 not ready at step 14" and scores[1]["measured_step_s"] is None
    assert scores[0]["skipped"] == "" and scores[2]["measured_step_s"] == 1.0
    trial.skip(17, "after the trial")  # nothing to skip
    assert trial.end_step == 17


def test_a_switch_measured_slower_than_the_plan_in_force_keeps_the_plan_in_force():
    # Prepare: the plan in force measured 1.0 s a step before the re-plan; the new plan runs its
    # trial (a hand-over step, then 2 scored steps) and measures 1.5 s
    fleet, model = _fleet(), _model()
    in_force = plan_alternatives(fleet, model, 64)[-1]
    new = plan_optimal(fleet, model, 64)
    trial = Trial(20, [new], steps=2, incumbent=(in_force, [1.0] * 20))

    # Execute
    scheduled = [trial.plan_for(s) for s in range(19, 24)]
    trial.observe([(20, 4.0), (21, 1.5), (22, 1.5)])

    # Assert: only the new plan runs; the plan in force wins on its measurement and is not run again
    assert scheduled == [None, new, new, new, None]
    assert trial.best(64, None) == 1 and trial.measured[1].plan is in_force
    assert trial.scores(64, None)[1]["in_force_before"] is True
    assert trial.seconds() == pytest.approx(7.0)


def test_data_parallelism_over_the_same_boards_listed_in_another_order_is_measured_once():
    dp = next(p for p in plan_alternatives(_fleet(), _model(), 64) if not p.stages)
    shuffled = replace(dp, dp_boards=tuple(reversed(dp.dp_boards)))
    assert distinct([dp, shuffled]) == [dp]


def test_a_candidate_replaces_data_parallelism_only_when_it_measures_clearly_faster():
    # Prepare: pure data parallelism over every board and a pipeline, 4 scored steps each
    fleet, model = _fleet(), _model()
    plans = plan_alternatives(fleet, model, 64)
    dp = next(p for p in plans if not p.stages)
    other = next(p for p in plans if p.stages)

    def kept(dp_steps: list[float], other_steps: list[float]) -> Plan:
        trial = Trial(0, [other, dp], steps=4)
        trial.observe([(k, t) for k, t in enumerate([9.0, *other_steps, 9.0, *dp_steps])])
        return trial.measured[trial.best(64, None, min_gain=0.05)].plan

    # Execute / Assert: 10% faster within steps that scatter by 30% is noise; 20% faster in steady
    # steps, or twice as fast in noisy ones, is not; four steady steps still assume a 10% spread
    assert kept([1.0, 0.7, 1.3, 1.0], [0.9, 0.6, 1.2, 0.9]) is dp
    assert kept([1.0, 1.0, 1.0, 1.0], [0.8, 0.8, 0.8, 0.8]) is other
    assert kept([1.0, 0.7, 1.3, 1.0], [0.5, 0.35, 0.65, 0.5]) is other
    assert kept([1.0, 1.0, 1.0, 1.0], [0.9, 0.9, 0.9, 0.9]) is dp


def test_a_challenger_measured_faster_again_wins_on_all_its_steps_and_not_on_one_trial():
    # Prepare: the plan in force measured 1.0 s a step over 20 steps (scattering by 10%); a
    # challenger measures 0.9 s in the 3 scored steps of a trial: inside one trial's margin
    fleet, model = _fleet(), _model()
    plans = plan_alternatives(fleet, model, 64)
    in_force = next(p for p in plans if p.stages)
    challenger = next(p for p in plans if not p.stages)
    in_force_steps = [0.9, 1.1] * 10

    def kept(earlier: list[float]) -> Plan:
        trial = Trial(30, [challenger], steps=3, incumbent=(in_force, in_force_steps),
                      evidence={structure(challenger): earlier, structure(in_force): [9.0]})
        trial.observe([(30, 5.0), (31, 0.9), (32, 0.9), (33, 0.9)])
        assert trial.measured[1].times() == in_force_steps  # the plan in force: its own steps
        return trial.measured[trial.best(64, None, min_gain=0.05)].plan

    # Execute / Assert: one trial's 3 steps do not tell 10% from noise; measured again (its steps
    # of an earlier trial pooled with this one's), the same difference does
    assert kept([]) is in_force
    assert kept([0.9, 0.9, 0.9]) is challenger
    assert kept([1.2, 1.2, 1.2]) is in_force  # its earlier steps count against it too

    # one skipped (its boards not ready at its turn) is not kept on what it measured before
    skipped = Trial(30, [challenger], steps=3, incumbent=(in_force, in_force_steps),
                    evidence={structure(challenger): [0.5] * 6})
    skipped.skip(30, "b1 not ready at step 30")
    assert skipped.scores(64, None)[0]["score"] is None and skipped.best(64, None) == 1

    # a candidate of the plan in force's structure (a new split of the same boards) starts afresh
    resplit = Trial(30, [in_force], steps=3, incumbent=(in_force, in_force_steps),
                    evidence={structure(in_force): [9.0]})
    assert resplit.measured[0].earlier == [] and resplit.measured[1].in_force


# --- the aggregator: a local update beside the steps ------------------------------------------------

def _local_upload(board, formats, device: str, step: int, samples: int, value: float) -> None:
    import zlib

    from edgetrain.tensors import pack
    from edgetrain.work import StepReport

    wire = {m.name: torch.full(m.shape, value) for m in formats("none").metas()}
    metas, payload = pack(wire)
    assembler = board.begin_upload(device, step, 0, metas, StepReport(samples=samples, loss=1.0, correct=0,
                                                                      compute_s=0.1), 0)
    assembler.add(0, bytes(payload), zlib.crc32(bytes(payload)))
    board.complete_upload(device, step, 0)


def _aggregator():
    from conftest import small_job

    from coordinator.registry import DeviceRegistry
    from coordinator.training.aggregator import Aggregator

    job = small_job(planner={"enabled": True}, aggregation={"staleness_bound": 8})
    return Aggregator(job, build_model("small_cnn", seed=0), DeviceRegistry())


def _step_with_local_work(steps: int):
    """Step 0 with a fast board in it and "slow" beside it (`steps` local steps of 8, lr 0.1), the
    fast board answered and the attempt closed: (step board, its formats, an aggregator)."""
    from edgetrain.work import Assignment

    board, formats = _board(Clock())
    work = LocalWork(steps=steps, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0, prox_mu=0.0)
    board.open_attempt({**_assign(0, {"fast": 4}),
                        "slow": Assignment(0, 0, 0, tuple(range(8 * steps)), False, 0, local=work)})
    _upload(board, formats, "fast", 0, 4)
    board.wait_attempt(0, 0, deadline=math.inf, is_alive=lambda d: True, beside={"slow"})
    return board, formats, _aggregator()


def test_a_local_update_counts_once_in_gradient_units_with_its_staleness_weight():
    # Prepare: at step 0 the slow board takes 3 local steps of 8 beside the step; it answers during step 2
    board, formats, aggregator = _step_with_local_work(steps=3)
    _local_upload(board, formats, "slow", 0, 24, 0.3)

    # Execute
    result = aggregator.apply(2, board, [], {})
    again = aggregator.apply(3, board, [], {})

    # Assert: weight (1 + 2)^-0.5, the change divided by lr x steps, applied once
    [used] = result.used
    assert used.contribution.device_id == "slow" and used.staleness == 2
    assert used.factor == pytest.approx(3 ** -0.5)
    grads = [t for n, t in used.contribution.tensors.items() if n.startswith(GRAD_PREFIX)]
    assert all(torch.allclose(t, torch.full_like(t, 0.3 / (0.1 * 3))) for t in grads)
    assert again.used == []


def test_a_local_update_past_the_staleness_bound_is_never_applied():
    board, formats, aggregator = _step_with_local_work(steps=1)

    # Execute: step 9 is past the bound of 8 for work of step 0
    result = aggregator.apply(9, board, [], {})

    # Assert
    assert result.used == []
    with pytest.raises(StepError, match="step 0 attempt 0 is closed"):
        _local_upload(board, formats, "slow", 0, 8, 0.3)


def test_a_local_update_adds_to_the_step_instead_of_diluting_it():
    from coordinator.training.aggregator import Weighted, combine

    def c(device: str, samples: int, value: float) -> Contribution:
        return Contribution(device_id=device, samples=samples, loss=0.0, correct=0, compute_s=0.0, download_s=0.0,
                            encode_s=0.0, upload_s=0.0, tensors={"grad.w": torch.tensor([value])})

    # the step's own 64 samples keep their full weight; 32 local samples at s = 0.5 add 32 / 64 x 0.5 x 2
    out = combine([Weighted(c("a", 48, 1.0)), Weighted(c("b", 16, 1.0)), Weighted(c("slow", 32, 2.0), 3, 0.5, True)])
    assert float(out["grad.w"]) == pytest.approx(1.5)
    # more local samples than the step's count as one step's worth at most
    out = combine([Weighted(c("a", 64, 1.0)), Weighted(c("slow", 640, 1.0), 0, 1.0, True)])
    assert float(out["grad.w"]) == pytest.approx(2.0)


def test_a_board_whose_local_update_misses_the_bound_gets_smaller_work_until_its_updates_land():
    from coordinator.registry import MIN_LOCAL_PACE
    from edgetrain.work import Assignment

    # Prepare: a registered board takes local work beside step 0
    board, formats = _board(Clock())
    aggregator = _aggregator()
    slow = aggregator.registry.register("slow", {}, {}).device_id
    work = LocalWork(steps=2, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0, prox_mu=0.0)
    board.open_attempt({**_assign(0, {"fast": 4}), slow: Assignment(0, 0, 0, tuple(range(16)), False, 0, local=work)})
    _upload(board, formats, "fast", 0, 4)
    board.wait_attempt(0, 0, deadline=math.inf, is_alive=lambda d: True, beside={slow})
    assert board.next_work(slow, 0.0).local == work

    # Execute: the bound passes without its update; three more miss, then one lands
    aggregator.apply(9, board, [], {})
    missed = aggregator.registry.get(slow).local_pace
    for _ in range(3):
        aggregator.registry.pace_local(slow, landed=False)
    floor = aggregator.registry.get(slow).local_pace
    aggregator.registry.pace_local(slow, landed=True)
    grown = aggregator.registry.get(slow).local_pace

    # Assert: halved per miss, never below the floor; its speed estimate is not what changes
    assert missed == 0.5
    assert floor == max(MIN_LOCAL_PACE, 0.5 ** 4)
    assert grown == pytest.approx(floor * 1.25)
    sized = [local_work_size(overhead_s=0.05, samples_per_s=20 * pace, transfer_s=0.5, step_s=0.5,
                             staleness_bound=8, staleness_exponent=0.5, local_batch=16)
             for pace in (1.0, missed)]
    assert sized[1].samples < sized[0].samples


def test_local_updates_are_judged_by_what_the_steps_they_touch_measured():
    from coordinator.planning.local_members import judge_local_updates

    # every other step hands out or applies local work; those take 0.1 s longer
    steps = [(k, 0.6 if k % 2 else 0.5) for k in range(40)]
    costly = judge_local_updates(steps, {k: 2.0 for k in range(1, 40, 2)}, global_batch=64)
    worth = judge_local_updates(steps, {k: 20.0 for k in range(1, 40, 2)}, global_batch=64)

    # cost: 0.1 s on half the steps; gain: 1 (or 10) weighted samples a step at 0.5 s per 64 samples
    assert costly.cost_s == pytest.approx(0.05) and costly.gain_s == pytest.approx(0.5 / 64)
    assert not costly.pays and worth.pays and worth.gain_s == pytest.approx(10 * 0.5 / 64)
    assert judge_local_updates(steps[:15], {k: 2.0 for k in range(1, 15, 2)}, global_batch=64) is None  # 7 and 8


def test_local_samples_are_worth_what_they_add_to_the_steps_goodput_at_the_measured_noise_scale():
    from coordinator.planning.local_members import judge_local_updates

    steps = [(k, 0.55 if k % 2 else 0.5) for k in range(40)]
    work = {k: 20.0 for k in range(1, 40, 2)}  # 10 weighted samples a step, 0.025 s a step cost

    unknown = judge_local_updates(steps, work, global_batch=64)
    noisy = judge_local_updates(steps, work, global_batch=64, noise_scale=1e6)
    quiet = judge_local_updates(steps, work, global_batch=64, noise_scale=16.0)

    # Assert: a noise scale far above the batch leaves every sample its full worth (as unknown does);
    # one far below it makes more samples a step worth little: (74 / 64) x (80 / 90) - 1 of a step
    assert unknown.gain_s == pytest.approx(10 * 0.5 / 64) and unknown.efficiency == 1.0 and unknown.pays
    assert noisy.gain_s == pytest.approx(unknown.gain_s, rel=1e-3) and noisy.pays
    assert quiet.efficiency == pytest.approx(80 / 90)
    assert quiet.gain_s == pytest.approx(0.5 * (74 / 64 * 80 / 90 - 1)) and not quiet.pays


def test_a_plan_whose_local_updates_measured_a_loss_keeps_none_until_they_are_measured_again():
    from coordinator.planning.live import MEASURED_FOR_STEPS, LivePlanner
    from edgetrain.config import PlannerConfig

    fleet = _fleet()
    live = LivePlanner(PlannerConfig(enabled=True), _model(), 64, staleness_bound=8)
    first = live.decide(0, fleet)
    assert first.plan.local_boards == ("slow",)

    paused = live.pause_local(40)
    during = [p.local_boards for p in live.alternatives(40, fleet)]
    renamed = fleet[:-1] + [replace(fleet[-1], name="slow2")]
    left = live.decide(41, renamed)  # a re-plan while paused (a board left, another joined)
    after = live.decide(41 + MEASURED_FOR_STEPS, fleet)

    assert paused.local_boards == () and dict(paused.left_out)["slow"] == NO_GAIN
    assert all(boards == () for boards in during)
    assert left.plan.local_boards == ()
    assert after.plan.local_boards == ("slow",)  # measured again
