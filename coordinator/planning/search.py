"""The planner's search: a DP over blocks, each state a Pareto set of labels; exact or a beam.

The DP runs right to left over blocks: state (j, U) = blocks j.. covered, U = boards used (a
count vector over units: classes of identical boards, so a bitmask when all differ and
PipeEdge's type multiset otherwise, or bundles of boards that always act together); a step
prepends a stage [i, j) on any group G ⊆ rest. Each state keeps the Pareto set of labels (max c,
max γ, Σ energy/sample, least feasible M, S; cost terms as in ``coordinator.planning.cost``):
every cost is monotone in each, so pruning dominated labels is exact. Per final label and M the
pipeline/DP split (dp_share) is exact too: cost is piecewise linear in it, so only the ends, the
balanced split and, when energy counts, the points where a shard starts need checking (step
time alone is least with no DP samples or where the falling pipeline time meets the rising DP
time, if the shards can take that many).

As a beam (for the heuristic, see ``coordinator.planning.planner``), each state keeps only the
``width`` labels of best outlook: an optimistic completion in which the blocks still to place
split perfectly over the spare boards, which may also take DP shares at full speed. The units
of a beam come from ``coarsen`` (bundles until the DP fits a budget) or ``fastest`` (the classes
of the fastest boards alone).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from coordinator.planning.cost import Pipe, Point, Problem, StageTerms
from edgetrain.plan import BoardCost

Stages = list[tuple[int, int, tuple[BoardCost, ...]]]
"""Concrete pipeline stages, first first: (begin, end, the boards hosting blocks [begin, end))."""


@dataclass
class Unit:
    """Interchangeable items (single boards, or bundles that always act together)."""

    items: list[tuple[BoardCost, ...]]


def _attributes(k: BoardCost) -> tuple:
    return (k.flops_per_s, k.memory_bytes, k.mbit_per_s, k.rtt_s, k.idle_w, k.busy_w, k.overhead_s, k.own_data)


def board_classes(boards: Sequence[BoardCost]) -> list[Unit]:
    """Boards with equal cost attributes form one unit."""
    units: dict[tuple, Unit] = {}
    for k in boards:
        units.setdefault(_attributes(k), Unit([])).items.append((k,))
    return list(units.values())


def transitions(units: Sequence[Unit], blocks: int, single: bool = False) -> int:
    """An upper bound on the DP's (block range, group) transitions; ``single``: when each group
    draws on one unit only."""
    ranges = blocks * (blocks + 1) // 2
    if single:
        return ranges * math.prod(len(u.items) + 1 for u in units) * sum(len(u.items) for u in units) // 2
    return ranges * math.prod((len(u.items) + 1) * (len(u.items) + 2) // 2 for u in units)


def _fit(units: Sequence[Unit], blocks: int, budget: int) -> bool | None:
    """How a DP over ``units`` fits ``budget`` transitions: False with every group, True with
    one-unit groups only (allowed when every unit is a class of several unbundled boards: with
    single boards or bundles as units, a stage would be just one of them), None not at all."""
    if transitions(units, blocks) <= budget:
        return False
    if (transitions(units, blocks, single=True) <= budget
            and all(len(u.items) > 1 and len(u.items[0]) == 1 for u in units)):
        return True
    return None


def coarsen(units: list[Unit], blocks: int, budget: int) -> tuple[list[Unit], bool]:
    """Units for a DP within ``budget`` transitions, and whether its groups draw on one unit
    only (see ``_fit``): bundle boards until it fits, pairing identical items, else merging the
    two most alike single bundles (by per-board log speed and log link rate)."""
    def profile(item: tuple[BoardCost, ...]) -> tuple[float, float]:
        return (sum(math.log(k.flops_per_s) for k in item) / len(item),
                sum(math.log(k.mbit_per_s) for k in item) / len(item))

    units = list(units)
    while (single := _fit(units, blocks, budget)) is None:
        big = max(units, key=lambda u: len(u.items))
        if len(big.items) > 1:
            units.remove(big)
            units.append(Unit([big.items[t] + big.items[t + 1] for t in range(0, len(big.items) - 1, 2)]))
            if len(big.items) % 2:
                units.append(Unit([big.items[-1]]))
        elif len(units) > 1:
            x, y = min(itertools.combinations(units, 2), key=lambda p: (
                sum(abs(a - b) for a, b in zip(profile(p[0].items[0]), profile(p[1].items[0]))),
                len(p[0].items[0]) + len(p[1].items[0])))
            units = [u for u in units if u is not x and u is not y] + [Unit([x.items[0] + y.items[0]])]
        else:
            return units, False
    return units, single


def fastest(units: list[Unit], blocks: int, budget: int, single: bool) -> list[Unit]:
    """The classes of the fastest boards (then best linked), as many as an unbundled DP takes
    within ``budget`` (``single``: with one-class groups, see ``_fit``)."""
    out: list[Unit] = []
    for unit in sorted(units, key=lambda u: (-u.items[0][0].flops_per_s, -u.items[0][0].mbit_per_s)):
        if _fit([*out, unit], blocks, budget) not in ((False, True) if single else (False,)):
            break
        out.append(unit)
    return out


def _insert(bucket: list[tuple], new: tuple) -> None:
    """Add a label unless one in ``bucket`` is no worse in its compared entries; drop those it
    is no worse than. A label is (max c, max γ, energy compared, least M index, S, parent label,
    its first stage (i, j, group counts), energy/sample, max c next to DP shards, max stage call
    cost o); energy is
    compared as 0 when only time counts, so it is kept but does not split the Pareto set."""
    c, g, e, m, n, ca, oo = *new[:5], new[8], new[9]
    for o in bucket:
        if o[0] <= c and o[1] <= g and o[2] <= e and o[3] <= m and o[4] <= n and o[8] <= ca and o[9] <= oo:
            return
    bucket[:] = [o for o in bucket if not (c <= o[0] and g <= o[1] and e <= o[2] and m <= o[3] and n <= o[4]
                                           and ca <= o[8] and oo <= o[9])]
    bucket.append(new)


def _dominated(bucket: list[tuple], new: tuple) -> bool:
    """Whether a label in ``bucket`` is no worse than ``new`` in every compared entry."""
    c, g, e, m, n, ca, oo = *new[:5], new[8], new[9]
    for o in bucket:
        if o[0] <= c and o[1] <= g and o[2] <= e and o[3] <= m and o[4] <= n and o[8] <= ca and o[9] <= oo:
            return True
    return False


def _admit(bucket: list[tuple], new: tuple, width: int) -> None:
    """``_insert`` for the beam, of a label none in ``bucket`` dominates: labels carry their
    outlook at index 10, and only the ``width`` labels of best outlook stay."""
    worst = max(bucket, key=lambda o: o[10]) if len(bucket) >= width else None
    if worst is not None and new[10] >= worst[10]:
        return
    c, g, e, m, n, ca, oo = *new[:5], new[8], new[9]
    bucket[:] = [o for o in bucket if not (c <= o[0] and g <= o[1] and e <= o[2] and m <= o[3] and n <= o[4]
                                           and ca <= o[8] and oo <= o[9])]
    bucket.append(new)
    if len(bucket) > width:
        bucket.remove(worst)


class _Outlook:
    """An optimistic guess of the final cost of a label whose stages cover blocks i.. with the
    boards ``used`` (counts per unit); it ranks labels in the beam. The blocks before i (F_head
    FLOPs) are one more stage, split perfectly over the spare boards (f_spare FLOP/s), which may
    also take DP shares at full speed. Per micro-batch count M, with k = M + S − 1 and a pipeline
    taking p samples in a + p·kγ/M (a = c + k·λ): the least t with t ≥ a + kγ (p ≥ M),
    t ≥ F_head·B / f_spare and f_spare·t ≥ F_head·p + F·(B − p) for the most p the pipeline
    finishes by t; energy: the used boards idle over t, plus the label's busy energy and the
    head's at the thriftiest board's J/FLOP."""

    def __init__(self, prob: Problem, units: Sequence[Unit]) -> None:
        self.prob = prob
        self.flops = [sum(k.flops_per_s for k in u.items[0]) for u in units]
        self.rtt = [max(k.rtt_s for k in u.items[0]) for u in units]
        self.idle = [sum(k.idle_w for k in u.items[0]) for u in units]
        self.counts = [len(u.items) for u in units]
        self.thrift = min(((k.busy_w - k.idle_w) / k.flops_per_s for u in units for k in u.items[0]), default=0.0)
        self._at: dict[tuple, tuple] = {}

    def _context(self, i: int, used: tuple[int, ...]) -> tuple:
        prob = self.prob
        spare = sum(f * (n - u) for f, n, u in zip(self.flops, self.counts, used))
        head, total = prob.fc[i], prob.fc[-1]
        out = (spare, max((r for r, u in zip(self.rtt, used) if u), default=0.0),
               sum(w * u for w, u in zip(self.idle, used)), head / spare if spare > 0 else math.inf,
               head * prob.B / spare if spare > 0 else 0.0, total - head, total * prob.B)
        self._at[i, used] = out
        return out

    def __call__(self, i: int, used: tuple[int, ...], c: float, gamma: float, e: float, m: int, depth: int,
                 o: float) -> float:
        spare, rtt, idle, rate, floor, done, work = self._at.get((i, used)) or self._context(i, used)
        if i:
            if spare <= 0:
                return math.inf
            depth += 1
            if gamma < rate:
                gamma = rate
        lam = o + (2 if depth > 2 else depth - 1) * rtt
        best = math.inf
        for mb in self.prob.ms[m:]:
            k = mb + depth - 1
            a, slope = c + k * lam, k * gamma / mb
            t = a + mb * slope
            if t < floor:
                t = floor
            den = done + slope * spare
            if den > 0:
                both = (slope * work + done * a) / den
                if both > t:
                    t = both
            if t < best:
                best = t
        return self.prob.cost(best, idle * best + (e + self.prob.fc[i] * self.thrift) * self.prob.B)


def label_search(prob: Problem, units: list[Unit], energy: bool, width: int | None = None,
            single: bool = False, others: Sequence[BoardCost] = ()) -> Iterator[tuple[tuple, Point]]:
    """Every candidate of every non-dominated final DP label: (label, point). Without
    ``energy``, labels are compared on time alone (e is kept only as a tie-break). With a
    ``width``, a beam: each state keeps at most that many labels, those of best outlook;
    ``single``: each stage's group draws on one unit only; ``others``: boards outside the units,
    DP shards only."""
    counts = tuple(len(u.items) for u in units)
    reps = [u.items[0] for u in units]
    outlook = _Outlook(prob, units) if width else None
    layers: list[dict[tuple, list[tuple]]] = [{} for _ in range(prob.L + 1)]
    layers[prob.L][(0,) * len(units)] = [(0.0, 0.0, 0.0, 0, 0, None, None, 0.0, 0.0, 0.0)]
    subs: dict[tuple, list[tuple]] = {}
    terms: dict[tuple, tuple[StageTerms, tuple[int | None, ...]]] = {}
    for j in range(prob.L, 0, -1):
        for used, labels in layers[j].items():
            rest = tuple(c - u for c, u in zip(counts, used))
            if rest not in subs:
                subs[rest] = [g for g in itertools.product(*(range(r + 1) for r in rest))
                              if any(g) and (not single or sum(1 for x in g if x) == 1)]
            for g in subs[rest]:
                after = tuple(u + n for u, n in zip(used, g))
                for i in range(j):
                    term = terms.get((i, j, g))
                    if term is None:
                        members = [k for rep, n in zip(reps, g) for _ in range(n) for k in rep]
                        st = prob.stage(i, j, members)
                        term = terms[i, j, g] = (st, tuple(prob.fit_index(st.q, p) for p in range(1, prob.L + 1)))
                    st, fits = term
                    if st.q < 0:
                        continue
                    sc, sg, sca, so, se = st.c, st.gamma, st.c_all, st.o, st.e
                    bucket = layers[i].setdefault(after, [])
                    for lab in labels:
                        t = fits[lab[4]]
                        if t is None:
                            continue
                        e = lab[7] + se
                        new = (sc if sc > lab[0] else lab[0], sg if sg > lab[1] else lab[1], e if energy else 0.0,
                               t if t > lab[3] else lab[3], lab[4] + 1, lab, (i, j, g), e,
                               sca if sca > lab[8] else lab[8], so if so > lab[9] else lab[9])
                        if outlook is None:
                            _insert(bucket, new)
                        elif not _dominated(bucket, new):
                            _admit(bucket, (*new, outlook(i, after, new[0], new[1], e, new[3], new[4], new[9])),
                                   width)
    for used, labels in layers[0].items():
        hosts = [k for rep, n in zip(reps, used) for _ in range(n) for k in rep]
        spare = [k for rep, c, u in zip(reps, counts, used) for _ in range(c - u) for k in rep]
        shards = sorted((prob.shard_of[k.name] for k in (*spare, *others) if prob.shard_of[k.name].cap > 0),
                        key=lambda s: (s.o, s.board.name))
        idle = sum(k.idle_w for k in hosts)
        for lab in labels:
            pipe = Pipe(lab[0], lab[8], lab[1], lab[7], lab[3], lab[4], prob.latency(lab[9], hosts, lab[4]), idle)
            for point in prob.points(pipe, shards):
                yield lab, point


def concrete(units: list[Unit], label: tuple | None) -> Stages:
    """The stages of a label chain (None: pure DP), with boards taken from each unit in turn."""
    if label is None:
        return []
    pools = [list(u.items) for u in units]
    stages = []
    while label is not None and label[6] is not None:
        i, j, g = label[6]
        stages.append((i, j, tuple(k for u, n in enumerate(g) for _ in range(n) for k in pools[u].pop(0))))
        label = label[5]
    return stages
