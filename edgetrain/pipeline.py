"""The pure parts of pipeline model parallelism: schedules, their simulation, and row/block splits.

A model's blocks are cut into S consecutive **stages**; stage s owns blocks ``[begin, end)`` and
sends its output activations to stage s + 1 (and receives gradients back from it). A stage may be
hosted by a **group** of several boards: every board holds the stage's blocks, and each
micro-batch is split by rows in proportion to the boards' speeds (``split_rows``), so the group
finishes a micro-batch together; between two groups, each row range travels from the board that
computed it to the board that needs it (``overlaps``). A single-board stage is a group of one.
A **channel group** (``edgetrain.channels``) instead gives every member every row and a share of
each split layer's output channels (``channel_shares``, ``channel_bounds``); between groups its
leader alone sends, and each of its members receives every row (``routes``).

A pipeline's batch is cut into M **micro-batches** (``split_microbatches``) so that stages work
on different micro-batches at once. Each stage runs the forward (F) and backward (B) of every
micro-batch in an order given by a **schedule**:

- ``gpipe`` (GPipe): all forwards F0..F(M-1), then all backwards B0..B(M-1) (the order torch's
  ``ScheduleGPipe`` uses; running backwards in reverse order gives the same step time). Every
  stage holds the activations of all M micro-batches at once.
- ``1f1b`` (PipeDream-flush, torch's ``Schedule1F1B``): stage s first runs min(S - s - 1, M)
  warm-up forwards, then alternates one forward and one backward while forwards remain, then
  runs the remaining backwards. Backwards run in micro-batch order. Stage s holds at most
  min(S - s, M) micro-batches' activations, independent of M.

With S equal stages, both schedules take (M + S - 1)(f + b) per step for forward time f and
backward time b per micro-batch, against M(f + b) of work per stage: the idle **bubble** is
(S - 1) / (M + S - 1) of the step (``bubble_fraction``). ``simulate`` computes the step time of
any per-stage op order, including unequal stages and a link delay between neighbours.

Everything here except ``run_blocks`` is plain Python: no torch, sockets or clocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from edgetrain.plan import SCHEDULES

if TYPE_CHECKING:
    import torch


FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Op:
    """One unit of a stage's work: the forward or the backward of one micro-batch."""

    kind: str
    """``"F"`` (forward) or ``"B"`` (backward)."""
    microbatch: int
    """Index of the micro-batch, from 0."""

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(f"Op kind must be {FORWARD!r} or {BACKWARD!r}, got {self.kind!r}")
        if self.microbatch < 0:
            raise ValueError(f"Op microbatch must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _check_pipeline(stages: int, microbatches: int) -> None:
    """Raise ValueError unless there is at least one stage and one micro-batch."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def schedule(name: str, stages: int, microbatches: int, stage: int) -> list[Op]:
    """The order in which stage ``stage`` (0-based) of a ``stages``-stage pipeline runs its ops.

    Every micro-batch appears exactly once as a forward and once as a backward, the backward
    after the forward. See the module docstring for the two schedules.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    _check_pipeline(stages, microbatches)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) for {stages} stages, got {stage}")
    forwards = [Op(FORWARD, m) for m in range(microbatches)]
    backwards = [Op(BACKWARD, m) for m in range(microbatches)]
    if name == "gpipe":
        return forwards + backwards
    warmup = min(stages - stage - 1, microbatches)
    ops = forwards[:warmup]
    for m in range(warmup, microbatches):
        ops += [forwards[m], backwards[m - warmup]]
    return ops + backwards[microbatches - warmup:]


def peak_in_flight(ops: Sequence[Op]) -> int:
    """The most micro-batches whose forward has run and whose backward has not, at any point.

    This is the stage's activation memory in units of one micro-batch's activations.
    """
    in_flight: set[int] = set()
    peak = 0
    for op in ops:
        if op.kind == FORWARD:
            if op.microbatch in in_flight:
                raise ValueError(f"{op} runs twice without a backward in between")
            in_flight.add(op.microbatch)
            peak = max(peak, len(in_flight))
        elif op.microbatch in in_flight:
            in_flight.remove(op.microbatch)
        else:
            raise ValueError(f"{op} runs before its forward")
    return peak


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a step of S equal stages and M micro-batches: (S - 1) / (M + S - 1)."""
    _check_pipeline(stages, microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def _check_ops(ops_per_stage: Sequence[Sequence[Op]]) -> None:
    """Raise ValueError unless every stage runs the same ops, each exactly once."""
    if not ops_per_stage:
        raise ValueError("need at least one stage")
    expected = set(ops_per_stage[0])
    for s, ops in enumerate(ops_per_stage):
        if len(set(ops)) != len(ops):
            raise ValueError(f"stage {s} runs an op more than once: {[str(op) for op in ops]}")
        if set(ops) != expected:
            raise ValueError(f"stage {s} runs other ops than stage 0: "
                             f"{sorted(map(str, set(ops) ^ expected))} differ")
    for op in expected:
        if Op(FORWARD if op.kind == BACKWARD else BACKWARD, op.microbatch) not in expected:
            raise ValueError(f"{op} has no matching {'B' if op.kind == FORWARD else 'F'}"
                             f"{op.microbatch}")


def simulate(
    ops_per_stage: Sequence[Sequence[Op]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    comm_s: float = 0.0,
) -> tuple[float, list[float]]:
    """Step time and per-stage busy fraction of a pipeline running the given op orders.

    Stage s runs its ops strictly in order, each as soon as the stage is free and its input has
    arrived: F(m) on s > 0 needs F(m) on s - 1 finished plus ``comm_s``; B(m) on s < S - 1 needs
    B(m) on s + 1 finished plus ``comm_s``; B(m) on the last stage needs its own F(m). Forward
    and backward of one micro-batch take ``forward_s[s]`` and ``backward_s[s]`` on stage s.
    Returns ``(makespan, busy)`` with ``busy[s]`` the share of the makespan stage s computes.
    Raises ValueError when some op can never run (the orders deadlock).
    """
    _check_ops(ops_per_stage)
    stages = len(ops_per_stage)
    if len(forward_s) != stages or len(backward_s) != stages:
        raise ValueError(f"need one forward and one backward time per stage ({stages}), got "
                         f"{len(forward_s)} and {len(backward_s)}")
    times = [*forward_s, *backward_s, comm_s]
    if not all(math.isfinite(t) and t >= 0 for t in times):
        raise ValueError(f"times must be finite and >= 0, got forward_s={list(forward_s)} "
                         f"backward_s={list(backward_s)} comm_s={comm_s}")

    finished: dict[tuple[int, Op], float] = {}
    free_at = [0.0] * stages
    next_op = [0] * stages
    progress = True
    while progress:
        progress = False
        for s, ops in enumerate(ops_per_stage):
            while next_op[s] < len(ops):
                op = ops[next_op[s]]
                ready = _ready_at(op, s, stages, finished, comm_s)
                if ready is None:
                    break
                duration = forward_s[s] if op.kind == FORWARD else backward_s[s]
                finished[s, op] = free_at[s] = max(free_at[s], ready) + duration
                next_op[s] += 1
                progress = True
    stuck = [f"stage {s} at {ops[next_op[s]]}"
             for s, ops in enumerate(ops_per_stage) if next_op[s] < len(ops)]
    if stuck:
        raise ValueError(f"the op orders deadlock: {', '.join(stuck)} can never run")

    makespan = max(free_at)
    busy = [
        len(ops) / 2 * (forward_s[s] + backward_s[s]) / makespan if makespan > 0 else 0.0
        for s, ops in enumerate(ops_per_stage)
    ]
    return makespan, busy


def _ready_at(
    op: Op, stage: int, stages: int, finished: dict[tuple[int, Op], float], comm_s: float
) -> float | None:
    """When ``op``'s input is available on ``stage``, or None if its producer has not run yet."""
    if op.kind == FORWARD:
        if stage == 0:
            return 0.0
        upstream = finished.get((stage - 1, op))
        return None if upstream is None else upstream + comm_s
    if stage == stages - 1:
        return finished.get((stage, Op(FORWARD, op.microbatch)))
    downstream = finished.get((stage + 1, op))
    return None if downstream is None else downstream + comm_s


def split_rows(total: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ``[begin, end)`` row ranges tiling ``0..total`` in proportion to ``weights``.

    Rounding is by largest remainder (ties to the earlier member). When ``total`` is at least the
    number of members with weight > 0, each of them gets at least one row, taken from the member
    holding the most rows above its exact share among those with two or more; so a heavier member
    never gets fewer rows than a lighter one. Zero-weight members get an empty range.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if not weights:
        raise ValueError("need at least one weight")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    if not any(w > 0 for w in weights):
        raise ValueError(f"at least one weight must be > 0, got {list(weights)}")

    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact)
    quotas = [total * w / weight_sum for w in exact]
    rows = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(rows)), key=lambda i: (-(quotas[i] - rows[i]), i))
    for i in by_remainder[: total - sum(rows)]:
        rows[i] += 1

    positive = [i for i, w in enumerate(exact) if w > 0]
    if total >= len(positive):
        for i in positive:
            if rows[i] == 0:
                donor = max((j for j in range(len(rows)) if rows[j] >= 2),
                            key=lambda j: (rows[j] - quotas[j], -j))
                rows[donor] -= 1
                rows[i] = 1

    ranges = []
    begin = 0
    for n in rows:
        ranges.append((begin, begin + n))
        begin += n
    return ranges


def _check_tiling(ranges: Sequence[tuple[int, int]], what: str) -> None:
    """Raise ValueError unless ``ranges`` are non-empty, in order and contiguous."""
    if not ranges:
        raise ValueError(f"{what} need at least one range")
    for (_, e0), (b1, _) in zip(ranges, ranges[1:]):
        if e0 != b1:
            raise ValueError(f"{what} ranges must be contiguous, got {list(ranges)}")
    if any(b > e for b, e in ranges):
        raise ValueError(f"{what} ranges must have begin <= end, got {list(ranges)}")


def overlaps(
    senders: Sequence[tuple[int, int]], receivers: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """The transfers from one stage group to the next: ``(sender, receiver, begin, end)``.

    ``senders`` and ``receivers`` are the members' row ranges, each tiling the same micro-batch;
    every non-empty intersection of a sender's and a receiver's range is one transfer of rows
    ``[begin, end)``, listed in order of ``begin``.
    """
    _check_tiling(senders, "senders")
    _check_tiling(receivers, "receivers")
    if (senders[0][0], senders[-1][1]) != (receivers[0][0], receivers[-1][1]):
        raise ValueError(f"senders {list(senders)} and receivers {list(receivers)} "
                         "must tile the same rows")
    transfers = [
        (i, j, max(sb, rb), min(se, re))
        for i, (sb, se) in enumerate(senders)
        for j, (rb, re) in enumerate(receivers)
        if max(sb, rb) < min(se, re)
    ]
    return sorted(transfers, key=lambda t: t[2])


def routes(senders: Sequence[tuple[int, int]], sender_channels: bool,
           receivers: Sequence[tuple[int, int]], receiver_channels: bool) -> list[tuple[int, int, int, int]]:
    """``overlaps`` between two stages' groups of which either may be a channel group (its members
    each hold every row: ``*_channels``): a channel group sends from its leader (member 0) alone,
    and every member of a receiving channel group gets every row."""
    send = senders[:1] if sender_channels else senders
    if not receiver_channels:
        return overlaps(send, receivers)
    whole = [(send[0][0], send[-1][1])]
    return sorted(((i, j, b, e) for i, _, b, e in overlaps(send, whole) for j in range(len(receivers))),
                  key=lambda t: (t[2], t[1]))


def channel_bounds(channels: int, share: tuple[float, float]) -> tuple[int, int]:
    """The [begin, end) output channels of a member with share ``(lo, hi)`` of a layer of
    ``channels``; the members' bounds tile [0, channels) when their shares tile [0, 1)."""
    lo, hi = share
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"a channel share must satisfy 0 <= lo <= hi <= 1, got {share}")
    return round(lo * channels), round(hi * channels)


SHARE_STEPS = 64
"""Channel shares are multiples of 1/64: speed estimates that drift a little do not move them
(each share change means new slices, upload formats and error-feedback residuals)."""


def channel_shares(weights: Sequence[float]) -> list[tuple[float, float]]:
    """Shares ``(lo, hi)`` tiling [0, 1) in proportion to ``weights`` (the members' speeds),
    rounded to multiples of 1/SHARE_STEPS, each at least one step."""
    if not weights or any(not w > 0 for w in weights) or len(weights) > SHARE_STEPS:
        raise ValueError(f"channel shares need 1 to {SHARE_STEPS} positive weights, got {list(weights)}")
    total, bounds, at = sum(weights), [0], 0.0
    for k, w in enumerate(weights[:-1]):
        at += w / total
        room = SHARE_STEPS - (len(weights) - 1 - k)  # leave a step for each member after this one
        bounds.append(min(max(round(at * SHARE_STEPS), bounds[-1] + 1), room))
    bounds.append(SHARE_STEPS)
    return [(lo / SHARE_STEPS, hi / SHARE_STEPS) for lo, hi in zip(bounds, bounds[1:])]


def check_shares(shares: Sequence[tuple[float, float]]) -> None:
    """ValueError unless ``shares`` tile [0, 1) in order, each non-empty (a channel group's)."""
    if not shares or shares[0][0] != 0.0 or shares[-1][1] != 1.0 or any(
            not lo < hi for lo, hi in shares) or any(a[1] != b[0] for a, b in zip(shares, shares[1:])):
        raise ValueError(f"channel shares must tile [0, 1) in order, got {list(shares)}")


def split_microbatches(total: int, microbatches: int) -> list[int]:
    """Sizes of ``microbatches`` micro-batches of ``total`` samples: as equal as possible,
    the first ones one larger. Every micro-batch gets at least one sample."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if microbatches > total:
        raise ValueError(f"cannot cut {total} samples into {microbatches} micro-batches "
                         "of at least one sample")
    base, extra = divmod(total, microbatches)
    return [base + (1 if m < extra else 0) for m in range(microbatches)]


def stage_blocks(block_counts: Sequence[int], n_blocks: int) -> list[tuple[int, int]]:
    """``[begin, end)`` block ranges of consecutive stages holding ``block_counts`` blocks each."""
    if not block_counts:
        raise ValueError("need at least one stage")
    if any(c < 1 for c in block_counts):
        raise ValueError(f"every stage needs >= 1 block, got {list(block_counts)}")
    if sum(block_counts) != n_blocks:
        raise ValueError(f"block counts {list(block_counts)} sum to {sum(block_counts)}, "
                         f"but the model has {n_blocks} blocks")
    ranges = []
    begin = 0
    for count in block_counts:
        ranges.append((begin, begin + count))
        begin += count
    return ranges


def stage_parameter_prefixes(block_names: Sequence[str], begin: int, end: int) -> tuple[str, ...]:
    """Name prefixes of the parameters and buffers of blocks ``[begin, end)`` of a BlockModel.

    ``block_names`` are ``BlockModel.block_names``; as in ``BlockModel``, a ``.`` in a block
    name becomes ``_`` (block ``layer1.0`` owns ``blocks.layer1_0.*``). The trailing ``.`` keeps
    ``blocks.features_1.`` from matching ``blocks.features_10.*``.
    """
    if not 0 <= begin < end <= len(block_names):
        raise ValueError(f"need 0 <= begin < end <= {len(block_names)}, "
                         f"got begin={begin} end={end}")
    return tuple(f"blocks.{name.replace('.', '_')}." for name in block_names[begin:end])


def run_blocks(blocks: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Run ``x`` through ``blocks`` in order: a stage's forward when it holds only its blocks.

    ``BlockModel.run_blocks(x, start, stop)`` does the same on a whole model.
    """
    for block in blocks:
        x = block(x)
    return x
