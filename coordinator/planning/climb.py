"""The heuristic's local search: a hill climb over plan shapes, scored with the exact cost.

A shape is a structure up to interchangeable boards: each stage's blocks and its board count per
class of identical boards. From each start (the beams' best structures, see
``coordinator.planning.planner``), a best-improvement hill climb scores every neighbour with the
exact cost on the whole fleet: shift a cut anywhere between its neighbours, merge two stages,
split one (blocks and boards), per class add, drop, move or trade a board, and add a board
(of any classes) to each of the two slowest stages at once. The pair is one move because a
pipeline is as slow as its slowest stage: when two stages are about as slow, a board into either
alone gains nothing (and costs a DP shard), and a climb that reached such a shape from a start
other than the best would stop there. The best local optimum then climbs again from its
LOOKAHEAD best neighbours while that improves it (other moves that only pay together).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from coordinator.planning.cost import Pipe, Point, Problem, Shard, StageTerms
from coordinator.planning.search import Stages, board_classes

LOOKAHEAD = 3
"""From the best structure the climbs reach, the heuristic climbs again from its this many best
neighbours, for as long as that improves it."""
SPLIT_ALL = 40
"""A hill-climb move that splits a stage tries every division of its boards when there are at
most this many, else the divisions in proportion to the two parts' FLOPs."""


Shape = tuple[tuple[int, int, tuple[int, ...]], ...]
"""A structure up to interchangeable boards: its stages as (begin, end, boards of each class)."""


class _Climb:
    """Hill climbing over shapes (stages as board counts per class of identical boards), each
    scored once with the exact cost."""

    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.pools = [[k for (k,) in u.items] for u in board_classes(prob.stage_hosts)]
        self.sizes = tuple(len(p) for p in self.pools)
        self.index = {k.name: c for c, pool in enumerate(self.pools) for k in pool}
        self.scores: dict[Shape, Point | None] = {}
        self._terms: dict[tuple, StageTerms] = {}
        self._shards: dict[tuple[int, ...], list[Shard]] = {}

    def shape(self, stages: Stages) -> Shape:
        """The shape of concrete stages."""
        out = []
        for i, j, g in stages:
            n = [0] * len(self.pools)
            for k in g:
                n[self.index[k.name]] += 1
            out.append((i, j, tuple(n)))
        return tuple(out)

    def stages(self, shape: Shape) -> Stages:
        """Boards for a shape: each stage takes the next ones of each class."""
        taken, out = [0] * len(self.pools), []
        for i, j, g in shape:
            members = []
            for c, n in enumerate(g):
                members += self.pools[c][taken[c]:taken[c] + n]
                taken[c] += n
            out.append((i, j, tuple(members)))
        return out

    def terms(self, i: int, j: int, g: tuple[int, ...]) -> StageTerms:
        """``prob.stage`` of blocks [i, j) on boards of each class as counted by ``g``, cached."""
        st = self._terms.get((i, j, g))
        if st is None:
            members = [k for pool, n in zip(self.pools, g) for k in pool[:n]]
            st = self._terms[i, j, g] = self.prob.stage(i, j, members)
        return st

    def score(self, shape: Shape) -> Point | None:
        """``prob.best`` of the shape's stages, with stage terms and shards cached by class counts."""
        if shape in self.scores:
            return self.scores[shape]
        prob, depth = self.prob, len(shape)
        c = c_all = gamma = e = o = 0.0
        m = 0
        used = [0] * len(self.pools)
        point = None
        for s, (i, j, g) in enumerate(shape):
            st = self.terms(i, j, g)
            t = prob.fit_index(st.q, depth - s)
            if t is None:
                break
            c, c_all, gamma, e, m, o = (max(c, st.c), max(c_all, st.c_all), max(gamma, st.gamma), e + st.e,
                                        max(m, t), max(o, st.o))
            used = [u + n for u, n in zip(used, g)]
        else:
            hosts = [pool[0] for pool, n in zip(self.pools, used) if n]
            idle = sum(pool[0].idle_w * n for pool, n in zip(self.pools, used))
            spare = tuple(n - u for n, u in zip(self.sizes, used))
            shards = self._shards.get(spare)
            if shards is None:  # the boards ``stages`` leaves out: the last ones of each class
                outside = (prob.shard_of[k.name] for pool, n in zip(self.pools, spare) for k in pool[len(pool) - n:])
                shards = self._shards[spare] = sorted((x for x in outside if x.cap > 0),
                                                      key=lambda x: (x.o, x.board.name))
            pipe = Pipe(c, c_all, gamma, e, m, depth, prob.latency(o, hosts, depth), idle)
            point = min(prob.points(pipe, shards), key=lambda p: p.key, default=None)
        self.scores[shape] = point
        return point

    def splits(self, i: int, cut: int, j: int, g: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        """Boards for the head [i, cut) when stage [i, j) on ``g`` splits at ``cut``."""
        if math.prod(n + 1 for n in g) <= SPLIT_ALL:
            yield from itertools.product(*(range(n + 1) for n in g))
            return
        fc = self.prob.fc
        share = (fc[cut] - fc[i]) / (fc[j] - fc[i]) if fc[j] > fc[i] else (cut - i) / (j - i)
        base = tuple(math.floor(n * share) for n in g)
        yield base
        for c, n in enumerate(g):
            if base[c] < n:
                yield base[:c] + (base[c] + 1,) + base[c + 1:]

    def moves(self, shape: Shape) -> Iterator[Shape]:
        """Shift a cut anywhere between its neighbours, merge two neighbouring stages, split a
        stage in two (blocks and boards), add a board from outside to each of the two slowest
        stages (largest γ), and per class: add a board from outside, drop one, move one to
        another stage, trade one for another class's board from outside or from another stage."""
        classes, stages = range(len(self.sizes)), list(shape)
        spare = [n - sum(g[c] for *_, g in shape) for c, n in enumerate(self.sizes)]

        def put(base: list, s: int, g: tuple[int, ...]) -> list:
            return base[:s] + [(base[s][0], base[s][1], g)] + base[s + 1:]

        def plus(g: tuple[int, ...], c: int, d: int) -> tuple[int, ...]:
            return g[:c] + (g[c] + d,) + g[c + 1:]

        if len(stages) > 1:  # a board from outside into each of the two slowest stages
            s, t = sorted(sorted(range(len(stages)), key=lambda x: -self.terms(*stages[x]).gamma)[:2])
            for c in classes:
                for d in classes:
                    if spare[c] and spare[d] > (d == c):
                        yield tuple(put(put(stages, s, plus(stages[s][2], c, 1)), t, plus(stages[t][2], d, 1)))
        for s in range(len(stages) - 1):
            (i, j, g), (_, end, h) = stages[s], stages[s + 1]
            for cut in range(i + 1, end):
                if cut != j:
                    yield tuple(stages[:s] + [(i, cut, g), (cut, end, h)] + stages[s + 2:])
            yield tuple(stages[:s] + [(i, end, tuple(x + y for x, y in zip(g, h)))] + stages[s + 2:])
        for s, (i, j, g) in enumerate(stages):
            for cut in range(i + 1, j):
                for head in self.splits(i, cut, j, g):
                    tail = tuple(x - y for x, y in zip(g, head))
                    if any(head) and any(tail):
                        yield tuple(stages[:s] + [(i, cut, head), (cut, j, tail)] + stages[s + 1:])
            for c in classes:
                if spare[c]:
                    yield tuple(put(stages, s, plus(g, c, 1)))
                if not g[c]:
                    continue
                less = plus(g, c, -1)
                if any(less):
                    yield tuple(put(stages, s, less))
                for d in classes:
                    if d != c and spare[d]:
                        yield tuple(put(stages, s, plus(less, d, 1)))
                for t, (*_, h) in enumerate(stages):
                    if t == s:
                        continue
                    if any(less):
                        yield tuple(put(put(stages, s, less), t, plus(h, c, 1)))
                    for d in classes:
                        if d != c and h[d] and t > s:
                            yield tuple(put(put(stages, s, plus(less, d, 1)), t, plus(plus(h, d, -1), c, 1)))

    def escape(self, shape: Shape, point: Point) -> tuple[Shape, Point] | None:
        """From a local optimum: climb from its LOOKAHEAD best neighbours; the best result if it
        beats ``point``."""
        near = sorted(((p, n) for n in self.moves(shape) if (p := self.score(n)) is not None),
                      key=lambda x: x[0].key)[:LOOKAHEAD]
        best = min((self.climb(n, p) for p, n in near), key=lambda x: x[1].key, default=None)
        return best if best is not None and best[1].key < point.key else None

    def climb(self, shape: Shape, point: Point) -> tuple[Shape, Point]:
        """Best-improvement hill climb from ``shape`` until no move improves."""
        while True:
            best = min(((p, n) for n in self.moves(shape) if (p := self.score(n)) is not None),
                       key=lambda x: x[0].key, default=None)
            if best is None or best[0].key >= point.key:
                return shape, point
            point, shape = best


def polish(prob: Problem, starts: Sequence[Stages]) -> tuple[Stages, Point]:
    """The best of the structures hill-climbed from each start (no stages: pure DP, kept as is),
    scored on the whole fleet (a start may come from a search over some of its boards)."""
    climb = _Climb(prob)
    done, seen = [], set()
    for stages in starts:
        shape = climb.shape(stages)
        if shape in seen:
            continue
        seen.add(shape)
        point = climb.score(shape) if shape else prob.best([])
        if point is not None:
            done.append(climb.climb(shape, point) if shape else (shape, point))
    if not done:
        raise ValueError("no plan fits the boards' memory")
    shape, point = min(done, key=lambda c: c[1].key)
    while shape and LOOKAHEAD:
        nxt = climb.escape(shape, point)
        if nxt is None:
            break
        shape, point = nxt
    return climb.stages(shape), point
