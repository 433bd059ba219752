"""What the planner is given: the model's per-block costs, and each board as a `BoardCost`.

Model. Per block: parameter bytes, output activation bytes per sample (the tensor a stage cut
there sends), and its share of a training step's time, measured here by timing each block's
forward and backward pass on a real batch. The planner works in FLOPs, so each block's
"effective FLOPs" are the model's counted FLOPs (torch's FlopCounterMode) split in proportion
to the measured time — a depthwise convolution costs more per FLOP than a dense one, and the
split follows what the CPU actually spends. The per-block time split is assumed to hold on
every board (boards differ by a speed factor), which is what one board type's profile gives.

Boards. Live boards come from the registry: effective FLOP/s = measured samples/s (the join
profile, refined by observed steps) x the model's training FLOPs per sample, the profile's fixed
per-call overhead, available memory, and the link rate, round-trip time, battery, plug and power
model from the newest telemetry. Once a board has moved some parameters and gradients, its link
rate is the lower of the measured one and what its transfers actually achieved (bytes over
transfer seconds, averaged over the run): a board with a small CPU spends CPU time on every
byte (serialising, checksums), which the link measurement does not see. A fleet file's boards (`edgetrain plan`) get the same from
their YAML: speed (fraction of one core of this machine, whose samples/s is measured),
link rate and delay, battery and power figures.

What is measured on this machine (the model's block times, one core's speed, the CPU cost of a
byte) is kept in the measurement cache (coordinator.planning.cache) with what it was measured
on; torch is imported (coordinator.planning.measure) only to measure what the cache lacks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from coordinator.planning import cache
from coordinator.registry import DeviceRecord
from edgetrain.plan import BlockCost, BoardCost, ModelCost
from edgetrain.power import board_power
from edgetrain.split import SpeedEstimate

UNKNOWN_LINK_MBIT = 10.0
"""Link rate assumed for a board whose link was never measured (pessimistic on purpose)."""
UNKNOWN_MEMORY_BYTES = 2 * 1024**3
"""Memory assumed for a board that reported none."""
MIN_OBSERVED_BYTES = 4 * 1024**2
"""Parameter and gradient bytes a board must have moved before its observed transfer rate counts."""
MODEL_COST_BATCH = 16
"""Batch a model's blocks are timed on."""
ONE_CORE_BATCHES = (4, 32)
"""Batches one core's training speed is fitted over (samples/s and a fixed cost per call)."""
TRANSFER_BYTES = 16 * 1024**2
"""Bytes packed, chunked and unpacked to price the CPU cost of a transfer."""

T = TypeVar("T")


@dataclass(frozen=True)
class MachineCosts:
    """What this machine measured for planning one model, and which figures the cache supplied."""

    model: ModelCost
    """The model's per-block costs."""
    one_core: SpeedEstimate
    """Training speed of the model on one core of this machine."""
    cpu_s_per_byte: float
    """CPU seconds one core spends per byte moved."""
    from_cache: dict[str, bool]
    """Per figure (model_cost, one_core_speed, transfer_cpu_s_per_byte): read from the cache."""


def machine_costs(model_name: str, *, remeasure: bool = False) -> MachineCosts:
    """This machine's figures for `model_name` (what `edgetrain plan` needs): from the measurement
    cache when it holds them for exactly this machine, else measured (with torch) and kept."""
    model, model_cached = _model_cost(model_name, MODEL_COST_BATCH, 10, remeasure=remeasure)
    one_core, core_cached = _one_core(model_name, ONE_CORE_BATCHES, remeasure=remeasure)
    per_byte, byte_cached = _transfer(TRANSFER_BYTES, remeasure=remeasure)
    return MachineCosts(model=model, one_core=one_core, cpu_s_per_byte=per_byte, from_cache={
        "model_cost": model_cached, "one_core_speed": core_cached, "transfer_cpu_s_per_byte": byte_cached})


def measure_model_cost(model_name: str, batch: int = MODEL_COST_BATCH, *, num_classes: int = 10) -> ModelCost:
    """The model's blocks as the planner sees them, timed with this process's torch threads
    (measured once per machine: see coordinator.planning.cache)."""
    return _model_cost(model_name, batch, num_classes, remeasure=False)[0]


def one_core_speed(model_name: str, batches: tuple[int, int] = ONE_CORE_BATCHES) -> SpeedEstimate:
    """Training speed of the model on one core of this machine: samples/s and the fixed cost
    per forward+backward call (fitted over two batch sizes), for a fleet file's speeds."""
    return _one_core(model_name, batches, remeasure=False)[0]


def transfer_cpu_s_per_byte(nbytes: int = TRANSFER_BYTES) -> float:
    """CPU seconds one core of this machine spends per byte a board moves: packing, chunking
    with checksums, and unpacking (what a transfer costs besides the link)."""
    return _transfer(nbytes, remeasure=False)[0]


def _model_cost(model_name: str, batch: int, num_classes: int, *, remeasure: bool) -> tuple[ModelCost, bool]:
    threads = cache.torch_threads()
    what = {"measurement": "model_cost", "model": model_name, "batch": batch, "num_classes": num_classes}
    return _kept(cache.measured_on(what, threads),
                 lambda: _measuring().model_cost(model_name, batch, num_classes, threads),
                 _model_to_json, _model_from_json, remeasure=remeasure)


def _one_core(model_name: str, batches: tuple[int, int], *, remeasure: bool) -> tuple[SpeedEstimate, bool]:
    what = {"measurement": "one_core_speed", "model": model_name, "batches": list(batches)}
    return _kept(cache.measured_on(what, threads=1), lambda: _measuring().one_core_speed(model_name, batches),
                 _speed_to_json, _speed_from_json, remeasure=remeasure)


def _transfer(nbytes: int, *, remeasure: bool) -> tuple[float, bool]:
    what = {"measurement": "transfer_cpu_s_per_byte", "bytes": nbytes}
    return _kept(cache.measured_on(what, threads=1), lambda: _measuring().transfer_cpu_s_per_byte(nbytes),
                 float, _nonnegative, remeasure=remeasure)


def _measuring() -> ModuleType:
    """The torch side, imported only when something must be measured."""
    from coordinator.planning import measure

    return measure


def _kept(key: dict[str, Any], measure: Callable[[], T], encode: Callable[[T], Any],
          decode: Callable[[Any], T], *, remeasure: bool) -> tuple[T, bool]:
    """The value kept for `key`, or a new measurement (then kept); and whether it was kept."""
    if not remeasure:
        value = cache.find(key, decode)
        if value is not None:
            return value, True
    value = measure()
    cache.keep(key, encode(value))
    return value, False


def _nonnegative(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a finite number >= 0, got {value!r}")
    return float(value)


def _model_to_json(model: ModelCost) -> list[dict[str, Any]]:
    return [dataclasses.asdict(b) for b in model.blocks]


def _model_from_json(blocks: list[dict[str, Any]]) -> ModelCost:
    return ModelCost(tuple(BlockCost(**b) for b in blocks))


def _speed_to_json(speed: SpeedEstimate) -> dict[str, float]:
    return {"samples_per_s": speed.samples_per_s, "overhead_s": speed.overhead_s}


def _speed_from_json(data: Mapping[str, Any]) -> SpeedEstimate:
    samples_per_s = _nonnegative(data["samples_per_s"])
    if samples_per_s == 0:
        raise ValueError("samples_per_s must be > 0")
    return SpeedEstimate(overhead_s=_nonnegative(data["overhead_s"]), samples_per_s=samples_per_s)


def train_flops_per_sample(model: ModelCost) -> float:
    return sum(b.train_flops for b in model.blocks)


def board_from_record(record: DeviceRecord, model: ModelCost) -> BoardCost:
    """A live board: the registry's speed estimate and the newest telemetry."""
    if record.speed is None:
        raise ValueError(f"{record.device_id} has no speed estimate yet (not profiled)")
    t = record.latest_telemetry
    profile = record.profile
    memory = (profile.device_memory_bytes or profile.memory_available_bytes) if profile else 0
    if record.memory_cap_bytes is not None:  # its device ran out at a placement that needed more
        memory = min(memory or record.memory_cap_bytes, record.memory_cap_bytes)
    idle_w = t.idle_w if t and t.idle_w is not None else 0.0
    busy_w = t.busy_w if t and t.busy_w is not None else idle_w
    plugged = t.plugged if t else None
    if t is not None and t.battery_percent is None and plugged is None:
        plugged = True  # no battery: mains powered
    mbit = float(t.link_mbit_per_s) if t and t.link_mbit_per_s else UNKNOWN_LINK_MBIT
    moved = record.stats["download_bytes"] + record.stats["upload_bytes"]
    if moved >= MIN_OBSERVED_BYTES and record.stats["comm_s"] > 0:
        # what its transfers really took: a slow board also spends CPU on every byte it moves
        mbit = min(mbit, moved * 8 / record.stats["comm_s"] / 1e6)
    if profile and profile.copy_s_per_byte:  # a GPU board moves every byte to its device and back too
        mbit = 8e-6 / (8e-6 / mbit + profile.copy_s_per_byte)
    return BoardCost(
        name=record.name, flops_per_s=record.speed.samples_per_s * train_flops_per_sample(model),
        memory_bytes=float(memory or UNKNOWN_MEMORY_BYTES), mbit_per_s=mbit,
        rtt_s=(t.rtt_ms or 0.0) / 1000 if t else 0.0, idle_w=idle_w, busy_w=max(busy_w, idle_w),
        battery_percent=t.battery_percent if t else None, plugged=plugged,
        overhead_s=record.speed.overhead_s, own_data=bool(profile and profile.local_samples),
        device=profile.device if profile else "cpu")


def boards_from_fleet(boards: list, model: ModelCost, one_core: SpeedEstimate,
                      memory_bytes: Mapping[str, float] | None = None,
                      cpu_s_per_byte: float = 0.0) -> list[BoardCost]:
    """BoardCosts of a fleet file's boards (edgetrain.fleet_file.BoardSpec); a board with
    `speed` s of a core computes s x as fast as one core here, its per-call overhead 1/s as long,
    and its link rate is what remains after its CPU's cost per byte (`cpu_s_per_byte` at one core).
    Its memory: `memory_bytes` for it, else its `memory_mb` cap (all of it: a live board reports
    what its process leaves), else unknown."""
    flops = train_flops_per_sample(model) * one_core.samples_per_s
    out = []
    for b in boards:
        battery = b.battery
        power = board_power(b)  # what the emulated board reports its energy with: a default by speed
        idle, busy = power.idle_w, power.busy_w
        out.append(BoardCost(
            name=b.name, flops_per_s=b.speed * flops,
            memory_bytes=float((memory_bytes or {}).get(b.name) or (b.memory_mb * 2**20 if b.memory_mb else
                                                                  UNKNOWN_MEMORY_BYTES)),
            mbit_per_s=8e-6 / (8e-6 / (b.link.mbit_per_s if b.link else 1000.0) + cpu_s_per_byte / b.speed),
            rtt_s=2 * b.link.delay_ms / 1000 if b.link else 0.0,
            idle_w=idle, busy_w=max(busy, idle),
            battery_percent=battery.initial_percent if battery else None,
            plugged=battery.plugged if battery else True, overhead_s=one_core.overhead_s / b.speed,
            own_data=bool(getattr(b, "local_data", None))))
    return out
