"""Several training jobs share one fleet: a rolling-horizon, utility-driven scheduler (issue 7).

Pure data and pure functions (no torch, sockets or clocks): ``SCHEDULERS[name](now, state) -> Plan``.
Something else (the simulator in ``edgetrain/emulator/job_simulator.py``, later the coordinator) applies the plan's launches.

Model. Job j arrives at a_j with W_j samples of work and priority w_j. A *hard* job has exactly one
request: a named set of boards, or any k boards. A *soft* job takes any set of min..max boards.
The throughput oracle ``speed(job, boards)`` predicts samples/s of a job on a set of boards (the
hybrid planner's prediction in the coordinator, a formula in the simulator). The utility of a
request R is its predicted speed-up over the job's smallest request,
u_j(R) = speed(j, R) / speed(j, R_j^min), with R_j^min the hard request itself (for k boards: the k
fastest) or the min_boards fastest boards of the fleet. Started at s_j on R_j, job j holds R_j until
its predicted finish C_j = s_j + W_j / (u_j(R_j) · speed(j, R_j^min)); it is never preempted,
migrated or reconfigured, and a leaving board takes no new job.

Objective (``rolling``). At every event (arrival, completion, board join or leave) every waiting job
gets a request R_j and a planned start s_j >= now, chosen to minimise

    F = Σ_j w_j · (C_j − a_j)  +  λ · Σ_j H_j

subject to board capacity over time (a board holds one job at a time; running jobs hold theirs
until their predicted finish). The first term is the priority-weighted predicted completion time
(JCT) of the waiting jobs. The second prices what the plan takes from jobs not yet arrived: H_j is
the fleet-time j holds, Σ_{b in R_j} v_jb · (C_j − free_b) / Σ_{all b} v_jb with v_jb the job's
speed on board b alone and free_b when b was free before j (so it counts the time a board is held
idle until the rest of the set is free); a job on boards that scale perfectly and never wait holds
exactly W_j / Σ_b v_jb, whatever its request, so the term only charges scaling losses and idle
holds. Each later arrival is pushed back by about H_j, hence λ = observed arrival rate × mean
priority × fleet-time of the present backlog (waiting work plus what is left of running jobs).
Without it a lone job would take every board at poor scaling efficiency just before the next
arrival. Only assignments with s_j = now are launched; the rest is planned again at the next event.

Method. A plan is built as a serial schedule: jobs in some order, each taking one *option*:
- (k, t): the k fastest boards (by the job's single-board speed; among equals the latest free, a
  best fit) whose bookings so far end by time t, starting when all of them are free; k ranges over
  the job's counts (a soft range thinned to a geometric ladder of ``max_counts``), t over the first
  ``max_times`` distinct times at which k boards are free;
- (k, now) in a gap: the k fastest boards that are free now and stay free (before a later booking)
  until the job would finish there, among equals the shortest such gap (backfilling).
- Exact (at most ``exact_jobs`` waiting jobs): depth-first branch and bound over orders × options
  returns the minimum of F over this plan space (bound: each unplaced job starts no earlier than its
  k_min-th board is free, runs at its best speed, and holds at least W_j / Σ_b v_jb; valid for
  oracles under which a faster board never slows a set and a set is never faster than the sum of
  its boards alone). When ``node_budget`` runs out the best plan found is kept, ``Plan.exact`` False.
- Heuristic beyond: greedy list scheduling over the ``window`` oldest waiting jobs. Each unplaced
  job picks its option with the least term of F, w_j·(C_j − a_j) + λ·H_j, and the job with the
  least weighted time to finish (C_j − now) / w_j is placed next (Smith's rule). Jobs beyond the
  window follow in arrival order with the same option rule, so they only take what the window
  leaves (conservative backfilling). No bound is claimed. The greedy plan also seeds the search.

Baselines, same interface, launching only (nothing planned ahead):
- ``fifo``: arrival order, each job its minimal request (soft: min_boards fastest free boards); the
  first job that does not fit blocks everything behind it.
- ``first_fit``: Kubernetes-style; arrival order, each job its request (soft: max_boards, capped at
  the fleet), on the fastest free boards if they fit now, else skipped.
- ``static``: the fleet cut into fixed groups of ``group_size`` boards in fleet order; groups are
  the unit of allocation. Each job, in arrival order, takes whole free groups: a soft job the first
  free group (more, in fleet order, until it has ``min_boards``) and trains on its boards up to
  ``max_boards``; a hard job exactly its request, taking every group that holds a board it names
  (all must be free), or the first free groups holding at least ``count`` boards, on the fastest
  ``count`` of them. Boards of a taken group that the job does not use stay idle until it ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

JobKind = Literal["hard", "soft"]
EPS = 1e-9
"""Times closer than this are equal (a plan's "now")."""


@dataclass(kw_only=True, frozen=True)
class Job:
    """A training job as the scheduler sees it."""

    id: str
    arrival: float
    """Submission time, s."""
    kind: JobKind
    model: str
    work: float
    """Samples to train."""
    priority: float = 1.0
    """Weight of this job's completion time in the objective."""
    boards: frozenset[str] | None = None
    """Hard job: exactly these boards."""
    count: int | None = None
    """Hard job: exactly this many boards, any of them."""
    min_boards: int = 1
    """Soft job: fewest boards it runs on."""
    max_boards: int = 1
    """Soft job: most boards it can use."""
    overhead_s: float = 0.0
    """Seconds it runs besides training: from launch to its first step (its coordinator starts,
    boards join and profile) and from its last step to its end (final evaluation, checkpoint)."""

    def duration(self, samples_per_s: float) -> float:
        """Predicted seconds from launch to finish at this speed."""
        return self.overhead_s + self.work / samples_per_s

    def __post_init__(self) -> None:
        if self.work <= 0 or self.priority <= 0 or self.overhead_s < 0:
            raise ValueError(f"job {self.id}: work and priority must be > 0, overhead_s >= 0")
        if self.kind == "hard" and (self.boards is None) == (self.count is None):
            raise ValueError(f"hard job {self.id}: give exactly one of boards or count")
        if self.kind == "hard" and (len(self.boards or ()) if self.count is None else self.count) < 1:
            raise ValueError(f"hard job {self.id}: request at least one board")
        if self.kind == "soft" and not 1 <= self.min_boards <= self.max_boards:
            raise ValueError(f"soft job {self.id}: need 1 <= min_boards <= max_boards")
        if self.kind not in ("hard", "soft"):
            raise ValueError(f"job {self.id}: kind must be hard or soft, got {self.kind!r}")


@dataclass(frozen=True)
class Board:
    """A board of the fleet; boards of one kind are alike."""

    name: str
    kind: str


SpeedOracle = Callable[[Job, tuple[Board, ...]], float]
"""Predicted samples/s of a job on a set of boards (given in fleet order)."""


@dataclass(kw_only=True, frozen=True)
class Running:
    """A job that holds its boards until its predicted finish."""

    job: Job
    boards: frozenset[str]
    start: float
    finish: float


@dataclass(kw_only=True, frozen=True)
class FleetState:
    """What a scheduler sees at an event."""

    boards: tuple[Board, ...]
    """Boards in the fleet, including leaving ones still finishing a job."""
    speed: SpeedOracle
    running: tuple[Running, ...] = ()
    waiting: tuple[Job, ...] = ()
    """Waiting jobs in arrival order."""
    leaving: frozenset[str] = frozenset()
    """Boards that take no new job."""
    arrivals: tuple[float, ...] = ()
    """Arrival times seen so far, for the arrival-rate estimate."""


@dataclass(kw_only=True, frozen=True)
class Assignment:
    """A waiting job's planned request and start."""

    job_id: str
    boards: frozenset[str]
    start: float
    finish: float


@dataclass(kw_only=True, frozen=True)
class Plan:
    """A scheduler's answer at one event; only ``launches(now)`` is acted on."""

    assignments: tuple[Assignment, ...]
    objective: float = math.nan
    """F of the rolling plan (NaN for baselines)."""
    exact: bool = False
    """True when the plan is proven optimal over the plan space."""

    def launches(self, now: float) -> tuple[Assignment, ...]:
        """Assignments planned to start now."""
        return tuple(a for a in self.assignments if a.start <= now + EPS)


@dataclass(kw_only=True, frozen=True)
class RollingConfig:
    """Search limits of the rolling scheduler."""

    exact_jobs: int = 4
    """Branch and bound when at most this many jobs wait."""
    node_budget: int = 3000
    """Search nodes before branch and bound keeps its best plan so far."""
    window: int = 12
    """Oldest waiting jobs the greedy heuristic reorders."""
    max_counts: int = 6
    """Board counts tried per soft job."""
    max_times: int = 3
    """Start times tried per board count."""

    def __post_init__(self) -> None:
        if min(self.node_budget, self.window, self.max_counts, self.max_times) < 1:
            raise ValueError("node_budget, window, max_counts and max_times must be >= 1")
        if self.max_counts < 2:
            raise ValueError("max_counts must be >= 2 (a soft range keeps both ends)")


def fits(job: Job, boards: Iterable[str]) -> bool:
    """Whether a set of boards is one of the job's requests."""
    names = frozenset(boards)
    if job.kind == "soft":
        return job.min_boards <= len(names) <= job.max_boards
    return names == job.boards if job.boards is not None else len(names) == job.count


def smallest_request(job: Job, boards: tuple[Board, ...], speed: SpeedOracle) -> tuple[Board, ...]:
    """The job's smallest request on this fleet: the named set, else its fewest fastest boards."""
    if job.boards is not None:
        return tuple(b for b in boards if b.name in job.boards)
    k = job.count if job.count is not None else job.min_boards
    return tuple(sorted(boards, key=lambda b: (-speed(job, (b,)), b.name))[:k])


def utility(job: Job, request: tuple[Board, ...], boards: tuple[Board, ...], speed: SpeedOracle) -> float:
    """Predicted speed-up of ``request`` over the job's smallest request on ``boards``."""
    return speed(job, request) / speed(job, smallest_request(job, boards, speed))


@dataclass(frozen=True)
class _Option:
    boards: tuple[str, ...]
    start: float
    finish: float
    held: float
    """Fleet-seconds held: Σ board speed × hold time / the fleet's speed (this job's speeds)."""


def _ladder(lo: int, hi: int, m: int) -> list[int]:
    if hi - lo + 1 <= m:
        return list(range(lo, hi + 1))
    return sorted({round(lo * (hi / lo) ** (i / (m - 1))) for i in range(m)})


@dataclass
class _Context:
    """One rolling plan's fixed inputs and caches."""

    now: float
    state: FleetState
    config: RollingConfig
    placeable: dict[str, Board]
    lam: float = 0.0
    _speeds: dict[tuple[str, frozenset[str]], float] = field(default_factory=dict)
    _singles: dict[str, dict[str, float]] = field(default_factory=dict)

    def single(self, job: Job) -> dict[str, float]:
        """The job's speed on each placeable board alone."""
        if job.id not in self._singles:
            self._singles[job.id] = {n: self.state.speed(job, (b,)) for n, b in self.placeable.items()}
        return self._singles[job.id]

    def speed_of(self, job: Job, names: Iterable[str]) -> float:
        key = (job.id, frozenset(names))
        if key not in self._speeds:
            order = tuple(b for b in self.state.boards if b.name in key[1])
            self._speeds[key] = self.state.speed(job, order)
        return self._speeds[key]

    def counts(self, job: Job) -> list[int]:
        n = len(self.placeable)
        if job.boards is not None:
            return [len(job.boards)] if job.boards <= self.placeable.keys() else []
        if job.count is not None:
            return [job.count] if job.count <= n else []
        hi = min(job.max_boards, n)
        return _ladder(job.min_boards, hi, self.config.max_counts) if job.min_boards <= hi else []

    def option(self, job: Job, names: tuple[str, ...], tl: _Timeline) -> _Option:
        """The job on ``names`` after their last bookings."""
        start = max(tl.avail[b] for b in names)
        finish = start + job.duration(self.speed_of(job, names))
        single = self.single(job)
        held = sum(single[b] * (finish - tl.avail[b]) for b in names) / sum(single.values())
        return _Option(names, start, finish, held)

    def options(self, job: Job, tl: _Timeline) -> list[_Option]:
        """The job's options after the boards' last bookings, and in gaps open now."""
        if job.boards is not None:
            names = tuple(sorted(job.boards))
            return [self.option(job, names, tl), *self.gap_options(job, tl, [len(names)])]
        single, avail = self.single(job), tl.avail
        ranked = sorted(avail, key=lambda b: (-single[b], -avail[b], b))
        free_times = sorted(avail.values())
        times = sorted(set(free_times))
        found: dict[tuple[str, ...], _Option] = {}
        counts = self.counts(job)
        for k in counts:
            for t in [t for t in times if t >= free_times[k - 1]][: self.config.max_times]:
                names = tuple(b for b in ranked if avail[b] <= t)[:k]
                if names not in found:
                    found[names] = self.option(job, names, tl)
        return [*found.values(), *self.gap_options(job, tl, counts)]

    def gap_options(self, job: Job, tl: _Timeline, counts: list[int]) -> list[_Option]:
        """Starting now on boards free now, finishing before their next booking (backfilling)."""
        if all(end == math.inf for end in tl.gap.values()):
            return []
        single = self.single(job)
        free = [b for b in sorted(tl.gap, key=lambda b: (-single[b], tl.gap[b], b))
                if job.boards is None or b in job.boards]
        found = []
        for k in counts:
            while len(free) >= k:
                names = tuple(free[:k])
                finish = tl.now + job.duration(self.speed_of(job, names))
                short = {b for b in names if tl.gap[b] < finish - EPS}
                if not short:
                    held = sum(single[b] for b in names) * (finish - tl.now) / sum(single.values())
                    found.append(_Option(names, tl.now, finish, held))
                    break
                free = [b for b in free if b not in short]
        return found

    def term(self, job: Job, opt: _Option) -> float:
        """The job's term of F."""
        return job.priority * (opt.finish - job.arrival) + self.lam * opt.held


@dataclass(frozen=True)
class _Timeline:
    """Board capacity over time in a partial plan."""

    now: float
    avail: dict[str, float]
    """End of each placeable board's last booking (now when it has none)."""
    gap: dict[str, float]
    """Boards free now, and until when (inf: nothing booked ahead)."""

    @staticmethod
    def of(now: float, state: FleetState) -> _Timeline:
        """Running jobs hold their boards until their predicted finish."""
        avail = {b.name: now for b in state.boards if b.name not in state.leaving}
        for r in state.running:
            for b in r.boards & avail.keys():
                avail[b] = max(now, r.finish)
        return _Timeline(now, avail, {b: math.inf for b, t in avail.items() if t <= now})

    def earliest(self, board: str) -> float:
        return self.now if board in self.gap else self.avail[board]

    def place(self, opt: _Option) -> _Timeline:
        avail, gap = dict(self.avail), dict(self.gap)
        for b in opt.boards:
            if b in gap and opt.start <= self.now + EPS:
                if gap.pop(b) == math.inf:
                    avail[b] = opt.finish
            else:
                if gap.get(b) == math.inf:
                    gap[b] = opt.start
                avail[b] = opt.finish
        return _Timeline(self.now, avail, gap)


def _future_weight(ctx: _Context) -> float:
    """λ: weight of jobs expected to arrive before the present backlog is done."""
    state, arrivals = ctx.state, ctx.state.arrivals
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0] or not ctx.placeable:
        return 0.0
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    backlog = sum(job.work / sum(ctx.single(job).values()) for job in state.waiting)
    for r in state.running:
        left = max(0.0, r.finish - ctx.now) * ctx.speed_of(r.job, r.boards)
        backlog += left / sum(ctx.single(r.job).values())
    jobs = [r.job for r in state.running] + list(state.waiting)
    mean_priority = sum(j.priority for j in jobs) / len(jobs) if jobs else 1.0
    return rate * mean_priority * backlog


def _greedy(ctx: _Context, jobs: list[Job], tl: _Timeline) -> list[tuple[Job, _Option]]:
    window, tail = jobs[: ctx.config.window], jobs[ctx.config.window :]
    placed: list[tuple[Job, _Option]] = []
    while window:
        choices = []
        for i, job in enumerate(window):
            opt = _cheapest(ctx, job, tl)
            choices.append(((opt.finish - ctx.now) / job.priority, i, opt))
        _, i, opt = min(choices, key=lambda c: (c[0], c[1]))
        placed.append((window.pop(i), opt))
        tl = tl.place(opt)
    for job in tail:
        opt = _cheapest(ctx, job, tl)
        placed.append((job, opt))
        tl = tl.place(opt)
    return placed


def _cheapest(ctx: _Context, job: Job, tl: _Timeline) -> _Option:
    """The job's option with the least term of F."""
    return min(ctx.options(job, tl), key=lambda o: ctx.term(job, o))


@dataclass
class _Search:
    """Branch and bound over orders × options; ``best`` starts at a known plan."""

    ctx: _Context
    bounds: dict[str, tuple[int, float, float]]
    best_value: float
    best: list[tuple[Job, _Option]]
    nodes: int = 0
    complete: bool = True

    def lower_bound(self, rest: list[Job], tl: _Timeline) -> float:
        free_times = sorted(tl.earliest(b) for b in tl.avail)
        total = 0.0
        for job in rest:
            k_min, duration, held = self.bounds[job.id]
            start = max(tl.earliest(b) for b in job.boards) if job.boards else free_times[k_min - 1]
            total += job.priority * (start + duration - job.arrival) + self.ctx.lam * held
        return total

    def run(self, rest: list[Job], tl: _Timeline, value: float, placed: list) -> None:
        self.nodes += 1
        if self.nodes > self.ctx.config.node_budget:
            self.complete = False
            return
        if not rest:
            if value < self.best_value - EPS:
                self.best_value, self.best = value, list(placed)
            return
        if value + self.lower_bound(rest, tl) >= self.best_value - EPS:
            return
        children = [
            (value + self.ctx.term(job, opt), i, opt)
            for i, job in enumerate(rest)
            for opt in self.ctx.options(job, tl)
        ]
        for child_value, i, opt in sorted(children, key=lambda c: c[0]):
            job = rest[i]
            self.run(rest[:i] + rest[i + 1 :], tl.place(opt), child_value, placed + [(job, opt)])


def _bounds(ctx: _Context, job: Job) -> tuple[int, float, float]:
    """(fewest boards, shortest duration, least fleet-time held) of any option of the job."""
    single = ctx.single(job)
    ranked = sorted(ctx.placeable, key=lambda b: (-single[b], b))
    sets = [tuple(sorted(job.boards))] if job.boards else [tuple(ranked[:k]) for k in ctx.counts(job)]
    speeds = [ctx.speed_of(job, s) for s in sets]
    return min(len(s) for s in sets), job.duration(max(speeds)), job.work / sum(single.values())


def _plan_value(ctx: _Context, placed: list[tuple[Job, _Option]]) -> float:
    return sum(ctx.term(job, opt) for job, opt in placed)


def rolling(now: float, state: FleetState, config: RollingConfig | None = None) -> Plan:
    """Plan every waiting job (request and start) minimising F; see the module docstring."""
    config = config or RollingConfig()
    placeable = {b.name: b for b in state.boards if b.name not in state.leaving}
    ctx = _Context(now=now, state=state, config=config, placeable=placeable)
    ctx.lam = _future_weight(ctx)
    jobs = [j for j in state.waiting if ctx.counts(j)]
    timeline = _Timeline.of(now, state)
    placed = _greedy(ctx, jobs, timeline)
    exact = False
    if len(jobs) <= config.exact_jobs:
        search = _Search(ctx, {j.id: _bounds(ctx, j) for j in jobs}, _plan_value(ctx, placed), placed)
        search.run(jobs, timeline, 0.0, [])
        placed, exact = search.best, search.complete
    assignments = tuple(
        Assignment(job_id=job.id, boards=frozenset(opt.boards), start=opt.start, finish=opt.finish)
        for job, opt in sorted(placed, key=lambda p: (p[1].start, p[0].arrival))
    )
    return Plan(assignments=assignments, objective=_plan_value(ctx, placed), exact=exact)


def _free_now(now: float, state: FleetState) -> list[Board]:
    busy = {b for r in state.running for b in r.boards}
    return [b for b in state.boards if b.name not in busy and b.name not in state.leaving]


def _launch(now: float, state: FleetState, job: Job, boards: Iterable[Board]) -> Assignment:
    names = tuple(b.name for b in boards)
    order = tuple(b for b in state.boards if b.name in names)
    finish = now + job.duration(state.speed(job, order))
    return Assignment(job_id=job.id, boards=frozenset(names), start=now, finish=finish)


def _take(job: Job, k: int, free: list[Board], state: FleetState) -> list[Board] | None:
    """The job's request from the free boards (named set, else the k fastest), or None."""
    if job.boards is not None:
        chosen = [b for b in free if b.name in job.boards]
        return chosen if len(chosen) == len(job.boards) else None
    if k > len(free):
        return None
    return sorted(free, key=lambda b: (-state.speed(job, (b,)), b.name))[:k]


def _placeable_count(state: FleetState) -> int:
    return sum(b.name not in state.leaving for b in state.boards)


def _feasible(job: Job, state: FleetState) -> bool:
    names = {b.name for b in state.boards if b.name not in state.leaving}
    if job.boards is not None:
        return job.boards <= names
    return (job.count if job.count is not None else job.min_boards) <= len(names)


def _in_order(now: float, state: FleetState, minimal: bool, block: bool) -> Plan:
    free, launched = _free_now(now, state), []
    n = _placeable_count(state)
    for job in state.waiting:
        if not _feasible(job, state):
            continue
        k = job.count if job.kind == "hard" else (job.min_boards if minimal else min(job.max_boards, n))
        chosen = _take(job, k or 0, free, state)
        if chosen is None:
            if block:
                break
            continue
        launched.append(_launch(now, state, job, chosen))
        free = [b for b in free if b not in chosen]
    return Plan(assignments=tuple(launched))


def fifo(now: float, state: FleetState) -> Plan:
    """Arrival order, minimal requests, head-of-line blocking."""
    return _in_order(now, state, minimal=True, block=True)


def first_fit(now: float, state: FleetState) -> Plan:
    """Kubernetes-style: arrival order, full requests, jobs that do not fit now are skipped."""
    return _in_order(now, state, minimal=False, block=False)


def static(now: float, state: FleetState, group_size: int = 2) -> Plan:
    """Fixed groups of ``group_size`` boards in fleet order, allocated whole (module docstring)."""
    placeable = [b for b in state.boards if b.name not in state.leaving]
    groups = [placeable[i : i + group_size] for i in range(0, len(placeable), group_size)]
    free = {b.name for b in _free_now(now, state)}
    open_groups = [g for g in groups if all(b.name in free for b in g)]
    launched = []
    for job in state.waiting:
        if job.boards is not None:
            taken = [g for g in groups if any(b.name in job.boards for b in g)]
            if not all(g in open_groups for g in taken) or sum(len(g) for g in taken) < len(job.boards):
                continue
            boards = [b for g in taken for b in g if b.name in job.boards]
            if len(boards) < len(job.boards):
                continue  # it names a board that is not in the fleet
        else:
            need = job.count if job.count is not None else job.min_boards
            taken, have = [], 0
            for g in open_groups:
                if have >= need:
                    break
                taken.append(g)
                have += len(g)
            if have < need:
                continue
            most = job.count if job.count is not None else job.max_boards
            pool = [b for g in taken for b in g]
            boards = sorted(pool, key=lambda b: (-state.speed(job, (b,)), b.name))[:most]
        launched.append(_launch(now, state, job, boards))
        open_groups = [g for g in open_groups if g not in taken]
    return Plan(assignments=tuple(launched))


Scheduler = Callable[[float, FleetState], Plan]
"""Every scheduler: (now, state) -> Plan."""

SCHEDULERS: dict[str, Scheduler] = {
    "rolling": rolling,
    "fifo": fifo,
    "first_fit": first_fit,
    "static": static,
}
"""The schedulers by name, in the order benchmarks report them."""
