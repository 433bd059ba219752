"""The hybrid planner: which boards host which blocks as pipeline stages, which join as DP shards.

A pure function of plain data (no torch, sockets or clocks): ``plan_optimal(fleet, model,
global_batch, objective) -> Plan`` (``edgetrain.plan``). A plan is a pipeline of S stages of
consecutive blocks, each hosted by a group of boards that split every micro-batch by rows in
proportion to their speed or, as a channel group, split each layer's output channels
(``edgetrain.channels``), with M micro-batches under 1F1B; next to it, DP shards (whole model)
may take a share of the global batch; a pure-DP plan has no pipeline; boards that would slow the
whole are left out. ``pareto`` gives the (step time, energy) front instead. What a plan costs:
``coordinator.planning.cost``.

Search. When the DP over blocks with Pareto labels (``coordinator.planning.search``) takes at
most ``exact_budget`` transitions (beyond 6 distinct boards at 10 blocks for time, 5 when energy
counts; typed fleets go further: 16 boards of 2 types at 5 blocks), it runs exactly, over
classes of identical boards. Beyond, a heuristic takes over: beam searches, the same DP with
each state keeping only the BEAM_WIDTH labels of best outlook, then a hill climb
(``coordinator.planning.climb``).
  - One beam takes every board, within BEAM_BUDGET transitions: over the classes as they are if
    that fits, else with each stage on boards of one class when every class has several boards
    (16 boards of 2 kinds: mixed stages are left to the climb), else over bundles of boards that
    always act together (identical boards paired first, then the two most alike merged).
  - One or two more take only the classes of the fastest boards, unbundled, as many as fit
    FAST_BUDGET with any groups, and with one-class groups: bundles and slow boards hide plans
    that leave the slow boards out.
  - From each search's POLISH_STARTS best structures and its best of each stage count, the hill
    climb over shapes, scored with the exact cost on the whole fleet.
  No bound is claimed: scripts/bench_planner.py measures the gap to the exact DP and the
  planning time (docs/benchmarks.md#planner).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from coordinator.planning.climb import polish
from coordinator.planning.cost import (
    BATTERY_FLOOR_PERCENT,
    MICROBATCH_CANDIDATES,
    Point,
    Problem,
    objective_weight,
)
from coordinator.planning.search import (
    Unit,
    board_classes,
    coarsen,
    concrete,
    fastest,
    label_search,
    transitions,
)
from edgetrain.plan import BoardCost, ModelCost, Plan

EXACT_BUDGET = 60_000
"""Most DP transitions (block ranges x groups, x3 when energy counts) the exact search may take
before the heuristic takes over: about 0.3 s of pure Python for distinct boards, up to about 2 s
for fleets of two kinds (their states keep more labels)."""
BEAM_WIDTH = 8
"""Labels each DP state keeps in the heuristic's beam searches (those of best outlook)."""
BEAM_BUDGET = 40_000
"""Most DP transitions of the heuristic's beam over every board (bundled until it fits): about
0.4 s of pure Python at BEAM_WIDTH labels."""
FAST_BUDGET = 30_000
"""Most DP transitions of the heuristic's other beams, over the classes of the fastest boards
alone (never bundled)."""
POLISH_STARTS = 3
"""How many of each beam's best structures the heuristic hill-climbs from (besides the best of
each stage count)."""

_ENERGY_LABEL_COST = 3
"""Labels that carry energy keep about three times as many Pareto points, so cost that much more."""


def plan_optimal(fleet: Sequence[BoardCost], model: ModelCost, global_batch: int,
                 objective: str | float = "time", *, microbatches: Sequence[int] = MICROBATCH_CANDIDATES,
                 battery_floor: float = BATTERY_FLOOR_PERCENT, exact_budget: int = EXACT_BUDGET,
                 stage_state: str = "hosts", sync_every: int = 50, replicate: bool = True,
                 channel_groups: bool = True) -> Plan:
    """The plan minimising ``objective`` ("time", "energy" or a weight η of energy in [0, 1]):
    exact over pipelines, hybrids and pure DP when the DP fits ``exact_budget``, else the
    heuristic (beam searches plus a hill climb, see the module docstring). A group of boards
    hosting a stage splits it by rows or, with ``channel_groups``, by channels, whichever the
    cost model finds cheaper. Raises ValueError when nothing fits in memory."""
    prob = Problem(fleet, model, global_batch, objective_weight(objective), microbatches, battery_floor, stage_state,
                   sync_every, replicate, channel_groups)
    prob.every_split = prob.eta > 0
    ranked, exact = _ranked(prob, exact_budget)
    if not any(ranked):
        raise ValueError("no plan fits the boards' memory")
    return _best(prob, ranked, exact)


def plan_alternatives(fleet: Sequence[BoardCost], model: ModelCost, global_batch: int, objective: str | float = "time",
                      *, microbatches: Sequence[int] = MICROBATCH_CANDIDATES, battery_floor: float = BATTERY_FLOOR_PERCENT,
                      exact_budget: int = EXACT_BUDGET, stage_state: str = "hosts", sync_every: int = 50,
                      replicate: bool = True, channel_groups: bool = True) -> list[Plan]:
    """Plans of other kinds than `plan_optimal`'s, each the best of its kind, for measuring
    against it (coordinator.planning.trials): the best pure data parallelism, the best plan with
    pipeline stages, and the fastest board alone (the others left out, "one board alone"); those
    that fit and differ in structure, in that order. The optimum itself may be among them."""
    prob = Problem(fleet, model, global_batch, objective_weight(objective), microbatches, battery_floor, stage_state,
                   sync_every, replicate, channel_groups)
    prob.every_split = prob.eta > 0
    ranked, exact = _ranked(prob, exact_budget)
    out = []
    pure = prob.best([])
    if pure is not None:
        out.append(prob.plan([], pure))
    staged = [[c for c in r if c[0] is not None] for r in ranked]
    if any(staged):
        out.append(_best(prob, staged, exact))
    alone = _alone(prob)
    if alone is not None:
        out.append(alone)
    return out


def _alone(prob: Problem) -> Plan | None:
    """The fastest board alone, the others left out (ONE_BOARD_ALONE): as a data-parallel shard
    (parameters down, gradients up each step) or as the whole model in one stage (its state on
    the board, as the job's stage_state says), whichever is predicted faster; None if neither fits."""
    fastest_shard = max(prob.shards, key=lambda s: s.r, default=None)
    if fastest_shard is None:
        return None
    board = fastest_shard.board
    others = tuple((k.name, ONE_BOARD_ALONE) for k in prob.fleet if k is not board)
    plans = []
    one = Plan(dp_share=1.0, dp_boards=(board.name,), left_out=others)
    prediction = prob.predict(one)
    if prediction.fits:
        plans.append(replace(one, prediction=prediction))
    if not board.own_data:
        stages = [(0, prob.L, [board])]
        pipe = prob.pipe(stages)
        point = min(prob.points(pipe, []), key=lambda p: p.key, default=None) if pipe is not None else None
        if point is not None:
            plans.append(replace(prob.plan(stages, point), left_out=others))
    return min(plans, key=lambda p: p.prediction.step_s, default=None)


ONE_BOARD_ALONE = "one board alone"
"""Why the other boards sit out of a plan that measures the fastest board alone."""


def _ranked(prob: Problem, exact_budget: int) -> tuple[list[list[tuple]], bool]:
    """Every search's candidates, best first (one per label), and whether the search is exact."""
    searches, exact = _candidates(prob, exact_budget, prob.eta > 0)
    ranked = []
    for found in searches:
        by_label: dict[int, tuple] = {}
        for label, units, point in found:
            old = by_label.get(id(label))
            if old is None or point.key < old[2].key:
                by_label[id(label)] = (label, units, point)
        ranked.append(sorted(by_label.values(), key=lambda c: c[2].key))
    return ranked, exact


def _best(prob: Problem, ranked: list[list[tuple]], exact: bool) -> Plan:
    """The best of the ranked candidates: exactly, or hill-climbed from the diverse ones."""
    if exact:
        label, units, point = min((r[0] for r in ranked if r), key=lambda c: c[2].key)
        return prob.plan(concrete(units, label), point)
    return prob.plan(*polish(prob, [concrete(units, label) for r in ranked for label, units, _ in _diverse(r)]))


def pareto(fleet: Sequence[BoardCost], model: ModelCost, global_batch: int, *,
           microbatches: Sequence[int] = MICROBATCH_CANDIDATES, battery_floor: float = BATTERY_FLOOR_PERCENT,
           exact_budget: int = EXACT_BUDGET, stage_state: str = "hosts", sync_every: int = 50,
           replicate: bool = True, channel_groups: bool = True) -> list[Plan]:
    """The (step time, energy) non-dominated plans among the candidates the search considers,
    fastest first (beyond the exact budget, plus the hill-climbed time and energy optima)."""
    prob = Problem(fleet, model, global_batch, 0.0, microbatches, battery_floor, stage_state, sync_every, replicate,
                   channel_groups)
    searches, exact = _candidates(prob, exact_budget, True)
    pool = [(lambda lab=lab, units=units: concrete(units, lab), p) for found in searches for lab, units, p in found]
    if not pool:
        raise ValueError("no plan fits the boards' memory")
    if not exact:
        for eta in (0.0, 1.0):
            aim = copy.copy(prob)
            aim.eta = eta
            make, point = min(pool, key=lambda c: (aim.cost(c[1].step, c[1].energy), c[1].step))
            if make():
                stages, point = polish(aim, [make()])
                pool.append((lambda stages=stages: stages, point))
    front, least = [], math.inf
    for make, point in sorted(pool, key=lambda c: (c[1].step, c[1].energy)):
        if point.energy < least * (1 - 1e-12):
            front.append(prob.plan(make(), point))
            least = point.energy
    return front


def _candidates(prob: Problem, exact_budget: int, energy: bool) -> tuple[list[Iterator[tuple]], bool]:
    """Every candidate, (label or None for pure DP, units, point), one iterator per search, and
    whether the search is exact. Beyond the exact budget, beams: over every board, bundled to
    fit BEAM_BUDGET, and over the classes of the fastest boards alone, unbundled, with any groups
    and with one-class groups (those that differ)."""
    units = board_classes(prob.stage_hosts)
    exact = transitions(units, prob.L) * (_ENERGY_LABEL_COST if energy else 1) <= exact_budget
    pure = prob.best([])
    head = iter([(None, None, pure)] if pure is not None else [])
    if exact:
        return [itertools.chain(head, _tagged(units, label_search(prob, units, energy)))], True
    searches = [coarsen(units, prob.L, BEAM_BUDGET)]
    for single in (False, True):
        fast = fastest(units, prob.L, FAST_BUDGET, single)
        if fast and (fast, single) not in searches:
            searches.append((fast, single))
    beams = []
    for some, single in searches:
        inside = {k.name for u in some for item in u.items for k in item}
        others = [k for k in prob.eligible if k.name not in inside]
        beams.append(_tagged(some, label_search(prob, some, energy, BEAM_WIDTH, single, others)))
    return [head, *beams], False


def _tagged(units: list[Unit], found: Iterator[tuple[tuple, Point]]) -> Iterator[tuple]:
    """A search's candidates, each with the units its label's groups count."""
    for label, point in found:
        yield label, units, point


def _diverse(ranked: list[tuple]) -> list[tuple]:
    """The best POLISH_STARTS candidates and the best of each stage count."""
    out = ranked[:POLISH_STARTS]
    seen = {id(c[0]) for c in out}
    depth = set()
    for c in ranked:
        d = c[0][4] if c[0] is not None else 0
        if d not in depth:
            depth.add(d)
            if id(c[0]) not in seen:
                out.append(c)
                seen.add(id(c[0]))
    return out
