"""The plan and the cost model's data: the one plan form of the planner, coordinator and boards.

What the planner reads: a model as a ``ModelCost`` (its ``BlockCost``s in order) and each board
as a ``BoardCost``. What it returns: a ``Plan``, a pipeline of ``StagePlan``s (consecutive blocks,
each stage hosted by a group of boards that split every micro-batch by rows in proportion to
their speed) run with M micro-batches under a schedule, next to it data-parallel (DP) shards
holding the whole model and taking a share of the global batch; a plan without stages is pure
data parallelism. The planner fills in the plan's ``Prediction``. ``plan_to_dict`` and
``plan_from_dict`` convert a plan to and from plain data in the shape of a job's ``pipeline``
section, for plan files and metrics.

Plain data only: no torch, sockets or clocks (the planner in ``coordinator.planning`` is built on
it, and a board may read it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
"""Pipeline schedules, as ``edgetrain.pipeline`` runs them."""
PLAN_KEYS: tuple[str, ...] = ("stages", "microbatches", "schedule", "dp_boards", "dp_share")
"""The keys of a plan's plain-data form (those of a job's ``pipeline`` section that make a plan)."""
DEFAULT_MICROBATCHES = 4
"""Micro-batches of a plan whose plain data has stages but no ``microbatches`` (as in a job's
``pipeline`` section)."""


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
    channel_layers: int = 0
    """Layers a channel group splits (``edgetrain.channels``); the rest of the block is replicated."""
    channel_flops: float = 0.0
    """Forward FLOPs per sample of those layers (part of ``forward_flops``)."""
    channel_param_bytes: float = 0.0
    """Bytes of their parameters (part of ``param_bytes``): a member moves its share of them."""
    channel_output_bytes: float = 0.0
    """Bytes per sample of their outputs: what a channel group gathers in the forward pass."""
    channel_input_bytes: float = 0.0
    """Bytes per sample of their inputs: what a channel group sums in the backward pass."""

    def __post_init__(self) -> None:
        for key in ("param_bytes", "activation_bytes", "forward_flops", "channel_layers", "channel_flops",
                    "channel_param_bytes", "channel_output_bytes", "channel_input_bytes"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value >= 0, f"{self.name}: {key} must be >= 0, got {value}")
        back = self.backward_flops
        _check(back is None or (math.isfinite(back) and back >= 0),
               f"{self.name}: backward_flops must be >= 0, got {back}")
        _check(self.channel_flops <= self.forward_flops * (1 + 1e-9)
               and self.channel_param_bytes <= self.param_bytes * (1 + 1e-9),
               f"{self.name}: the split layers' FLOPs and parameters are part of the block's")

    @property
    def channel_train_flops(self) -> float:
        """Forward plus backward FLOPs per sample of the layers a channel group splits."""
        return self.channel_flops * self.train_flops / self.forward_flops if self.forward_flops else 0.0

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
                      activation_bytes=b.output_bytes / b.output_shape[0],
                      channel_layers=getattr(b, "channel_layers", 0),
                      channel_flops=getattr(b, "channel_flops", 0) / b.output_shape[0],
                      channel_param_bytes=getattr(b, "channel_param_bytes", 0),
                      channel_output_bytes=getattr(b, "channel_output_bytes", 0) / b.output_shape[0],
                      channel_input_bytes=getattr(b, "channel_input_bytes", 0) / b.output_shape[0])
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
    own_data: bool = False
    """It trains only on its own samples (edgetrain client --local-data): a data-parallel shard,
    never a stage host (a pipeline's first stage needs every sample it trains on)."""
    device: str = "cpu"
    """Where it trains (a label: its speed, memory and link already say what the device does)."""

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
    """What a plan is predicted to do per step (the formulas: ``coordinator.planning.cost``)."""

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
    local_samples_per_s: dict[str, float] = field(default_factory=dict)
    """Boards training beside the step (``Plan.local_boards``): samples per second their local
    updates add, each weighted by the staleness factor it is predicted to be applied with."""


NO_GAIN = "no gain"
"""Why a plan leaves a board out of its steps when nothing else keeps it out."""

SPLITS: tuple[str, ...] = ("rows", "channels")
"""How a stage's group divides its work: each host a share of every micro-batch's samples
(``rows``), or each a share of every split layer's output channels, on all samples
(``channels``, ``edgetrain.channels``)."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: blocks [begin, end) hosted by ``boards``, which divide it by ``split``."""

    begin: int
    end: int
    boards: tuple[str, ...]
    split: str = "rows"

    def __post_init__(self) -> None:
        _check(self.split in SPLITS, f"a stage's split must be one of {SPLITS}, got {self.split!r}")
        _check(self.split == "rows" or len(self.boards) >= 2, "a channel group needs at least two boards")

    @property
    def channels(self) -> bool:
        """Whether the stage is a channel group."""
        return self.split == "channels"

@dataclass(frozen=True)
class Plan:
    """A placement: pipeline stages, micro-batches and their schedule, DP shards with their share,
    boards left out.

    No stages means pure data parallelism (``dp_share`` 1) over ``dp_boards``, or over every
    available board when ``dp_boards`` is empty.
    """

    stages: tuple[StagePlan, ...] = ()
    microbatches: int = 1
    schedule: str = "1f1b"
    """Pipeline schedule, "gpipe" or "1f1b"; the planner makes 1f1b plans (its memory terms assume
    1f1b's in-flight rows)."""
    dp_boards: tuple[str, ...] = ()
    dp_share: float = 0.0
    """Fraction of the global batch the DP shards take, water-filled among them."""
    left_out: tuple[tuple[str, str], ...] = ()
    """(board, why) for fleet boards that get no work."""
    local_boards: tuple[str, ...] = ()
    """Boards that train beside the steps instead of in them: each takes the parameters, trains
    for a time budget at its own speed and sends its change, which is applied under the staleness
    rule when it arrives (coordinator.planning.local_members). No step waits for them."""
    prediction: Prediction | None = field(default=None, compare=False)
    """Filled by the planner."""

    def __post_init__(self) -> None:
        _check(self.microbatches >= 1, f"microbatches must be >= 1, got {self.microbatches}")
        _check(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.stages:
            _check(0 <= self.dp_share < 1, f"dp_share must be in [0, 1) with stages, got {self.dp_share}")
            _check(bool(self.dp_boards) == (self.dp_share > 0), "dp_share > 0 exactly with dp_boards")
        else:
            _check(self.dp_share == 1, f"pure DP (no stages) needs dp_share 1, got {self.dp_share}")
        working = {b for s in self.stages for b in s.boards} | set(self.dp_boards)
        _check(not working & set(self.local_boards),
               f"a board trains either in the steps or beside them, got {sorted(working & set(self.local_boards))}")

    @property
    def kind(self) -> str:
        """``"dp"``, ``"pipeline"`` or ``"hybrid"`` (pipeline and DP shards)."""
        return "dp" if not self.stages else "hybrid" if self.dp_boards else "pipeline"

    def to_pipeline_section(self) -> dict:
        """The job's ``pipeline`` section (``PipelineConfig``); pure DP gives an empty pipeline,
        i.e. the trainer's data-parallel mode with its own proportional split."""
        section = plan_to_dict(self)
        if not self.stages:
            section.update(microbatches=1, dp_boards=[], dp_share=0.0)
        return section

    def describe(self) -> str:
        """One line: stages (blocks and boards), micro-batches, schedule, DP shards."""
        if not self.stages:
            return "data parallelism over " + ("+".join(self.dp_boards) or "every available board") + self._beside()
        stages = "; ".join(f"blocks {s.begin}-{s.end - 1} on {'+'.join(s.boards)}"
                           + (" (channels)" if s.channels else "") for s in self.stages)
        shards = f"; DP shards {'+'.join(self.dp_boards)} ({self.dp_share:.0%})" if self.dp_boards else ""
        return f"{stages}; {self.microbatches} micro-batches, {self.schedule}{shards}{self._beside()}"

    def _beside(self) -> str:
        return f"; local updates from {'+'.join(self.local_boards)}" if self.local_boards else ""

    def explain(self, devices: Mapping[str, str] | None = None) -> str:
        """A table: board -> role, blocks, batch share, predicted time, memory (and its device, when
        `devices` names them); then the totals."""
        p = self.prediction
        _check(p is not None, "explain needs a plan with a prediction (from the planner)")
        single = len(self.stages) == 1 and len(self.stages[0].boards) == 1 and not self.dp_boards
        every = not self.stages and not self.dp_boards
        head = {"dp": "pure data parallelism" + (" over every available board" if every else ""),
                "pipeline": "the whole model on one board" if single else f"{len(self.stages)} stages",
                "hybrid": f"{len(self.stages)} stages + DP shards taking {self.dp_share:.1%}"}[self.kind]
        if self.stages and not single:
            head += f", {self.microbatches} micro-batches ({self.schedule})"
        rows = [("board", "role", "blocks", "share", "time_s", "memory_MB")]
        for s, stage in enumerate(self.stages):
            role = f"stage {s}" + (" (channels)" if stage.channels else "")
            rows += [(b, role, f"{stage.begin}-{stage.end - 1}", f"{p.share[b]:.1%}",
                      f"{p.time_s[b]:.3f}", f"{p.memory_bytes[b] / 1e6:.1f}") for b in stage.boards]
        rows += [(b, "dp", "all", f"{p.share[b]:.1%}", f"{p.time_s[b]:.3f}", f"{p.memory_bytes[b] / 1e6:.1f}")
                 for b in (tuple(p.share) if every else self.dp_boards)]
        rows += [(b, "local", "all", f"+{p.local_samples_per_s.get(b, 0.0):.1f}/s", "-",
                  f"{p.memory_bytes.get(b, 0.0) / 1e6:.1f}") for b in self.local_boards]
        rows += [(b, "left out", "-", "-", "-", why) for b, why in self.left_out]
        if devices:
            rows = [rows[0] + ("device",)] + [r + (devices.get(r[0], "?"),) for r in rows[1:]]
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [f"plan: {head}"] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"predicted: step {p.step_s:.3f} s, {p.samples_per_s:.1f} samples/s, "
                     f"{p.energy_per_sample_j:.3f} J/sample")
        if p.local_samples_per_s:
            lines[-1] += (f"; local updates add {sum(p.local_samples_per_s.values()):.1f} samples/s "
                          "(weighted by their staleness)")
        return "\n".join(lines)


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data in the shape of a job's ``pipeline`` section: ``stages`` as
    ``{blocks, boards}`` first stage first (with ``split: channels`` for a channel group),
    ``microbatches``, ``schedule``, ``dp_boards``, ``dp_share``. Boards left out and the
    prediction are not part of it."""
    ends = [0] + [s.end for s in plan.stages]
    _check(all(s.begin == e for s, e in zip(plan.stages, ends)),
           f"stages must be consecutive from block 0 to have a plain-data form, got "
           f"{[(s.begin, s.end) for s in plan.stages]}")
    return {"stages": [{"blocks": s.end - s.begin, "boards": list(s.boards)} | ({"split": s.split} if s.channels else {})
                       for s in plan.stages],
            "microbatches": plan.microbatches, "schedule": plan.schedule,
            "dp_boards": list(plan.dp_boards), "dp_share": plan.dp_share}


def plan_from_dict(data: Mapping[str, Any], *, where: str) -> Plan:
    """The plan ``data`` describes (``plan_to_dict``'s form, e.g. a plan file): stage block counts
    become consecutive [begin, end) ranges from block 0. Keys left out mean what they mean in a
    job's ``pipeline`` section: no stages, DEFAULT_MICROBATCHES micro-batches, 1f1b, no DP shards;
    without stages ``dp_share`` is 1 (pure DP, over every available board when ``dp_boards`` is
    empty). Raises ValueError naming ``where`` (a file, a section), the key and the bad value."""
    def need(ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            raise ValueError(f"{where}: {key}={value!r}: {why}")

    need(isinstance(data, Mapping), "plan", data, f"must be a mapping of {', '.join(PLAN_KEYS)}")
    for key, value in data.items():
        need(key in PLAN_KEYS, key, value, f"unknown key (known: {', '.join(PLAN_KEYS)})")
    stages = _stages_from_list(data.get("stages") or [], need)
    microbatches = data.get("microbatches", DEFAULT_MICROBATCHES if stages else 1)
    need(_is_int(microbatches) and microbatches >= 1, "microbatches", microbatches, "must be an integer >= 1")
    schedule = data.get("schedule", "1f1b")
    need(schedule in SCHEDULES, "schedule", schedule, f"must be one of {', '.join(SCHEDULES)}")
    dp_boards = data.get("dp_boards") or []
    need(_is_names(dp_boards), "dp_boards", dp_boards, "must be a list of board names")
    hosts = [b for s in stages for b in s.boards]
    for key, names in (("stages", hosts), ("dp_boards", hosts + list(dp_boards))):
        repeated = sorted({b for b in names if names.count(b) > 1})
        need(not repeated, key, repeated, "a board can host only one stage or DP shard")
    dp_share = data.get("dp_share", 0.0 if stages else 1.0)
    need(isinstance(dp_share, (int, float)) and not isinstance(dp_share, bool) and math.isfinite(dp_share),
         "dp_share", dp_share, "must be a number")
    if stages:
        need(0 <= dp_share < 1, "dp_share", dp_share, "must be in [0, 1) with stages")
        need(dp_share == 0 or bool(dp_boards), "dp_share", dp_share, "needs dp_boards to take that share")
        need(dp_share > 0 or not dp_boards, "dp_boards", dp_boards, "need a dp_share > 0 to work on")
    else:
        need(dp_share == 1, "dp_share", dp_share, "must be 1 without stages (pure data parallelism)")
    return Plan(stages=stages, microbatches=microbatches, schedule=schedule, dp_boards=tuple(dp_boards),
                dp_share=float(dp_share))


def _stages_from_list(raw: Any, need: Callable[[bool, str, Any, str], None]) -> tuple[StagePlan, ...]:
    """Stages of ``{blocks, boards[, split]}`` mappings, as consecutive block ranges from block 0."""
    need(isinstance(raw, (list, tuple)), "stages", raw, "must be a list of {blocks, boards} mappings")
    stages, begin = [], 0
    for s, stage in enumerate(raw):
        at = f"stages[{s}]"
        need(isinstance(stage, Mapping), at, stage, "must be a mapping {blocks, boards}")
        for key, value in stage.items():
            need(key in ("blocks", "boards", "split"), f"{at}.{key}", value,
                 "unknown key (known: blocks, boards, split)")
        blocks, boards, split = stage.get("blocks"), stage.get("boards"), stage.get("split", "rows")
        need(_is_int(blocks) and blocks >= 1, f"{at}.blocks", blocks, "must be an integer >= 1")
        need(_is_names(boards) and bool(boards), f"{at}.boards", boards, "must be a non-empty list of board names")
        need(split in SPLITS, f"{at}.split", split, f"must be one of {', '.join(SPLITS)}")
        need(split == "rows" or len(boards) >= 2, f"{at}.split", split, "a channel group needs at least two boards")
        stages.append(StagePlan(begin, begin + blocks, tuple(boards), split))
        begin += blocks
    return tuple(stages)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(b, str) and b for b in value)
