"""The planner's cost model: what a plan costs per step in time and energy, and whether it fits.

Units: bytes, FLOP, s, W, J; board k moves 1/σ_k = 1e6/8 · mbit_per_s bytes/s. A plan is a
pipeline of S stages (``edgetrain.plan``) with M micro-batches under 1F1B, next to it DP shards.
Stage [i, j) on group G, with f_G = Σ flops_per_s and row weights w_k = f_k / f_G:
    P, F  param bytes, training FLOPs per sample (forward + backward) of its blocks
    X     activation bytes per sample crossing its boundaries (out of block i-1, out of j-1)
    A     activation bytes per sample it keeps for backward (its input and its blocks' outputs)
    γ_s = (F + 2 X · max_k f_k σ_k) / f_G      seconds per sample: compute, plus activations
                                              forward and gradients back, each host on its link
    c_k = 2 P σ_k + rtt_k                      stage parameters down, gradients up, every step;
                                              for a stage with one host that owns its state
                                              (stage_state "hosts", no DP shards):
                                              c_k = rtt_k + P σ_k with replication (the default:
                                              its gradients go up to the coordinator's replica
                                              every step), else c_k = rtt_k + 2 P σ_k / K
                                              (parameters and momentum pulled back every
                                              K = sync_every steps)
    mem_k = 2 P + min(S − s, M) · w_k · (B / M) · A      params, grads, 1F1B in-flight rows
Pipeline with B_p samples, b = B_p / M, hosts H:
    o_s = max_G overhead_k · F / F_model     a call's fixed cost, in proportion to the stage's work
    λ = max_s o_s + (min(S, 3) − 1) · max_H rtt_s    per micro-batch latency, worst case
    t_s = b γ_s + λ;   T_pipe = max_H c_k + (M + S − 1) · max_s t_s
A channel group (``edgetrain.channels``; ``channel_groups``) runs every row on every member k,
each computing the share w_k of the split layers' output channels (F_c of F, P_c of P; the
rest, F_r and P_r, replicated), gathering their outputs (O bytes per sample) forward and
summing the gradients of their inputs (I bytes) backward, in L_c exchanges each way per
micro-batch. Every member receives the stage's inputs and output gradients (X); the leader (the
first member) also sends them on. A member downloads its rows of the split layers' parameters
and the rest whole, and uploads its rows (the leader the rest too); it holds layer-sized tensors
(memory as for the whole stage). Per sample, k's link carries the larger of what it sends and
what it receives:
    g_k = max(w_k O (n−1), (1 − w_k) O) + (n − 1) I      n members
    γ_s = max_k (F_r + w_k F_c) / f_k + (X + g_k) σ_k;  o_s = max_k overhead_k (F_r + w_k F_c) / F_model
          + 2 L_c max_k rtt_k;   c_k = (P_r + w_k P_c + [leader] P_r + w_k P_c) σ_k + rtt_k (never owned)
    mem_k = 2 P + min(S − s, M) · (B / M) · A            every member keeps every row
A channel group never needs less memory than the same boards splitting rows; the model keeps
the channel split for a group when it fits and c + B γ + 4 o (a stage's time per step at 4
micro-batches, the bubble aside) is less than the rows split's.
DP shard k with n_k samples: T_k = o_k + n_k F / f_k with o_k = 2 P σ_k + rtt_k + overhead_s
(whole model); its memory is 2 P + n_k A. Shares are water-filled so every active shard finishes
together (``split_proportional``'s rule); a shard that cannot start before that gets none.
    step = max(T_pipe, T_k);  energy/step = Σ_used idle_w · step + (busy_w − idle_w) · busy_k
with busy = compute seconds; objective cost = (η · energy + (1 − η) · P_ref · step) / B, η = 0
for time, 1 for energy, P_ref = Σ busy_w of the fleet (Zeus). Stage-host memory is checked at the
full batch (B / M), so a plan still fits when its DP shards drop out. A stage-less plan without
``dp_boards`` is DP over every board of the fleet.
Boards on battery below ``battery_floor`` and not plugged in are left out under every objective.

``Problem`` holds a fleet, a model, a batch and an objective with these terms precomputed; the
searches (``coordinator.planning.search``, ``.climb``, ``.brute_force``) score structures with
it, and ``predict`` scores any plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from edgetrain.plan import NO_GAIN, BoardCost, ModelCost, Plan, Prediction, StagePlan

MICROBATCH_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""Micro-batch counts the planner tries (those above the pipeline's samples are skipped)."""
BATTERY_FLOOR_PERCENT = 20.0
"""A board below this charge and not plugged in gets no work."""

_EPS = 1e-12


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


@dataclass(frozen=True)
class StageTerms:
    """One stage's cost terms (its blocks on a group of boards), named as in the module docstring."""

    c: float
    """Per-step transfer time when the pipeline runs alone (a single host owning its state: rtt
    and its replica's or its pulls' share)."""
    c_all: float
    """The same next to DP shards (every stage moves its parameters and gradients)."""
    gamma: float
    """γ: seconds per pipeline sample."""
    e: float
    """Busy energy above idle per pipeline sample."""
    q: float
    """Memory headroom: min over hosts of (memory − 2P) / (w_k B A); < 0 when params do not fit."""
    o: float = 0.0
    """Fixed cost of one micro-batch call on the stage: max over hosts of overhead x its work share."""
    split: str = "rows"
    """How the group divides the stage: "rows" or "channels" (the cheaper of the two)."""


@dataclass(frozen=True)
class Pipe:
    """A pipeline's terms, combined over its stages: max c, c_all and γ, summed busy energy."""

    c: float
    c_all: float
    gamma: float
    e: float
    m: int
    """Index of the least micro-batch count whose activations fit."""
    stages: int
    lam: float
    """λ, the per micro-batch latency."""
    idle: float
    """Idle power of the stage hosts."""


@dataclass(frozen=True)
class Shard:
    """A board as a DP shard: when it can start (o: the whole model moved, rtt, a call's cost)."""

    board: BoardCost
    o: float
    r: float
    """Samples per second."""
    cap: float
    """Most samples its memory holds."""


@dataclass(frozen=True)
class Point:
    """One candidate of a structure: its micro-batch count and DP samples, and what it costs."""

    cost: float
    step: float
    energy: float
    microbatches: int
    dp_samples: float
    active: int
    """The first ``active`` shards (sorted by o) get work."""

    @property
    def key(self) -> tuple[float, float, float]:
        """What candidates are ranked by: cost, then step time, then energy."""
        return self.cost, self.step, self.energy


def _waterfill(shards: Sequence[Shard], n: float) -> tuple[float, int]:
    """When shards sorted by o finish ``n`` samples together, and how many of them work."""
    rate = offset = 0.0
    for a, s in enumerate(shards, 1):
        rate += s.r
        offset += s.r * s.o
        tau = (n + offset) / rate
        if a == len(shards) or tau <= shards[a].o * (1 + _EPS):
            return tau, a
    return 0.0, 0


def _capacity(shards: Sequence[Shard], tau: float) -> float:
    """Samples the shards finish by ``tau``."""
    return sum(s.r * (tau - s.o) for s in shards if s.o < tau)


def _starts(shards: Sequence[Shard]) -> list[float]:
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


def _balanced(shards: Sequence[Shard], o_p: float, g_p: float, total: float) -> float:
    """DP samples at which a pipeline taking o_p + g_p·samples and the shards finish together."""
    rate = offset = 0.0
    for s in shards:
        if o_p + g_p * (total - (rate * s.o - offset)) <= s.o:
            break
        rate += s.r
        offset += s.r * s.o
    tau = (o_p + g_p * (total + offset)) / (1 + g_p * rate)
    return rate * tau - offset


class Problem:
    """A fleet, a model, a batch and an objective, with the cost model's pieces precomputed."""

    def __init__(self, fleet: Sequence[BoardCost], model: ModelCost, global_batch: int,
                 eta: float = 0.0, microbatches: Sequence[int] = MICROBATCH_CANDIDATES,
                 battery_floor: float = BATTERY_FLOOR_PERCENT, stage_state: str = "hosts",
                 sync_every: int = 50, replicate: bool = True, channel_groups: bool = True) -> None:
        names = [k.name for k in fleet]
        _check(bool(fleet), "the fleet is empty")
        _check(len(set(names)) == len(names), f"board names must be unique, got {names}")
        _check(global_batch >= 1, f"global_batch must be >= 1, got {global_batch}")
        _check(stage_state in ("hosts", "coordinator"), f"stage_state must be hosts or coordinator, got {stage_state!r}")
        self.fleet, self.model, self.B, self.eta = list(fleet), model, global_batch, eta
        self.stage_state = stage_state
        self.sync_every = max(1, sync_every)
        self.replicate = replicate
        """Owned stages are replicated (pipeline.replicate): their gradients go up every step."""
        self.channel_groups = channel_groups
        """Whether groups may split a stage by channels (else by rows only)."""
        self.by_name = {k.name: k for k in fleet}
        self.L = len(model.blocks)
        self.ms = tuple(sorted({m for m in microbatches if 1 <= m <= global_batch}))
        _check(bool(self.ms), f"no micro-batch count in {list(microbatches)} fits a batch of {global_batch}")
        self.p_ref = sum(k.busy_w for k in fleet) or 1.0
        self._act = [b.activation_bytes for b in model.blocks]
        self._pc, self.fc, self._ac = [0.0], [0.0], [0.0]  # sums over the blocks before each index
        self._cc = [(0.0, 0.0, 0.0, 0, 0.0)]  # the same for F_c, O, I, L_c and P_c
        for b in model.blocks:
            self._pc.append(self._pc[-1] + b.param_bytes)
            self.fc.append(self.fc[-1] + b.train_flops)
            self._ac.append(self._ac[-1] + b.activation_bytes)
            last = self._cc[-1]
            self._cc.append((last[0] + b.channel_train_flops, last[1] + b.channel_output_bytes,
                             last[2] + b.channel_input_bytes, last[3] + b.channel_layers,
                             last[4] + b.channel_param_bytes))
        self.left = {k.name: f"battery {k.battery_percent:.0f}% unplugged" for k in fleet
                     if k.battery_percent is not None and k.battery_percent < battery_floor
                     and k.plugged is not True}
        self.eligible = [k for k in fleet if k.name not in self.left]
        self.stage_hosts = [k for k in self.eligible if not k.own_data]
        """The boards a stage may be placed on (one with only its own data is a DP shard or nothing)."""
        self.shard_of = {k.name: self._shard(k) for k in fleet}
        self.shards = sorted((self.shard_of[k.name] for k in self.eligible if self.shard_of[k.name].cap > 0),
                             key=lambda s: (s.o, s.board.name))
        self._stage_cache: dict[tuple, StageTerms] = {}
        self.every_split = True
        """Whether ``points`` tries every end of the pieces the DP samples' cost is linear on:
        energy needs them; step time alone is least with no DP samples or at the balanced split
        (the most the shards take, when the pipeline is slower still)."""

    def _span(self, i: int, j: int) -> tuple[float, float, float, float]:
        """P, F, X, A of blocks [i, j) (see the module docstring)."""
        a_in = self._act[i - 1] if i > 0 else 0.0
        a_out = self._act[j - 1] if j < self.L else 0.0
        return (self._pc[j] - self._pc[i], self.fc[j] - self.fc[i], a_in + a_out,
                a_in + self._ac[j] - self._ac[i])

    def _shard(self, k: BoardCost) -> Shard:
        p, f, a = self._pc[-1], self.fc[-1], self._ac[-1]
        slack = k.memory_bytes - 2 * p
        return Shard(k, 2 * p * k.seconds_per_byte + k.rtt_s + k.overhead_s, k.flops_per_s / f,
                      slack / a if a > 0 else (math.inf if slack >= 0 else -1.0))

    def _channel_span(self, i: int, j: int) -> tuple[float, float, float, int, float]:
        """F_c, O, I, L_c, P_c of blocks [i, j) (see the module docstring)."""
        hi, lo = self._cc[j], self._cc[i]
        return hi[0] - lo[0], hi[1] - lo[1], hi[2] - lo[2], hi[3] - lo[3], hi[4] - lo[4]

    def channel_member(self, i: int, j: int, k: BoardCost, members: Sequence[BoardCost]) -> tuple[float, float, float]:
        """A channel group member's (parameter bytes it moves down and up per step, compute
        seconds per sample, link seconds per sample) on blocks [i, j); members[0] leads."""
        p, f, x, _ = self._span(i, j)
        fc, out, inp, _, pc = self._channel_span(i, j)
        n, w = len(members), k.flops_per_s / sum(m.flops_per_s for m in members)
        exchange = max(w * out * (n - 1), (1 - w) * out) + (n - 1) * inp
        moved = (p - pc + w * pc) * (2 if k is members[0] else 1) + (0 if k is members[0] else w * pc)
        return moved, (f - fc + w * fc) / k.flops_per_s, (x + exchange) * k.seconds_per_byte

    def _channel_terms(self, i: int, j: int, members: Sequence[BoardCost]) -> StageTerms:
        p, _, _, a = self._span(i, j)
        layers = self._channel_span(i, j)[3]
        q, c, gamma, e, o = math.inf, 0.0, 0.0, 0.0, 0.0
        for k in members:
            params, compute, link = self.channel_member(i, j, k, members)
            slack, need = k.memory_bytes - 2 * p, self.B * a
            q = min(q, -1.0 if slack < 0 else slack / need if need > 0 else math.inf)
            c = max(c, params * k.seconds_per_byte + k.rtt_s)
            gamma = max(gamma, compute + link)
            e += (k.busy_w - k.idle_w) * compute
            o = max(o, k.overhead_s * compute * k.flops_per_s / self.fc[-1])
        o += 2 * layers * max(k.rtt_s for k in members)
        return StageTerms(c=c, c_all=c, gamma=gamma, e=e, q=q, o=o, split="channels")

    def stage(self, i: int, j: int, members: Sequence[BoardCost]) -> StageTerms:
        """Cost terms of blocks [i, j) on a group (cached by the members' names): split by rows,
        or by channels when that is allowed, fits and costs less (module docstring)."""
        key = (i, j, tuple(k.name for k in members))
        if key not in self._stage_cache:
            rows = self._row_terms(i, j, members)
            if self.channel_groups and len(members) > 1 and self._channel_span(i, j)[3]:
                chan = self._channel_terms(i, j, members)
                if chan.q >= 0 and _stage_step(chan, self.B) < _stage_step(rows, self.B):
                    rows = chan
            self._stage_cache[key] = rows
        return self._stage_cache[key]

    def stage_as(self, i: int, j: int, members: Sequence[BoardCost], split: str) -> StageTerms:
        """Cost terms of blocks [i, j) on a group that divides them by ``split`` (a plan's choice)."""
        if split == "channels":
            return self._channel_terms(i, j, members)
        return self._row_terms(i, j, members)

    def _row_terms(self, i: int, j: int, members: Sequence[BoardCost]) -> StageTerms:
        p, f, x, a = self._span(i, j)
        speed = sum(k.flops_per_s for k in members)
        q = math.inf
        for k in members:
            slack, need = k.memory_bytes - 2 * p, k.flops_per_s / speed * self.B * a
            q = min(q, -1.0 if slack < 0 else slack / need if need > 0 else math.inf)
        c_all = max(2 * p * k.seconds_per_byte + k.rtt_s for k in members)
        owned = self.stage_state == "hosts" and len(members) == 1
        return StageTerms(
            c=self._owned_transfer_s(p, members[0]) if owned else c_all,
            c_all=c_all,
            gamma=(f + 2 * x * max(k.flops_per_s * k.seconds_per_byte for k in members)) / speed,
            e=sum(k.busy_w - k.idle_w for k in members) * f / speed, q=q,
            o=max(k.overhead_s for k in members) * f / self.fc[-1])

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

    def points(self, pipe: Pipe | None, shards: Sequence[Shard]) -> Iterator[Point]:
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

    def _point(self, pipe: Pipe | None, shards: Sequence[Shard], m: int, n: float) -> Point:
        tau, active = _waterfill(shards, n) if n > 0 else (0.0, 0)
        step, energy, rows = tau, 0.0, self.B - n
        if pipe is not None:
            k = m + pipe.stages - 1
            step = max(tau, (pipe.c_all if n > 0 else pipe.c) + k * (rows / m * pipe.gamma + pipe.lam))
            energy = pipe.idle * step + pipe.e * rows
        for s in shards[:active]:
            energy += s.board.idle_w * step + (s.board.busy_w - s.board.idle_w) * (tau - s.o)
        return Point(self.cost(step, energy), step, energy, m, n, active)

    def pipe(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]]) -> Pipe | None:
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
        return Pipe(c, c_all, gamma, e, m, len(stages), self.latency(o, hosts, len(stages)),
                     sum(k.idle_w for k in hosts))

    def outside(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]]) -> list[Shard]:
        used = {k.name for *_, g in stages for k in g}
        return [s for s in self.shards if s.board.name not in used]

    def best(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]]) -> Point | None:
        """The best candidate of a concrete structure (no stages: pure DP)."""
        pipe = self.pipe(stages) if stages else None
        if stages and pipe is None:
            return None
        return min(self.points(pipe, self.outside(stages)), key=lambda p: p.key, default=None)

    def plan(self, stages: Sequence[tuple[int, int, Sequence[BoardCost]]], point: Point) -> Plan:
        """The Plan of a structure and one of its candidates, with its prediction."""
        shards = self.outside(stages)[:point.active]
        used = {k.name for *_, g in stages for k in g} | {s.board.name for s in shards}
        plan = Plan(stages=tuple(StagePlan(i, j, tuple(k.name for k in g), self.stage(i, j, g).split)
                                 for i, j, g in stages),
                    microbatches=point.microbatches if stages else 1,
                    dp_boards=tuple(s.board.name for s in shards),
                    dp_share=point.dp_samples / self.B if stages else 1.0,
                    left_out=tuple((k.name, self.left.get(k.name, NO_GAIN)) for k in self.fleet
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
            terms = [self.stage_as(st.begin, st.end, [self.by_name[n] for n in st.boards], st.split)
                     for st in plan.stages]
            lam, b = self.latency(max(t.o for t in terms), hosts, depth), rows / m
            transfer = 0.0
            for s, st in enumerate(plan.stages):
                members = [self.by_name[n] for n in st.boards]
                p, f, x, a = self._span(st.begin, st.end)
                speed = sum(k.flops_per_s for k in members)
                stage_s.append(b * terms[s].gamma + lam)
                for k in members:
                    w = k.flops_per_s / speed
                    if st.channels:
                        params, compute, link = self.channel_member(st.begin, st.end, k, members)
                        c = params * k.seconds_per_byte + k.rtt_s
                        share[k.name], busy[k.name] = w * rows / self.B, rows * compute
                        time_s[k.name] = c + m * (b * (compute + link) + lam)
                        memory[k.name] = 2 * p + min(depth - s, m) * self.B / m * a
                    else:
                        c = self._transfer_s(p, k, len(members), plan)
                        share[k.name], busy[k.name] = w * rows / self.B, rows * f / speed
                        time_s[k.name] = c + m * (b * (f / speed + 2 * x * w * k.seconds_per_byte) + lam)
                        memory[k.name] = 2 * p + min(depth - s, m) * w * self.B / m * a
                    transfer = max(transfer, c)
            t_pipe = transfer + (m + depth - 1) * max(stage_s)
        dp_boards = plan.dp_boards if plan.stages or plan.dp_boards else tuple(self.by_name)
        shards = sorted((self.shard_of[n] for n in dp_boards), key=lambda s: (s.o, s.board.name))
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
        """c_k of a stage host in ``plan`` (less when it owns its stage's state)."""
        if self.stage_state == "hosts" and hosts == 1 and not plan.dp_boards:
            return self._owned_transfer_s(param_bytes, k)
        return 2 * param_bytes * k.seconds_per_byte + k.rtt_s

    def _owned_transfer_s(self, param_bytes: float, k: BoardCost) -> float:
        """c_k of a host owning its stage: its gradients up to the replica every step, or its
        parameters and momenta pulled every sync_every steps."""
        moved = param_bytes if self.replicate else 2 * param_bytes / self.sync_every
        return k.rtt_s + moved * k.seconds_per_byte

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


def _stage_step(terms: StageTerms, batch: int) -> float:
    """A stage's time per step at 4 micro-batches, bubble aside: what the split chooser compares."""
    return terms.c_all + batch * terms.gamma + 4 * terms.o


def objective_weight(objective: str | float) -> float:
    """η, the weight of energy in the objective ("time": 0, "energy": 1, or a weight in [0, 1])."""
    if objective == "time":
        return 0.0
    if objective == "energy":
        return 1.0
    _check(isinstance(objective, (int, float)) and not isinstance(objective, bool) and 0 <= objective <= 1,
           f"objective must be 'time', 'energy' or a weight in [0, 1], got {objective!r}")
    return float(objective)


def predict(plan: Plan, fleet: Sequence[BoardCost], model: ModelCost, global_batch: int, *,
            stage_state: str = "hosts", sync_every: int = 50, replicate: bool = True,
            channel_groups: bool = True) -> Prediction:
    """Predicted step time, samples/s, energy per sample, per-stage time, per-board memory and
    busy seconds of ``plan`` (formulas in the module docstring; a plan with neither stages nor
    ``dp_boards`` is DP over every board of ``fleet``; a plan's channel groups are priced as
    channel groups whatever ``channel_groups`` says)."""
    return Problem(fleet, model, global_batch, stage_state=stage_state, sync_every=sync_every,
                   replicate=replicate).predict(plan)


def objective_cost(prediction: Prediction, fleet: Sequence[BoardCost], objective: str | float) -> float:
    """The value the planner minimises: (η · energy + (1 − η) · P_ref · step) per sample."""
    eta = objective_weight(objective)
    p_ref = sum(k.busy_w for k in fleet) or 1.0
    return eta * prediction.energy_per_sample_j + (1 - eta) * p_ref / prediction.samples_per_s
