"""Discrete-event simulator for the job schedulers of ``coordinator/jobs/scheduler.py``, and a trace generator.

``simulate(trace, boards, speed, scheduler) -> SimResult`` replays a list of jobs (plus board
joins and leaves) against any scheduler through the same ``(now, state) -> Plan`` call the
coordinator makes. Events are arrivals, completions and board joins/leaves; after all events at
one instant the scheduler is asked once and its launches are checked (waiting job, placeable idle
boards) and started. A job runs at ``speed(job, boards)`` from start to finish: the oracle is
taken as exact, so a predicted finish is the finish. A board that leaves while busy drains: it
takes no new job and leaves the fleet when its job completes.

``poisson_trace`` draws a job trace at a given offered load; ``scaled_sum_oracle`` is the simple
throughput model the benchmark and tests use (a model, not a measurement).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.jobs.scheduler import (
    EPS,
    SCHEDULERS,
    Board,
    FleetState,
    Job,
    Running,
    Scheduler,
    SpeedOracle,
)


class SimulationError(RuntimeError):
    """A scheduler broke a rule (busy or absent boards, unknown job) or left jobs stranded."""


@dataclass(frozen=True)
class BoardEvent:
    """A board joins or leaves the fleet at ``time``."""

    time: float
    board: Board
    joined: bool


@dataclass(kw_only=True, frozen=True)
class JobRecord:
    """How one job ran."""

    job: Job
    start: float
    finish: float
    boards: frozenset[str]

    @property
    def jct(self) -> float:
        """Job completion time: finish minus arrival, s."""
        return self.finish - self.job.arrival


@dataclass(kw_only=True, frozen=True)
class SimResult:
    """Every job's record (in trace order) and the run's summary."""

    scheduler: str
    records: tuple[JobRecord, ...]
    plans: int
    """Scheduler calls."""
    exact_plans: int
    """Calls whose plan was proven optimal over the plan space."""

    @property
    def avg_jct(self) -> float:
        return sum(r.jct for r in self.records) / len(self.records)

    @property
    def p95_jct(self) -> float:
        """Nearest-rank 95th percentile of JCT."""
        jcts = sorted(r.jct for r in self.records)
        return jcts[math.ceil(0.95 * len(jcts)) - 1]

    @property
    def makespan(self) -> float:
        """Last finish minus first arrival, s."""
        return max(r.finish for r in self.records) - min(r.job.arrival for r in self.records)

    def summary(self) -> dict[str, float]:
        return {"avg_jct": self.avg_jct, "p95_jct": self.p95_jct, "makespan": self.makespan}


@dataclass
class _Fleet:
    """The simulator's mutable world."""

    boards: dict[str, Board]
    leaving: set[str]
    running: dict[str, Running]
    waiting: list[Job]
    arrivals: list[float]

    def busy(self) -> set[str]:
        return {b for r in self.running.values() for b in r.boards}

    def state(self, speed: SpeedOracle) -> FleetState:
        return FleetState(
            boards=tuple(self.boards.values()), speed=speed, running=tuple(self.running.values()),
            waiting=tuple(self.waiting), leaving=frozenset(self.leaving), arrivals=tuple(self.arrivals),
        )

    def board_event(self, event: BoardEvent) -> None:
        name = event.board.name
        if event.joined:
            self.boards[name] = event.board
            self.leaving.discard(name)
        elif name in self.busy():
            self.leaving.add(name)
        else:
            self.boards.pop(name, None)

    def complete(self, job_id: str) -> Running:
        done = self.running.pop(job_id)
        for name in done.boards & self.leaving:
            self.leaving.discard(name)
            self.boards.pop(name, None)
        return done


def _apply(now: float, fleet: _Fleet, launches, speed: SpeedOracle) -> list[Running]:
    """Start the launches after checking them; returns what started."""
    started = []
    for a in launches:
        job = next((j for j in fleet.waiting if j.id == a.job_id), None)
        if job is None:
            raise SimulationError(f"t={now:.3f}: launch of {a.job_id}, which is not waiting")
        free = fleet.boards.keys() - fleet.leaving - fleet.busy()
        if not a.boards or not a.boards <= free:
            raise SimulationError(f"t={now:.3f}: {a.job_id} launched on busy or absent boards {sorted(a.boards)}")
        order = tuple(b for b in fleet.boards.values() if b.name in a.boards)
        run = Running(job=job, boards=a.boards, start=now, finish=now + job.duration(speed(job, order)))
        fleet.waiting.remove(job)
        fleet.running[job.id] = run
        started.append(run)
    return started


def simulate(
    trace: Sequence[Job],
    boards: Sequence[Board],
    speed: SpeedOracle,
    scheduler: str | Scheduler = "rolling",
    board_events: Sequence[BoardEvent] = (),
) -> SimResult:
    """Run ``trace`` on ``boards`` under ``scheduler`` (a name in SCHEDULERS or a callable)."""
    schedule = SCHEDULERS[scheduler] if isinstance(scheduler, str) else scheduler
    fleet = _Fleet({b.name: b for b in boards}, set(), {}, [], [])
    events: list[tuple[float, int, object]] = []
    for seq, item in enumerate([*trace, *board_events]):
        events.append((item.arrival if isinstance(item, Job) else item.time, seq, item))
    heapq.heapify(events)
    seq, records, plans, exact_plans = len(events), {}, 0, 0
    while events:
        now = events[0][0]
        while events and events[0][0] <= now + EPS:
            now, _, item = heapq.heappop(events)
            if isinstance(item, Job):
                fleet.waiting.append(item)
                fleet.arrivals.append(item.arrival)
            elif isinstance(item, BoardEvent):
                fleet.board_event(item)
            else:
                done = fleet.complete(item)
                records[item] = JobRecord(job=done.job, start=done.start, finish=done.finish, boards=done.boards)
        if not fleet.waiting:
            continue
        plan = schedule(now, fleet.state(speed))
        plans, exact_plans = plans + 1, exact_plans + plan.exact
        for run in _apply(now, fleet, plan.launches(now), speed):
            heapq.heappush(events, (run.finish, seq, run.job.id))
            seq += 1
    if fleet.waiting or fleet.running:
        raise SimulationError(f"jobs never ran: {[j.id for j in fleet.waiting]}")
    name = scheduler if isinstance(scheduler, str) else getattr(scheduler, "__name__", "custom")
    return SimResult(scheduler=name, records=tuple(records[j.id] for j in trace), plans=plans,
                     exact_plans=exact_plans)


def scaled_sum_oracle(per_board: Mapping[str, Mapping[str, float]], alpha: float = 0.08) -> SpeedOracle:
    """A throughput model: speed = Σ per_board[kind][model] · 1 / (1 + alpha · (n − 1)).

    Data parallelism over n boards loses a share that grows with n (synchronisation); the sum
    is the boards' speeds computing alone. A model to compare schedulers, not a measurement.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")

    def speed(job: Job, boards: tuple[Board, ...]) -> float:
        total = sum(per_board[b.kind][job.model] for b in boards)
        return total / (1.0 + alpha * (len(boards) - 1))

    return speed


@dataclass(kw_only=True, frozen=True)
class TraceSpec:
    """What ``poisson_trace`` draws."""

    n_jobs: int
    load: float
    """Offered load: mean work arriving per second over the fleet's capacity (every board alone)."""
    seed: int = 0
    models: tuple[str, ...] = ("resnet18", "mobilenet_v2")
    """Drawn in equal numbers."""
    hard_fraction: float = 0.3
    work_range: tuple[float, float] = (5_000.0, 50_000.0)
    """Samples, log-uniform."""
    hard_counts: tuple[int, ...] = (1, 2, 4)
    """Board counts of hard jobs (half name their boards, half ask for any k)."""
    soft_max: tuple[int, ...] = (2, 4, 8)
    """max_boards of soft jobs (min_boards is 1)."""

    def __post_init__(self) -> None:
        if self.n_jobs < 1 or not 0 < self.load:
            raise ValueError("n_jobs must be >= 1 and load > 0")
        if not 0 < self.work_range[0] <= self.work_range[1]:
            raise ValueError(f"bad work_range {self.work_range}")


def _mean_work(lo: float, hi: float) -> float:
    return (hi - lo) / math.log(hi / lo) if hi > lo else lo


def poisson_trace(spec: TraceSpec, boards: Sequence[Board], speed: SpeedOracle) -> tuple[Job, ...]:
    """Poisson arrivals at ``spec.load`` of the fleet's capacity; fixed by ``spec.seed``."""
    rng = random.Random(spec.seed)
    capacity = {}
    for model in spec.models:
        probe = Job(id="probe", arrival=0.0, kind="soft", model=model, work=1.0)
        capacity[model] = sum(speed(probe, (b,)) for b in boards)
    mean_demand = _mean_work(*spec.work_range) * sum(1 / c for c in capacity.values()) / len(capacity)
    rate = spec.load / mean_demand
    models = [spec.models[i % len(spec.models)] for i in range(spec.n_jobs)]
    hard = [i < round(spec.hard_fraction * spec.n_jobs) for i in range(spec.n_jobs)]
    rng.shuffle(models)
    rng.shuffle(hard)
    names = [b.name for b in boards]
    lo, hi = spec.work_range
    t, jobs = 0.0, []
    for i in range(spec.n_jobs):
        t += rng.expovariate(rate)
        work = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        common = {"id": f"j{i:03d}", "arrival": t, "model": models[i], "work": work}
        if hard[i]:
            k = min(rng.choice(spec.hard_counts), len(names))
            if rng.random() < 0.5:
                jobs.append(Job(kind="hard", boards=frozenset(rng.sample(names, k)), **common))
            else:
                jobs.append(Job(kind="hard", count=k, **common))
        else:
            jobs.append(Job(kind="soft", min_boards=1, max_boards=rng.choice(spec.soft_max), **common))
    return tuple(jobs)
