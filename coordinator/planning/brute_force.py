"""The planner's oracle for tests: the optimum by enumerating every plan of a tiny instance."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from coordinator.planning.cost import (
    BATTERY_FLOOR_PERCENT,
    MICROBATCH_CANDIDATES,
    Problem,
    objective_weight,
)
from edgetrain.plan import BoardCost, ModelCost, Plan


def _ordered_partitions(items: tuple[BoardCost, ...]) -> Iterator[list[tuple[BoardCost, ...]]]:
    """Every way to cut ``items`` into an ordered list of non-empty groups."""
    if not items:
        yield []
        return
    for mask in range(1, 2 ** len(items)):
        first = tuple(k for b, k in enumerate(items) if mask >> b & 1)
        rest = tuple(k for b, k in enumerate(items) if not mask >> b & 1)
        for tail in _ordered_partitions(rest):
            yield [first, *tail]


def brute_force(fleet: Sequence[BoardCost], model: ModelCost, global_batch: int,
                objective: str | float = "time", *, microbatches: Sequence[int] = MICROBATCH_CANDIDATES,
                battery_floor: float = BATTERY_FLOOR_PERCENT, stage_state: str = "hosts",
                sync_every: int = 50, replicate: bool = True, channel_groups: bool = True) -> Plan:
    """The optimum by enumeration of every board subset, ordered grouping and contiguous cut
    (same cost function as ``plan_optimal``); for tests on up to 6 boards and 8 blocks."""
    prob = Problem(fleet, model, global_batch, objective_weight(objective), microbatches, battery_floor, stage_state,
                   sync_every, replicate, channel_groups)
    if len(prob.stage_hosts) > 6 or prob.L > 8:
        raise ValueError("brute_force is for tiny instances only")
    pure = prob.best([])
    best = ([], pure) if pure is not None else None
    for size in range(1, len(prob.stage_hosts) + 1):
        for subset in itertools.combinations(prob.stage_hosts, size):
            for groups in _ordered_partitions(subset):
                for cuts in itertools.combinations(range(1, prob.L), len(groups) - 1):
                    bounds = (0, *cuts, prob.L)
                    stages = [(bounds[s], bounds[s + 1], g) for s, g in enumerate(groups)]
                    point = prob.best(stages)
                    if point is not None and (best is None or point.key < best[1].key):
                        best = (stages, point)
    if best is None:
        raise ValueError("no plan fits the boards' memory")
    return prob.plan(*best)
