"""The hybrid planner: which boards host which blocks as pipeline stages, which join as DP shards.

A pure function of plain data (no torch, sockets or clocks): ``plan_optimal(fleet, model,
global_batch, objective) -> Plan``. A plan is a pipeline of S stages of consecutive blocks, each
hosted by a group of boards that split every micro-batch by rows in proportion to their speed,
with M micro-batches under 1F1B; next to it, DP shards (whole model) may take a share of the
global batch; a pure-DP plan has no pipeline; boards that would slow the whole are left out.

Cost model (units: bytes, FLOP, s, W, J; board k moves 1/σ_k = 1e6/8 · mbit_per_s bytes/s).
Stage [i, j) on group G, with f_G = Σ flops_per_s and row weights w_k = f_k / f_G:
    P, F  param bytes, training FLOPs per sample (forward + backward) of its blocks
    X     activation bytes per sample crossing its boundaries (out of block i-1, out of j-1)
    A     activation bytes per sample it keeps for backward (its input and its blocks' outputs)
    γ_s = (F + 2 X · max_k f_k σ_k) / f_G      seconds per sample: compute, plus activations
                                              forward and gradients back, each host on its link
    c_k = 2 P σ_k + rtt_k                      stage parameters down, gradients up, every step;
                                              c_k = rtt_k + 2 P σ_k / K for a stage with one
                                              host that owns its state (stage_state "hosts", no
                                              DP shards): parameters and momentum pulled back
                                              every K = sync_every steps
    mem_k = 2 P + min(S − s, M) · w_k · (B / M) · A      params, grads, 1F1B in-flight rows
Pipeline with B_p samples, b = B_p / M, hosts H:
    o_s = max_G overhead_k · F / F_model     a call's fixed cost, in proportion to the stage's work
    λ = max_s o_s + (min(S, 3) − 1) · max_H rtt_s    per micro-batch latency, worst case
    t_s = b γ_s + λ;   T_pipe = max_H c_k + (M + S − 1) · max_s t_s
DP shard k with n_k samples: T_k = o_k + n_k F / f_k with o_k = 2 P σ_k + rtt_k + overhead_s
(whole model); its memory is 2 P + n_k A. Shares are water-filled so every active shard finishes
together (``split_proportional``'s rule); a shard that cannot start before that gets none.
    step = max(T_pipe, T_k);  energy/step = Σ_used idle_w · step + (busy_w − idle_w) · busy_k
with busy = compute seconds; objective cost = (η · energy + (1 − η) · P_ref · step) / B, η = 0
for time, 1 for energy, P_ref = Σ busy_w of the fleet (Zeus). Stage-host memory is checked at the
full batch (B / M), so a plan still fits when its DP shards drop out.

Search. The DP runs right to left over blocks: state (j, U) = blocks j.. covered, U = boards used
(a count vector over classes of identical boards: a bitmask when all differ, PipeEdge's type
multiset otherwise); a step prepends a stage [i, j) on any group G ⊆ rest. Each state keeps the
Pareto set of labels (max c, max γ, Σ energy/sample, least feasible M, S): every cost is monotone
in each, so pruning dominated labels is exact. Per final label and M the pipeline/DP split
(dp_share) is exact too: cost is piecewise linear in it, so only the ends, the balanced split
and, when energy counts, the points where a shard starts need checking (step time alone is least
with no DP samples or where the falling pipeline time meets the rising DP time, if the shards
can take that many).
When the DP's transition count exceeds ``exact_budget`` (beyond 6 distinct boards at 10 blocks
for time, 5 when energy counts; typed fleets go further: 16 boards of 2 types at 5 blocks), a
heuristic takes over: beam searches, the same DP with each state keeping only the BEAM_WIDTH
labels of best outlook (an optimistic completion: the blocks still to place split perfectly over
the spare boards, which may also take DP shares at full speed), then a hill climb.
  - One beam takes every board, within BEAM_BUDGET transitions: over the classes as they are if
    that fits, else with each stage on boards of one class when every class has several boards
    (16 boards of 2 kinds: mixed stages are left to the climb), else over bundles of boards that
    always act together (identical boards paired first, then the two most alike merged).
  - One or two more take only the classes of the fastest boards, unbundled, as many as fit
    FAST_BUDGET with any groups, and with one-class groups: bundles and slow boards hide plans
    that leave the slow boards out.
  - From each search's POLISH_STARTS best structures and its best of each stage count, a
    best-improvement hill climb over shapes (each stage's board count per class), scored with
    the exact cost on the whole fleet: shift a cut anywhere between its neighbours, merge two
    stages, split one (blocks and boards), and per class add, drop, move or trade a board. The
    best local optimum then climbs again from its LOOKAHEAD best neighbours while that improves
    it (two moves that only pay together, e.g. two more boards into two stages).
  No bound is claimed. Measured (ResNet-18 blocks, batch 64, time, fleets drawn as in
  scripts/bench_planner.py): on 43 random 16-board fleets of 2 kinds, the exact optimum on 42
  and within 0.7% on the last, in about 0.5 s (the exact DP: 1-9 s); on 16 boards of 2-3 kinds
  or of all 5 kinds with mixed links, within 2.1% of the best plan a 3x wider beam with 10x the
  budget finds (4-7 s).
Boards on battery below ``battery_floor`` and not plugged in are left out under every objective.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

MICROBATCH_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""Micro-batch counts the planner tries (those above the pipeline's samples are skipped)."""
BATTERY_FLOOR_PERCENT = 20.0
"""A board below this charge and not plugged in gets no work."""
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
LOOKAHEAD = 3
"""From the best structure the climbs reach, the heuristic climbs again from its this many best
neighbours, for as long as that improves it."""
SPLIT_ALL = 40
"""A hill-climb move that splits a stage tries every division of its boards when there are at
most this many, else the divisions in proportion to the two parts' FLOPs."""

_EPS = 1e-12
_ENERGY_LABEL_COST = 3
"""Labels that carry energy keep about three times as many Pareto points, so cost that much more."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


@dataclass(kw_only=True, frozen=True)
class BlockCost:
    """What one block costs per sample: the unit the planner cuts the model into stages by."""

    name: str
    """Block name, as in ``BlockModel.block_names``."""
    param_bytes: float
    """Bytes of the block's parameters (moved down, and as gradients up, every step)."""
    activation_bytes: float
    """Bytes per sample of the block's output (sent to the next stage when cut after it)."""
    forward_flops: float
    """Forward FLOPs per sample."""
    backward_flops: float | None = None
    """Backward FLOPs per sample; twice the forward when not given."""

    def __post_init__(self) -> None:
        for key in ("param_bytes", "activation_bytes", "forward_flops"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value >= 0, f"{self.name}: {key} must be >= 0, got {value}")
        back = self.backward_flops
        _check(back is None or (math.isfinite(back) and back >= 0),
               f"{self.name}: backward_flops must be >= 0, got {back}")

    @property
    def train_flops(self) -> float:
        """Forward plus backward FLOPs per sample."""
        back = 2 * self.forward_flops if self.backward_flops is None else self.backward_flops
        return self.forward_flops + back


class _MeasuredBlock(Protocol):
    name: str
    param_bytes: int
    forward_flops: int
    output_shape: tuple[int, ...]
    output_bytes: int


@dataclass(frozen=True)
class ModelCost:
    """A model as the planner sees it: its blocks in order."""

    blocks: tuple[BlockCost, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        _check(bool(self.blocks), "a model needs at least one block")
        _check(sum(b.train_flops for b in self.blocks) > 0, "a model needs FLOPs > 0")

    @classmethod
    def from_blocks(cls, measured: Sequence[_MeasuredBlock]) -> ModelCost:
        """Per-sample costs from ``edgetrain.models.block_costs`` (measured for a whole batch)."""
        return cls(tuple(
            BlockCost(name=b.name, param_bytes=b.param_bytes,
                      forward_flops=b.forward_flops / b.output_shape[0],
                      activation_bytes=b.output_bytes / b.output_shape[0])
            for b in measured))


@dataclass(kw_only=True, frozen=True)
class BoardCost:
    """One board as the planner sees it: speed, memory, link, power and battery."""

    name: str
    """Unique board name."""
    flops_per_s: float
    """Effective training FLOP/s (measured, not peak)."""
    memory_bytes: float
    """Memory available for parameters, gradients and activations."""
    mbit_per_s: float
    """Link rate to the LAN (both directions)."""
    rtt_s: float = 0.0
    """Round-trip time to its peers and the coordinator."""
    idle_w: float = 0.0
    """Power when idle or waiting on the network."""
    busy_w: float = 0.0
    """Power when computing."""
    battery_percent: float | None = None
    """Charge; None for boards without a battery."""
    plugged: bool | None = None
    """Whether it runs on mains; None when unknown (a battery board is then taken as unplugged)."""
    overhead_s: float = 0.0
    """Fixed cost of one forward+backward call whatever its size: what many micro-batches cost."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "a board needs a name")
        for key in ("flops_per_s", "memory_bytes", "mbit_per_s"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value > 0, f"{self.name}: {key} must be > 0, got {value}")
        for key in ("rtt_s", "idle_w", "overhead_s"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value >= 0, f"{self.name}: {key} must be >= 0, got {value}")
        _check(self.busy_w >= self.idle_w, f"{self.name}: busy_w must be >= idle_w, got {self.busy_w}")

    @property
    def seconds_per_byte(self) -> float:
        """Transfer time of one byte over its link."""
        return 8.0 / (self.mbit_per_s * 1e6)


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to do per step (see the module docstring for the formulas)."""

    step_s: float
    samples_per_s: float
    energy_per_sample_j: float
    pipeline_s: float
    """T_pipe (0 without a pipeline)."""
    dp_s: float
    """When the DP shards finish (0 without shards)."""
    stage_s: tuple[float, ...]
    """Each stage's time per micro-batch, t_s."""
    share: dict[str, float]
    """Fraction of the global batch whose rows each working board computes."""
    time_s: dict[str, float]
    """Each board's working seconds per step: its transfers and compute, bubble excluded."""
    busy_s: dict[str, float]
    """Each board's compute seconds per step (what it draws busy_w for)."""
    memory_bytes: dict[str, float]
    fits: bool
    """Whether every board's memory holds its part."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: blocks [begin, end) hosted by ``boards``."""

    begin: int
    end: int
    boards: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """A placement: pipeline stages, micro-batches, DP shards with their share, boards left out.

    No stages means pure data parallelism over ``dp_boards`` (``dp_share`` 1).
    """

    stages: tuple[StagePlan, ...] = ()
    microbatches: int = 1
    dp_boards: tuple[str, ...] = ()
    dp_share: float = 0.0
    """Fraction of the global batch the DP shards take, water-filled among them."""
    left_out: tuple[tuple[str, str], ...] = ()
    """(board, why) for fleet boards that get no work."""
    prediction: Prediction | None = field(default=None, compare=False)
    """Filled by the planner."""

    def __post_init__(self) -> None:
        _check(self.microbatches >= 1, f"microbatches must be >= 1, got {self.microbatches}")
        if self.stages:
            _check(0 <= self.dp_share < 1, f"dp_share must be in [0, 1) with stages, got {self.dp_share}")
            _check(bool(self.dp_boards) == (self.dp_share > 0), "dp_share > 0 exactly with dp_boards")
        else:
            _check(bool(self.dp_boards) and self.dp_share == 1, "pure DP needs dp_boards and dp_share 1")

    @property
    def kind(self) -> str:
        """``"dp"``, ``"pipeline"`` or ``"hybrid"`` (pipeline and DP shards)."""
        return "dp" if not self.stages else "hybrid" if self.dp_boards else "pipeline"

    def to_pipeline_section(self) -> dict:
        """The job's ``pipeline`` section (``PipelineConfig``); pure DP gives an empty pipeline,
        i.e. the trainer's data-parallel mode with its own proportional split."""
        if not self.stages:
            return {"stages": [], "microbatches": 1, "schedule": "1f1b", "dp_boards": [], "dp_share": 0.0}
        return {"stages": [{"blocks": s.end - s.begin, "boards": list(s.boards)} for s in self.stages],
                "microbatches": self.microbatches, "schedule": "1f1b",
                "dp_boards": list(self.dp_boards), "dp_share": self.dp_share}

    def explain(self) -> str:
        """A table: board -> role, blocks, batch share, predicted time, memory; then the totals."""
        p = self.prediction
        _check(p is not None, "explain needs a plan with a prediction (from the planner)")
        single = len(self.stages) == 1 and len(self.stages[0].boards) == 1 and not self.dp_boards
        head = {"dp": "pure data parallelism",
                "pipeline": "the whole model on one board" if single else f"{len(self.stages)} stages",
                "hybrid": f"{len(self.stages)} stages + DP shards taking {self.dp_share:.1%}"}[self.kind]
        if self.stages and not single:
            head += f", {self.microbatches} micro-batches (1f1b)"
        rows = [("board", "role", "blocks", "share", "time_s", "memory_MB")]
        for s, stage in enumerate(self.stages):
            rows += [(b, f"stage {s}", f"{stage.begin}-{stage.end - 1}", f"{p.share[b]:.1%}",
                      f"{p.time_s[b]:.3f}", f"{p.memory_bytes[b] / 1e6:.1f}") for b in stage.boards]
        rows += [(b, "dp", "all", f"{p.share[b]:.1%}", f"{p.time_s[b]:.3f}", f"{p.memory_bytes[b] / 1e6:.1f}")
                 for b in self.dp_boards]
        rows += [(b, "left out", "-", "-", "-", why) for b, why in self.left_out]
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [f"plan: {head}"] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"predicted: step {p.step_s:.3f} s, {p.samples_per_s:.1f} samples/s, "
                     f"{p.energy_per_sample_j:.3f} J/sample")
        return "\n".join(lines)


# --- the cost model ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Stage:
    c: float
    """Per-step transfer time when the pipeline runs alone (a single host owning its state: rtt)."""
    c_all: float
    """The same next to DP shards (every stage moves its parameters and gradients)."""
    gamma: float
    e: float
    """Busy energy above idle per pipeline sample."""
    q: float
    """Memory headroom: min over hosts of (memory − 2P) / (w_k B A); < 0 when params do not fit."""
    o: float = 0.0
    """Fixed cost of one micro-batch call on the stage: max over hosts of overhead x its work share."""


@dataclass(frozen=True)
class _Pipe:
    c: float
    c_all: float
    gamma: float
    e: float
    m: int
    """Index of the least micro-batch count whose activations fit."""
    stages: int
    lam: float
    idle: float


@dataclass(frozen=True)
class _Shard:
    board: BoardCost
    o: float
    r: float
    """Samples per second."""
    cap: float
    """Most samples its memory holds."""


@dataclass(frozen=True)
class _Point:
    cost: float
    step: float
    energy: float
    microbatches: int
    dp_samples: float
    active: int
    """The first ``active`` shards (sorted by o) get work."""

    @property
    def key(self) -> tuple[float, float, float]:
        return self.cost, self.step, self.energy


def _waterfill(shards: Sequence[_Shard], n: float) -> tuple[float, int]:
    """When shards sorted by o finish ``n`` samples together, and how many of them work."""
    rate = offset = 0.0
    for a, s in enumerate(shards, 1):
        rate += s.r
        offset += s.r * s.o
        tau = (n + offset) / rate
        if a == len(shards) or tau <= shards[a].o * (1 + _EPS):
            return tau, a
    return 0.0, 0


def _capacity(shards: Sequence[_Shard], tau: float) -> float:
    """Samples the shards finish by ``tau``."""
    return sum(s.r * (tau - s.o) for s in shards if s.o < tau)


def _starts(shards: Sequence[_Shard]) -> list[float]:
    """DP samples at which each shard (sorted by o) starts getting work: ``_capacity`` at each
    o, from running sums over the shards that start before it."""
    out, rate, offset, a = {0.0}, 0.0, 0.0, 0
    for s in shards:
        while shards[a].o < s.o:
            rate += shards[a].r
            offset += shards[a].r * shards[a].o
            a += 1
        out.add(max(0.0, rate * s.o - offset))
    return sorted(out)


def _balanced(shards: Sequence[_Shard], o_p: float, g_p: float, total: float) -> float:
    """DP samples at which a pipeline taking o_p + g_p·samples and the shards finish together."""
    rate = offset = 0.0
    for s in shards:
        if o_p + g_p * (total - (rate * s.o - offset)) <= s.o:
            break
        rate += s.r
        offset += s.r * s.o
    tau = (o_p + g_p * (total + offset)) / (1 + g_p * rate)
    return rate * tau - offset


class _Problem:
    """A fleet, a model, a batch and an objective, with the cost model's pieces precomputed."""

    def __init__(self, fleet: Sequence[BoardCost], model: ModelCost, global_batch: int,
                 eta: float = 0.0, microbatches: Sequence[int] = MICROBATCH_CANDIDATES,
                 battery_floor: float = BATTERY_FLOOR_PERCENT, stage_state: str = "hosts",
                 sync_every: int = 50) -> None:
        names = [k.name for k in fleet]
        _check(bool(fleet), "the fleet is empty")
        _check(len(set(names)) == len(names), f"board names must be unique, got {names}")
        _check(global_batch >= 1, f"global_batch must be >= 1, got {global_batch}")
        _check(stage_state in ("hosts", "coordinator"), f"stage_state must be hosts or coordinator, got {stage_state!r}")
        self.fleet, self.model, self.B, self.eta = list(fleet), model, global_batch, eta
        self.stage_state = stage_state
        self.sync_every = max(1, sync_every)
        self.by_name = {k.name: k for k in fleet}
        self.L = len(model.blocks)
        self.ms = tuple(sorted({m for m in microbatches if 1 <= m <= global_batch}))
        _check(bool(self.ms), f"no micro-batch count in {list(microbatches)} fits a batch of {global_batch}")
        self.p_ref = sum(k.busy_w for k in fleet) or 1.0
        self._act = [b.activation_bytes for b in model.blocks]
        self._pc, self._fc, self._ac = [0.0], [0.0], [0.0]
        for b in model.blocks:
            self._pc.append(self._pc[-1] + b.param_bytes)
            self._fc.append(self._fc[-1] + b.train_flops)
            self._ac.append(self._ac[-1] + b.activation_bytes)
        self.left = {k.name: f"battery {k.battery_percent:.0f}% unplugged" for k in fleet
                     if k.battery_percent is not None and k.battery_percent < battery_floor
                     and k.plugged is not True}
        self.eligible = [k for k in fleet if k.name not in self.left]
        self.shard_of = {k.name: self._shard(k) for k in fleet}
        self.shards = sorted((self.shard_of[k.name] for k in self.eligible if self.shard_of[k.name].cap > 0),
                             key=lambda s: (s.o, s.board.name))
        self._stage_cache: dict[tuple, _Stage] = {}
        self.every_split = True
        """Whether ``points`` tries every end of the pieces the DP samples' cost is linear on:
        energy needs them; step time alone is least with no DP samples or at the balanced split
        (the most the shards take, when the pipeline is slower still)."""

    def _span(self, i: int, j: int) -> tuple[float, float, float, float]:
        """P, F, X, A of blocks [i, j) (see the module docstring)."""
        a_in = self._act[i - 1] if i > 0 else 0.0
        a_out = self._act[j - 1] if j < self.L else 0.0
        return (self._pc[j] - self._pc[i], self._fc[j] - self._fc[i], a_in + a_out,
                a_in + self._ac[j] - self._ac[i])

    def _shard(self, k: BoardCost) -> _Shard:
        p, f, a = self._pc[-1], self._fc[-1], self._ac[-1]
        slack = k.memory_bytes - 2 * p
        return _Shard(k, 2 * p * k.seconds_per_byte + k.rtt_s + k.overhead_s, k.flops_per_s / f,
                      slack / a if a > 0 else (math.inf if slack >= 0 else -1.0))

    def stage(self, i: int, j: int, members: Sequence[BoardCost]) -> _Stage:
        """Cost terms of blocks [i, j) on a group (cached by the members' names)."""
        key = (i, j, tuple(k.name for k in members))
        if key not in self._stage_cache:
            p, f, x, a = self._span(i, j)
            speed = sum(k.flops_per_s for k in members)
            q = math.inf
            for k in members:
                slack, need = k.memory_bytes - 2 * p, k.flops_per_s / speed * self.B * a
                q = min(q, -1.0 if slack < 0 else slack / need if need > 0 else math.inf)
            c_all = max(2 * p * k.seconds_per_byte + k.rtt_s for k in members)
            owned = self.stage_state == "hosts" and len(members) == 1
            self._stage_cache[key] = _Stage(
                c=members[0].rtt_s + 2 * p * members[0].seconds_per_byte / self.sync_every if owned else c_all,
                c_all=c_all,
                gamma=(f + 2 * x * max(k.flops_per_s * k.seconds_per_byte for k in members)) / speed,
                e=sum(k.busy_w - k.idle_w for k in members) * f / speed, q=q,
                o=max(k.overhead_s for k in members) * f / self._fc[-1])
        return self._stage_cache[key]

    def fit_index(self, q: float, position: int) -> int | None:
        """Least micro-batch candidate whose min(position, M) in-flight rows fit, if any."""
        if q < 0:
            return None
        return next((t for t, m in enumerate(self.ms) if min(position, m) <= q * m), None)

    def latency(self, o: float, hosts: Sequence[BoardCost], stages: int) -> float:
        """λ: per micro-batch latency of a pipeline on ``hosts`` whose largest stage call cost is o."""
        return o + (min(stages, 3) - 1) * max(k.rtt_s for k in hosts)

    def cost(self, step: float, energy: float) -> float:
        return (self.eta * energy + (1 - self.eta) * self.p_ref * step) / self.B

    def points(self, pipe: _Pipe | None, shards: Sequence[_Shard]) -> Iterator[_Point]:
        """Every (M, DP samples) candidate of a pipeline next to ``shards`` (sorted by o)."""
        total = self.B
        most = _capacity(shards, min((s.o + s.cap / s.r for s in shards), default=0.0))
        if pipe is None:
            if shards and most >= total * (1 - _EPS):
                yield self._point(None, shards, 1, total)
            return
        starts = _starts(shards) if self.every_split else []
        for t in range(pipe.m, len(self.ms)):
            m = self.ms[t]
            hi = min(total - m, most)
            cands = {0.0}
            if shards and hi > 0:
                k = m + pipe.stages - 1
                bal = _balanced(shards, pipe.c_all + k * pipe.lam, k * pipe.gamma / m, total)
                cands.add(min(hi, bal))
                if self.every_split:
                    cands.update([hi], (n for n in starts if n <= hi))
            for n in sorted(cands):
                yield self._point(pipe, shards, m, n)

    def _point(self, pipe: _Pipe | None, shards: Sequence[_Shard], m: int, n: float) -> _Point:
        tau, active = _waterfill(shards, n) if n > 0 else (0.0, 0)
        step, energy, rows = tau, 0.0, self.B - n
        if pipe is not None:
            k = m + pipe.stages - 1
            step = max(tau, (pipe.c_all if n > 0 else pipe.c) + k * (rows / m * pipe.gamma + pipe.lam))
            energy = pipe.idle * step + pipe.e * rows
        for s in shards[:active]:
            energy += s.board.idle_w * step + (s.board.busy_w - s.board.idle_w) * (tau - s.o)
        return _Point(self.cost(step, energy), step, energy, m, n, active)

    def pipe(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]]) -> _Pipe | None:
        """The label of a concrete pipeline, or None when some stage does not fit."""
        c = c_all = gamma = e = o = 0.0
        m = 0
        for s in range(len(stages) - 1, -1, -1):
            i, j, members = stages[s]
            st = self.stage(i, j, members)
            t = self.fit_index(st.q, len(stages) - s)
            if t is None:
                return None
            c, c_all, gamma, e, m = max(c, st.c), max(c_all, st.c_all), max(gamma, st.gamma), e + st.e, max(m, t)
            o = max(o, st.o)
        hosts = [k for *_, g in stages for k in g]
        return _Pipe(c, c_all, gamma, e, m, len(stages), self.latency(o, hosts, len(stages)),
                     sum(k.idle_w for k in hosts))

    def outside(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]]) -> list[_Shard]:
        used = {k.name for *_, g in stages for k in g}
        return [s for s in self.shards if s.board.name not in used]

    def best(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]]) -> _Point | None:
        """The best candidate of a concrete structure (no stages: pure DP)."""
        pipe = self.pipe(stages) if stages else None
        if stages and pipe is None:
            return None
        return min(self.points(pipe, self.outside(stages)), key=lambda p: p.key, default=None)

    def plan(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]], point: _Point) -> Plan:
        """The Plan of a structure and one of its candidates, with its prediction."""
        shards = self.outside(stages)[:point.active]
        used = {k.name for *_, g in stages for k in g} | {s.board.name for s in shards}
        plan = Plan(stages=tuple(StagePlan(i, j, tuple(k.name for k in g)) for i, j, g in stages),
                    microbatches=point.microbatches if stages else 1,
                    dp_boards=tuple(s.board.name for s in shards),
                    dp_share=point.dp_samples / self.B if stages else 1.0,
                    left_out=tuple((k.name, self.left.get(k.name, "no gain")) for k in self.fleet
                                   if k.name not in used))
        return replace(plan, prediction=self.predict(plan))

    def predict(self, plan: Plan) -> Prediction:
        """Predicted step time, energy, per-board time and memory of any plan on this fleet."""
        self._validate(plan)
        n_dp = plan.dp_share * self.B if plan.stages else float(self.B)
        rows = self.B - n_dp
        share, time_s, busy, memory, stage_s, t_pipe = {}, {}, {}, {}, [], 0.0
        if plan.stages:
            m, depth = plan.microbatches, len(plan.stages)
            hosts = [self.by_name[b] for s in plan.stages for b in s.boards]
            o = max(self.stage(st.begin, st.end, [self.by_name[n] for n in st.boards]).o for st in plan.stages)
            lam, b = self.latency(o, hosts, depth), rows / m
            for s, st in enumerate(plan.stages):
                members = [self.by_name[n] for n in st.boards]
                p, f, x, a = self._span(st.begin, st.end)
                speed = sum(k.flops_per_s for k in members)
                stage_s.append(b * self.stage(st.begin, st.end, members).gamma + lam)
                for k in members:
                    w, c = k.flops_per_s / speed, self._transfer_s(p, k, len(members), plan)
                    share[k.name], busy[k.name] = w * rows / self.B, rows * f / speed
                    time_s[k.name] = c + m * (b * (f / speed + 2 * x * w * k.seconds_per_byte) + lam)
                    memory[k.name] = 2 * p + min(depth - s, m) * w * self.B / m * a
            t_pipe = max(self._transfer_s(self._span(s.begin, s.end)[0], k, len(s.boards), plan)
                         for s in plan.stages for k in (self.by_name[n] for n in s.boards))
            t_pipe += (m + depth - 1) * max(stage_s)
        shards = sorted((self.shard_of[n] for n in plan.dp_boards), key=lambda s: (s.o, s.board.name))
        tau, active = _waterfill(shards, n_dp) if n_dp > 0 else (0.0, 0)
        for s in shards[:active]:
            n = s.r * (tau - s.o)
            share[s.board.name], busy[s.board.name], time_s[s.board.name] = n / self.B, n / s.r, tau
            memory[s.board.name] = 2 * self._pc[-1] + n * self._ac[-1]
        step = max(t_pipe, tau)
        energy = sum(k.idle_w * (step - busy[k.name]) + k.busy_w * busy[k.name]
                     for k in map(self.by_name.get, busy))
        return Prediction(step_s=step, samples_per_s=self.B / step, energy_per_sample_j=energy / self.B,
                          pipeline_s=t_pipe, dp_s=tau, stage_s=tuple(stage_s), share=share, time_s=time_s,
                          busy_s=busy, memory_bytes=memory,
                          fits=all(v <= self.by_name[k].memory_bytes * (1 + 1e-9) for k, v in memory.items()))

    def _transfer_s(self, param_bytes: float, k: BoardCost, hosts: int, plan: Plan) -> float:
        """c_k of a stage host in ``plan``: rtt alone when it owns its stage's state."""
        if self.stage_state == "hosts" and hosts == 1 and not plan.dp_boards:
            return k.rtt_s + 2 * param_bytes * k.seconds_per_byte / self.sync_every
        return 2 * param_bytes * k.seconds_per_byte + k.rtt_s

    def _validate(self, plan: Plan) -> None:
        names = [b for s in plan.stages for b in s.boards] + list(plan.dp_boards)
        unknown = sorted(set(names) - set(self.by_name))
        _check(not unknown, f"plan boards not in the fleet: {unknown}")
        _check(len(set(names)) == len(names), f"a board appears twice in the plan: {names}")
        if plan.stages:
            bounds = [(s.begin, s.end) for s in plan.stages]
            _check(bounds[0][0] == 0 and bounds[-1][1] == self.L and all(b < e for b, e in bounds)
                   and all(e == b for (_, e), (b, _) in zip(bounds, bounds[1:])),
                   f"stages must tile blocks 0..{self.L} in order, got {bounds}")
            _check(all(s.boards for s in plan.stages), "every stage needs a board")
            _check(plan.microbatches <= self.B * (1 - plan.dp_share) * (1 + 1e-9),
                   f"{plan.microbatches} micro-batches need as many pipeline samples")


# --- the exact search over classes of interchangeable boards -----------------------------------

Stages = list[tuple[int, int, tuple[BoardCost, ...]]]


@dataclass
class _Unit:
    """Interchangeable items (single boards, or bundles that always act together)."""

    items: list[tuple[BoardCost, ...]]


def _attributes(k: BoardCost) -> tuple:
    return (k.flops_per_s, k.memory_bytes, k.mbit_per_s, k.rtt_s, k.idle_w, k.busy_w, k.overhead_s)


def _classes(boards: Sequence[BoardCost]) -> list[_Unit]:
    """Boards with equal cost attributes form one unit."""
    units: dict[tuple, _Unit] = {}
    for k in boards:
        units.setdefault(_attributes(k), _Unit([])).items.append((k,))
    return list(units.values())


def _transitions(units: Sequence[_Unit], blocks: int, single: bool = False) -> int:
    """An upper bound on the DP's (block range, group) transitions; ``single``: when each group
    draws on one unit only."""
    ranges = blocks * (blocks + 1) // 2
    if single:
        return ranges * math.prod(len(u.items) + 1 for u in units) * sum(len(u.items) for u in units) // 2
    return ranges * math.prod((len(u.items) + 1) * (len(u.items) + 2) // 2 for u in units)


def _fit(units: Sequence[_Unit], blocks: int, budget: int) -> bool | None:
    """How a DP over ``units`` fits ``budget`` transitions: False with every group, True with
    one-unit groups only (allowed when every unit is a class of several unbundled boards: with
    single boards or bundles as units, a stage would be just one of them), None not at all."""
    if _transitions(units, blocks) <= budget:
        return False
    if (_transitions(units, blocks, single=True) <= budget
            and all(len(u.items) > 1 and len(u.items[0]) == 1 for u in units)):
        return True
    return None


def _coarsen(units: list[_Unit], blocks: int, budget: int) -> tuple[list[_Unit], bool]:
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
            units.append(_Unit([big.items[t] + big.items[t + 1] for t in range(0, len(big.items) - 1, 2)]))
            if len(big.items) % 2:
                units.append(_Unit([big.items[-1]]))
        elif len(units) > 1:
            x, y = min(itertools.combinations(units, 2), key=lambda p: (
                sum(abs(a - b) for a, b in zip(profile(p[0].items[0]), profile(p[1].items[0]))),
                len(p[0].items[0]) + len(p[1].items[0])))
            units = [u for u in units if u is not x and u is not y] + [_Unit([x.items[0] + y.items[0]])]
        else:
            return units, False
    return units, single


def _fastest(units: list[_Unit], blocks: int, budget: int, single: bool) -> list[_Unit]:
    """The classes of the fastest boards (then best linked), as many as an unbundled DP takes
    within ``budget`` (``single``: with one-class groups, see ``_fit``)."""
    out: list[_Unit] = []
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

    def __init__(self, prob: _Problem, units: Sequence[_Unit]) -> None:
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
        head, total = prob._fc[i], prob._fc[-1]
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
        return self.prob.cost(best, idle * best + (e + self.prob._fc[i] * self.thrift) * self.prob.B)


def _search(prob: _Problem, units: list[_Unit], energy: bool, width: int | None = None,
            single: bool = False, others: Sequence[BoardCost] = ()) -> Iterator[tuple[tuple, _Point]]:
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
    terms: dict[tuple, tuple[_Stage, tuple[int | None, ...]]] = {}
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
            pipe = _Pipe(lab[0], lab[8], lab[1], lab[7], lab[3], lab[4], prob.latency(lab[9], hosts, lab[4]), idle)
            for point in prob.points(pipe, shards):
                yield lab, point


def _concrete(units: list[_Unit], label: tuple | None) -> Stages:
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


# --- the local search of the heuristic ----------------------------------------------------------


Shape = tuple[tuple[int, int, tuple[int, ...]], ...]
"""A structure up to interchangeable boards: its stages as (begin, end, boards of each class)."""


class _Climb:
    """Hill climbing over shapes (stages as board counts per class of identical boards), each
    scored once with the exact cost."""

    def __init__(self, prob: _Problem) -> None:
        self.prob = prob
        self.pools = [[k for (k,) in u.items] for u in _classes(prob.eligible)]
        self.sizes = tuple(len(p) for p in self.pools)
        self.index = {k.name: c for c, pool in enumerate(self.pools) for k in pool}
        self.scores: dict[Shape, _Point | None] = {}
        self._terms: dict[tuple, _Stage] = {}
        self._shards: dict[tuple[int, ...], list[_Shard]] = {}

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

    def score(self, shape: Shape) -> _Point | None:
        """``prob.best`` of the shape's stages, with stage terms and shards cached by class counts."""
        if shape in self.scores:
            return self.scores[shape]
        prob, depth = self.prob, len(shape)
        c = c_all = gamma = e = o = 0.0
        m = 0
        used = [0] * len(self.pools)
        point = None
        for s, (i, j, g) in enumerate(shape):
            st = self._terms.get((i, j, g))
            if st is None:
                members = [k for pool, n in zip(self.pools, g) for k in pool[:n]]
                st = self._terms[i, j, g] = prob.stage(i, j, members)
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
            pipe = _Pipe(c, c_all, gamma, e, m, depth, prob.latency(o, hosts, depth), idle)
            point = min(prob.points(pipe, shards), key=lambda p: p.key, default=None)
        self.scores[shape] = point
        return point

    def splits(self, i: int, cut: int, j: int, g: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        """Boards for the head [i, cut) when stage [i, j) on ``g`` splits at ``cut``."""
        if math.prod(n + 1 for n in g) <= SPLIT_ALL:
            yield from itertools.product(*(range(n + 1) for n in g))
            return
        fc = self.prob._fc
        share = (fc[cut] - fc[i]) / (fc[j] - fc[i]) if fc[j] > fc[i] else (cut - i) / (j - i)
        base = tuple(math.floor(n * share) for n in g)
        yield base
        for c, n in enumerate(g):
            if base[c] < n:
                yield base[:c] + (base[c] + 1,) + base[c + 1:]

    def moves(self, shape: Shape) -> Iterator[Shape]:
        """Shift a cut anywhere between its neighbours, merge two neighbouring stages, split a
        stage in two (blocks and boards), and per class: add a board from outside, drop one, move
        one to another stage, trade one for another class's board from outside or from another
        stage."""
        classes, stages = range(len(self.sizes)), list(shape)
        spare = [n - sum(g[c] for *_, g in shape) for c, n in enumerate(self.sizes)]

        def put(base: list, s: int, g: tuple[int, ...]) -> list:
            return base[:s] + [(base[s][0], base[s][1], g)] + base[s + 1:]

        def plus(g: tuple[int, ...], c: int, d: int) -> tuple[int, ...]:
            return g[:c] + (g[c] + d,) + g[c + 1:]

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

    def escape(self, shape: Shape, point: _Point) -> tuple[Shape, _Point] | None:
        """From a local optimum: climb from its LOOKAHEAD best neighbours; the best result if it
        beats ``point``."""
        near = sorted(((p, n) for n in self.moves(shape) if (p := self.score(n)) is not None),
                      key=lambda x: x[0].key)[:LOOKAHEAD]
        best = min((self.climb(n, p) for p, n in near), key=lambda x: x[1].key, default=None)
        return best if best is not None and best[1].key < point.key else None

    def climb(self, shape: Shape, point: _Point) -> tuple[Shape, _Point]:
        """Best-improvement hill climb from ``shape`` until no move improves."""
        while True:
            best = min(((p, n) for n in self.moves(shape) if (p := self.score(n)) is not None),
                       key=lambda x: x[0].key, default=None)
            if best is None or best[0].key >= point.key:
                return shape, point
            point, shape = best


def _polish(prob: _Problem, starts: Sequence[Stages]) -> tuple[Stages, _Point]:
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
    _check(bool(done), "no plan fits the boards' memory")
    shape, point = min(done, key=lambda c: c[1].key)
    while shape and LOOKAHEAD:
        nxt = climb.escape(shape, point)
        if nxt is None:
            break
        shape, point = nxt
    return climb.stages(shape), point


# --- the public planner ------------------------------------------------------------------------

def _weight(objective: str | float) -> float:
    if objective == "time":
        return 0.0
    if objective == "energy":
        return 1.0
    _check(isinstance(objective, (int, float)) and not isinstance(objective, bool) and 0 <= objective <= 1,
           f"objective must be 'time', 'energy' or a weight in [0, 1], got {objective!r}")
    return float(objective)


def _candidates(prob: _Problem, exact_budget: int, energy: bool) -> tuple[list[Iterator[tuple]], bool]:
    """Every candidate, (label or None for pure DP, units, point), one iterator per search, and
    whether the search is exact. Beyond the exact budget, beams: over every board, bundled to
    fit BEAM_BUDGET, and over the classes of the fastest boards alone, unbundled, with any groups
    and with one-class groups (those that differ)."""
    units = _classes(prob.eligible)
    exact = _transitions(units, prob.L) * (_ENERGY_LABEL_COST if energy else 1) <= exact_budget
    pure = prob.best([])
    head = iter([(None, None, pure)] if pure is not None else [])
    if exact:
        return [itertools.chain(head, _tagged(units, _search(prob, units, energy)))], True
    searches = [_coarsen(units, prob.L, BEAM_BUDGET)]
    for single in (False, True):
        fast = _fastest(units, prob.L, FAST_BUDGET, single)
        if fast and (fast, single) not in searches:
            searches.append((fast, single))
    beams = []
    for some, single in searches:
        inside = {k.name for u in some for item in u.items for k in item}
        others = [k for k in prob.eligible if k.name not in inside]
        beams.append(_tagged(some, _search(prob, some, energy, BEAM_WIDTH, single, others)))
    return [head, *beams], False


def _tagged(units: list[_Unit], found: Iterator[tuple[tuple, _Point]]) -> Iterator[tuple]:
    """A search's candidates, each with the units its label's groups count."""
    for label, point in found:
        yield label, units, point


def predict(plan: Plan, fleet: Sequence[BoardCost], model: ModelCost, global_batch: int, *,
            stage_state: str = "hosts", sync_every: int = 50) -> Prediction:
    """Predicted step time, samples/s, energy per sample, per-stage time, per-board memory and
    busy seconds of ``plan`` (formulas in the module docstring)."""
    return _Problem(fleet, model, global_batch, stage_state=stage_state, sync_every=sync_every).predict(plan)


def objective_cost(prediction: Prediction, fleet: Sequence[BoardCost], objective: str | float) -> float:
    """The value the planner minimises: (η · energy + (1 − η) · P_ref · step) per sample."""
    eta = _weight(objective)
    p_ref = sum(k.busy_w for k in fleet) or 1.0
    return eta * prediction.energy_per_sample_j + (1 - eta) * p_ref / prediction.samples_per_s


def plan_optimal(fleet: Sequence[BoardCost], model: ModelCost, global_batch: int,
                 objective: str | float = "time", *, microbatches: Sequence[int] = MICROBATCH_CANDIDATES,
                 battery_floor: float = BATTERY_FLOOR_PERCENT, exact_budget: int = EXACT_BUDGET,
                 stage_state: str = "hosts", sync_every: int = 50) -> Plan:
    """The plan minimising ``objective`` ("time", "energy" or a weight η of energy in [0, 1]):
    exact over pipelines, hybrids and pure DP when the DP fits ``exact_budget``, else the
    heuristic (beam searches plus a hill climb, see the module docstring). Raises ValueError
    when nothing fits in memory."""
    prob = _Problem(fleet, model, global_batch, _weight(objective), microbatches, battery_floor, stage_state, sync_every)
    prob.every_split = prob.eta > 0
    searches, exact = _candidates(prob, exact_budget, prob.eta > 0)
    ranked = []
    for found in searches:
        by_label: dict[int, tuple] = {}
        for label, units, point in found:
            old = by_label.get(id(label))
            if old is None or point.key < old[2].key:
                by_label[id(label)] = (label, units, point)
        ranked.append(sorted(by_label.values(), key=lambda c: c[2].key))
    _check(any(ranked), "no plan fits the boards' memory")
    if exact:
        label, units, point = min((r[0] for r in ranked if r), key=lambda c: c[2].key)
        return prob.plan(_concrete(units, label), point)
    return prob.plan(*_polish(prob, [_concrete(units, label) for r in ranked for label, units, _ in _diverse(r)]))


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


def pareto(fleet: Sequence[BoardCost], model: ModelCost, global_batch: int, *,
           microbatches: Sequence[int] = MICROBATCH_CANDIDATES, battery_floor: float = BATTERY_FLOOR_PERCENT,
           exact_budget: int = EXACT_BUDGET, stage_state: str = "hosts", sync_every: int = 50) -> list[Plan]:
    """The (step time, energy) non-dominated plans among the candidates the search considers,
    fastest first (beyond the exact budget, plus the hill-climbed time and energy optima)."""
    prob = _Problem(fleet, model, global_batch, 0.0, microbatches, battery_floor, stage_state, sync_every)
    searches, exact = _candidates(prob, exact_budget, True)
    pool = [(lambda lab=lab, units=units: _concrete(units, lab), p) for found in searches for lab, units, p in found]
    _check(bool(pool), "no plan fits the boards' memory")
    if not exact:
        for eta in (0.0, 1.0):
            aim = copy.copy(prob)
            aim.eta = eta
            make, point = min(pool, key=lambda c: (aim.cost(c[1].step, c[1].energy), c[1].step))
            if make():
                stages, point = _polish(aim, [make()])
                pool.append((lambda stages=stages: stages, point))
    front, least = [], math.inf
    for make, point in sorted(pool, key=lambda c: (c[1].step, c[1].energy)):
        if point.energy < least * (1 - 1e-12):
            front.append(prob.plan(make(), point))
            least = point.energy
    return front


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
                sync_every: int = 50) -> Plan:
    """The optimum by enumeration of every board subset, ordered grouping and contiguous cut
    (same cost function as ``plan_optimal``); for tests on up to 6 boards and 8 blocks."""
    prob = _Problem(fleet, model, global_batch, _weight(objective), microbatches, battery_floor, stage_state, sync_every)
    _check(len(prob.eligible) <= 6 and prob.L <= 8, "brute_force is for tiny instances only")
    pure = prob.best([])
    best = ([], pure) if pure is not None else None
    for size in range(1, len(prob.eligible) + 1):
        for subset in itertools.combinations(prob.eligible, size):
            for groups in _ordered_partitions(subset):
                for cuts in itertools.combinations(range(1, prob.L), len(groups) - 1):
                    bounds = (0, *cuts, prob.L)
                    stages = [(bounds[s], bounds[s + 1], g) for s, g in enumerate(groups)]
                    point = prob.best(stages)
                    if point is not None and (best is None or point.key < best[1].key):
                        best = (stages, point)
    _check(best is not None, "no plan fits the boards' memory")
    return prob.plan(*best)
