"""Job scheduling (issue 7): capacity, no preemption, hard requests, exactness, hand-checked wins."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.jobs.scheduler import (
    SCHEDULERS,
    Assignment,
    Board,
    FleetState,
    Job,
    Plan,
    RollingConfig,
    Running,
    fits,
    rolling,
    utility,
)
from edgetrain.emulator.job_simulator import (
    BoardEvent,
    SimResult,
    SimulationError,
    TraceSpec,
    poisson_trace,
    scaled_sum_oracle,
    simulate,
)

pytestmark = pytest.mark.timeout(60)
SPEEDS = {"fast": {"m": 3.0}, "mid": {"m": 2.0}, "slow": {"m": 1.0}}
KEEP_REQUESTS = ("rolling", "fifo", "first_fit", "static")
"""Schedulers that honour requests (all of them: static allocates whole groups but keeps requests)."""
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def unit_fleet(n: int) -> list[Board]:
    return [Board(f"b{i}", "slow") for i in range(1, n + 1)]


def soft(id: str, arrival: float, work: float, lo: int = 1, hi: int = 2) -> Job:
    return Job(id=id, arrival=arrival, kind="soft", model="m", work=work, min_boards=lo, max_boards=hi)


@st.composite
def scenarios(draw) -> tuple[list[Board], list[Job], list[BoardEvent]]:
    """A small fleet, a trace of hard and soft jobs, and maybe one board leaving and coming back."""
    boards = [Board(f"b{i}", draw(st.sampled_from(sorted(SPEEDS)))) for i in range(draw(st.integers(2, 5)))]
    names = [b.name for b in boards]
    jobs = []
    for i in range(draw(st.integers(1, 9))):
        common = {"id": f"j{i}", "arrival": draw(st.floats(0, 50)), "model": "m",
                  "work": draw(st.floats(1, 100)), "priority": draw(st.sampled_from([1.0, 2.0]))}
        shape = draw(st.sampled_from(["named", "count", "soft"]))
        if shape == "named":
            chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
            jobs.append(Job(kind="hard", boards=frozenset(chosen), **common))
        elif shape == "count":
            jobs.append(Job(kind="hard", count=draw(st.integers(1, len(names))), **common))
        else:
            lo = draw(st.integers(1, len(names)))
            jobs.append(Job(kind="soft", min_boards=lo, max_boards=draw(st.integers(lo, 6)), **common))
    events = []
    if draw(st.booleans()):
        leave = draw(st.floats(0, 40))
        board = draw(st.sampled_from(boards))
        events = [BoardEvent(leave, board, False), BoardEvent(leave + draw(st.floats(1, 40)), board, True)]
    return boards, jobs, events


def assert_valid_run(result: SimResult, boards, jobs, events, keeps_requests: bool) -> None:
    """Every job ran once, uninterrupted, on boards nobody else held, present when it started."""
    speed = scaled_sum_oracle(SPEEDS)
    assert [r.job.id for r in result.records] == [j.id for j in jobs]
    for r in result.records:
        order = tuple(b for b in boards if b.name in r.boards)
        assert r.start >= r.job.arrival
        assert r.finish == pytest.approx(r.start + r.job.work / speed(r.job, order))
        if keeps_requests:
            assert fits(r.job, r.boards), (r.job, r.boards)
    for board in boards:
        spans = sorted((r.start, r.finish) for r in result.records if board.name in r.boards)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 1e-9, f"{board.name} holds two jobs at {start}"
    for leave, join in itertools.pairwise(events):
        for r in result.records:
            if leave.board.name in r.boards:
                assert not leave.time <= r.start < join.time, f"{r.job.id} started on a departed board"


@PROPERTY
@given(scenarios())
def test_capacity_never_exceeded_and_nothing_preempted(scenario) -> None:
    # Prepare
    boards, jobs, events = scenario
    speed = scaled_sum_oracle(SPEEDS)
    for name in SCHEDULERS:
        # Execute
        result = simulate(jobs, boards, speed, name, board_events=events)
        # Assert
        assert_valid_run(result, boards, jobs, events, keeps_requests=name in KEEP_REQUESTS)


@st.composite
def states(draw) -> FleetState:
    """A fleet at t=10 with some jobs running (predicted finishes ahead) and some waiting."""
    boards = [Board(f"b{i}", draw(st.sampled_from(sorted(SPEEDS)))) for i in range(draw(st.integers(2, 6)))]
    free = [b.name for b in boards]
    running = []
    for i in range(draw(st.integers(0, 3))):
        if not free:
            break
        held = draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
        free = [b for b in free if b not in held]
        job = soft(f"r{i}", 0.0, 10.0, 1, len(held))
        running.append(Running(job=job, boards=frozenset(held), start=0.0, finish=10 + draw(st.floats(0, 30))))
    waiting = tuple(soft(f"w{i}", draw(st.floats(0, 10)), draw(st.floats(1, 80)), 1, draw(st.integers(1, 6)))
                    for i in range(draw(st.integers(1, 7))))
    arrivals = tuple(sorted([0.0] + [j.arrival for j in waiting]))
    return FleetState(boards=tuple(boards), speed=scaled_sum_oracle(SPEEDS), running=tuple(running),
                      waiting=waiting, arrivals=arrivals)


@PROPERTY
@given(states())
def test_rolling_plan_respects_capacity_over_time(state: FleetState) -> None:
    # Execute
    plan = rolling(10.0, state)
    # Assert: every waiting job planned once, from now on, within its request
    assert sorted(a.job_id for a in plan.assignments) == sorted(j.id for j in state.waiting)
    jobs = {j.id: j for j in state.waiting}
    spans = [(r.boards, 10.0, r.finish) for r in state.running]
    for a in plan.assignments:
        assert a.start >= 10.0 and fits(jobs[a.job_id], a.boards)
        spans.append((a.boards, a.start, a.finish))
    # ... and no board is held twice at any time, running jobs holding theirs to the end
    for (b1, s1, f1), (b2, s2, f2) in itertools.combinations(spans, 2):
        assert not (b1 & b2) or f1 <= s2 + 1e-9 or f2 <= s1 + 1e-9


def brute_force(state: FleetState, now: float) -> float:
    """Least Σ w (C − a) over every order and every subset of boards, each job placed after its
    boards' last bookings or, when all are free now, now in the gap before their next booking."""
    avail = {b.name: now for b in state.boards}
    for r in state.running:
        for b in r.boards:
            avail[b] = max(now, r.finish)
    gap = {b: math.inf for b, t in avail.items() if t <= now}

    def best(rest: tuple[Job, ...], avail: dict[str, float], gap: dict[str, float]) -> float:
        value = 0.0 if not rest else math.inf
        for (i, job), k in itertools.product(enumerate(rest), range(1, len(avail) + 1)):
            for names in itertools.combinations(sorted(avail), k):
                if not fits(job, names):
                    continue
                duration = job.work / state.speed(job, tuple(b for b in state.boards if b.name in names))
                start = max(avail[b] for b in names)
                after = {b: start + duration for b in names}
                later_gap = {**gap, **{b: start for b in names if gap.get(b) == math.inf and start > now}}
                later_gap = {b: t for b, t in later_gap.items() if not (b in names and start <= now)}
                value = min(value, job.priority * (start + duration - job.arrival)
                            + best(rest[:i] + rest[i + 1 :], {**avail, **after}, later_gap))
                if all(gap.get(b, -1) >= now + duration for b in names) and start > now:
                    inside = {b: t for b, t in gap.items() if b not in names}
                    last = {b: now + duration for b in names if gap[b] == math.inf}
                    value = min(value, job.priority * (now + duration - job.arrival)
                                + best(rest[:i] + rest[i + 1 :], {**avail, **last}, inside))
        return value

    return best(state.waiting, avail, gap)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.lists(st.tuples(st.floats(1, 50), st.integers(1, 3), st.booleans()),
                                   min_size=1, max_size=3), st.lists(st.floats(0, 20), min_size=1, max_size=2))
def test_branch_and_bound_is_exact_on_small_homogeneous_fleets(n, specs, busy_until) -> None:
    # Prepare: identical boards, some busy; all jobs arrived together, so the future term is 0
    boards = tuple(unit_fleet(n))
    held = tuple(Running(job=soft(f"r{i}", 0.0, 1.0), boards=frozenset({f"b{i + 1}"}), start=0.0, finish=t)
                 for i, t in enumerate(busy_until))
    waiting = tuple(
        Job(id=f"w{i}", arrival=0.0, kind="hard", model="m", work=w, count=min(k, n)) if hard
        else soft(f"w{i}", 0.0, w, 1, k)
        for i, (w, k, hard) in enumerate(specs)
    )
    state = FleetState(boards=boards, speed=scaled_sum_oracle(SPEEDS, alpha=0.3), running=held,
                       waiting=waiting, arrivals=(0.0,))
    config = RollingConfig(node_budget=10**6, max_times=10, max_counts=10)
    # Execute
    plan = rolling(0.0, state, config)
    greedy = rolling(0.0, state, RollingConfig(exact_jobs=0, max_times=10, max_counts=10))
    # Assert
    assert plan.exact
    assert plan.objective == pytest.approx(brute_force(state, 0.0))
    assert plan.objective <= greedy.objective + 1e-9


def test_rolling_beats_fifo_and_first_fit_by_hand() -> None:
    # Prepare: two boards of 1 sample/s, alpha 0.5: one board 1/s, both 2 / 1.5 = 4/3 /s.
    # A, B (12 samples, 1..2 boards) at t=0; C (12 samples, 1..2 boards) at t=100, fleet idle.
    boards = unit_fleet(2)
    speed = scaled_sum_oracle(SPEEDS, alpha=0.5)
    jobs = [soft("A", 0.0, 12.0), soft("B", 0.0, 12.0), soft("C", 100.0, 12.0)]
    # Execute
    results = {name: simulate(jobs, boards, speed, name) for name in SCHEDULERS}
    # Assert
    # fifo: minimal requests, every job on one board: 12, 12, 12 s -> average 12.
    assert [r.jct for r in results["fifo"].records] == pytest.approx([12, 12, 12])
    # first_fit: full requests: A both boards 12 / (4/3) = 9 s, B waits for them (9 + 9 = 18),
    # C 9 s -> average 12.
    assert [r.jct for r in results["first_fit"].records] == pytest.approx([9, 18, 9])
    # rolling at t=0 (one arrival time so far, future term 0): A, B side by side 12 + 12 = 24
    # beats A then B on both boards 9 + 18 = 27. At t=100: arrival rate 2 / 100 s, backlog
    # 12 / 2 = 6 fleet-s, lambda = 0.12; one board: 12 + 0.12 * 12 / 2 = 12.72, both boards:
    # 9 + 0.12 * (9 + 9) / 2 = 10.08 -> both. JCTs 12, 12, 9 -> average 11.
    assert [r.jct for r in results["rolling"].records] == pytest.approx([12, 12, 9])
    assert results["rolling"].avg_jct == pytest.approx(11.0)
    # static (groups of 2 = the whole fleet here) runs like first_fit
    assert results["static"].avg_jct == pytest.approx(12.0)


def test_rolling_backfills_where_fifo_blocks_by_hand() -> None:
    # Prepare: two boards of 1 sample/s, alpha 0. R (10 samples, 1 board) at 0 runs 0-10 on b1.
    # At 1: H hard, any 2 boards, 20 samples; S 4 samples on 1 board.
    boards = unit_fleet(2)
    speed = scaled_sum_oracle(SPEEDS, alpha=0.0)
    jobs = [soft("R", 0.0, 10.0, 1, 1),
            Job(id="H", arrival=1.0, kind="hard", model="m", work=20.0, count=2),
            soft("S", 1.0, 4.0, 1, 1)]
    # Execute
    fifo = simulate(jobs, boards, speed, "fifo")
    rolled = simulate(jobs, boards, speed, "rolling")
    # Assert
    # fifo: H waits for b1 (10-20), S behind it (20-24): JCTs 10, 19, 23.
    assert [r.jct for r in fifo.records] == pytest.approx([10, 19, 23])
    # rolling: S on b2 at 1-5 does not delay H (which needs b1, free at 10): JCTs 10, 19, 4.
    assert [r.jct for r in rolled.records] == pytest.approx([10, 19, 4])


def test_hard_job_gets_exactly_its_request() -> None:
    # Prepare: a fast board nobody named; the hard jobs must not be given it
    boards = [Board("a", "fast"), Board("b", "slow"), Board("c", "slow")]
    speed = scaled_sum_oracle(SPEEDS)
    jobs = [Job(id="named", arrival=0.0, kind="hard", model="m", work=10.0, boards=frozenset({"b", "c"})),
            Job(id="one", arrival=0.0, kind="hard", model="m", work=10.0, count=1),
            soft("elastic", 0.0, 10.0, 1, 3)]
    for name in KEEP_REQUESTS:
        # Execute
        records = {r.job.id: r for r in simulate(jobs, boards, speed, name).records}
        # Assert
        assert records["named"].boards == {"b", "c"}
        assert len(records["one"].boards) == 1


def test_job_naming_a_departed_board_waits_for_it() -> None:
    # Prepare: b2 leaves at 0 and returns at 50; a job naming it arrives at 1
    boards = unit_fleet(2)
    events = [BoardEvent(0.0, boards[1], False), BoardEvent(50.0, boards[1], True)]
    jobs = [Job(id="x", arrival=1.0, kind="hard", model="m", work=5.0, boards=frozenset({"b2"}))]
    for name in KEEP_REQUESTS:
        # Execute
        (record,) = simulate(jobs, boards, scaled_sum_oracle(SPEEDS), name, board_events=events).records
        # Assert
        assert record.start == pytest.approx(50.0)


def test_simulator_rejects_a_scheduler_that_breaks_the_rules() -> None:
    boards = unit_fleet(2)
    speed = scaled_sum_oracle(SPEEDS)
    jobs = [soft("A", 0.0, 10.0), soft("B", 0.0, 10.0)]

    def everything_everywhere(now: float, state: FleetState) -> Plan:
        return Plan(assignments=tuple(Assignment(job_id=j.id, boards=frozenset({"b1", "b2"}), start=now,
                                                 finish=now + 1) for j in state.waiting))

    def idle(now: float, state: FleetState) -> Plan:
        return Plan(assignments=())

    with pytest.raises(SimulationError, match="busy"):
        simulate(jobs, boards, speed, everything_everywhere)
    with pytest.raises(SimulationError, match="never ran"):
        simulate(jobs, boards, speed, idle)


def test_utility_is_speed_up_over_the_smallest_request() -> None:
    # two 1/s boards, alpha 0.5: both boards 2 / 1.5 = 4/3 /s, one board 1/s -> utility 4/3
    boards = tuple(unit_fleet(2))
    speed = scaled_sum_oracle(SPEEDS, alpha=0.5)
    assert utility(soft("A", 0.0, 1.0), boards, boards, speed) == pytest.approx(4 / 3)
    assert utility(soft("A", 0.0, 1.0), boards[:1], boards, speed) == pytest.approx(1.0)


def test_trace_has_the_requested_mix_and_load() -> None:
    # Prepare
    boards = [Board("f", "fast"), Board("s1", "slow"), Board("s2", "slow")]
    speed = scaled_sum_oracle({k: {"resnet18": v["m"], "mobilenet_v2": 4 * v["m"]} for k, v in SPEEDS.items()})
    spec = TraceSpec(n_jobs=2000, load=0.9, seed=1, work_range=(100.0, 1000.0))
    # Execute
    trace = poisson_trace(spec, boards, speed)
    # Assert
    assert trace == poisson_trace(spec, boards, speed)
    assert sum(j.model == "resnet18" for j in trace) == 1000
    assert sum(j.kind == "hard" for j in trace) == 600
    assert all(100.0 <= j.work <= 1000.0 for j in trace)
    demand = sum(j.work / sum(speed(j, (b,)) for b in boards) for j in trace)
    assert demand / trace[-1].arrival == pytest.approx(0.9, rel=0.1)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_finishes_a_generated_trace(name: str) -> None:
    boards = [Board(f"b{i}", kind) for i, kind in enumerate(["fast", "mid", "slow", "slow"])]
    speed = scaled_sum_oracle({k: {"resnet18": v["m"], "mobilenet_v2": 4 * v["m"]} for k, v in SPEEDS.items()})
    trace = poisson_trace(TraceSpec(n_jobs=60, load=0.9, seed=7, work_range=(50.0, 500.0)), boards, speed)
    result = simulate(trace, boards, speed, name)
    assert len(result.records) == 60 and result.makespan > 0


def test_static_allocates_whole_groups_and_keeps_hard_requests_by_hand() -> None:
    # Prepare: four boards of 1 sample/s in groups (b1, b2), (b3, b4); alpha 0.
    boards = unit_fleet(4)
    speed = scaled_sum_oracle(SPEEDS, alpha=0.0)
    named = Job(id="N", arrival=0.0, kind="hard", model="m", work=10.0, boards=frozenset({"b2"}))
    spread = soft("S", 0.0, 10.0, lo=1, hi=1)
    three = Job(id="T", arrival=0.0, kind="hard", model="m", work=30.0, count=3)
    # Execute
    result = simulate([named, spread, three], boards, speed, "static")
    # Assert: N holds group 1 but trains on b2 alone; S takes group 2 and uses one board of it;
    # T (3 boards) needs both groups, so it starts when both are free, at 10 s, and runs 10 s.
    records = {r.job.id: r for r in result.records}
    assert records["N"].boards == {"b2"} and records["N"].start == 0.0
    assert len(records["S"].boards) == 1 and records["S"].boards <= {"b3", "b4"}
    assert records["T"].start == pytest.approx(10.0) and len(records["T"].boards) == 3
    assert records["T"].finish == pytest.approx(20.0)
