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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

import torch

from coordinator.registry import DeviceRecord
from edgetrain.models import block_costs, build_model
from edgetrain.plan import BlockCost, BoardCost, ModelCost
from edgetrain.split import SpeedEstimate, fit_speed

UNKNOWN_LINK_MBIT = 10.0
"""Link rate assumed for a board whose link was never measured (pessimistic on purpose)."""
UNKNOWN_MEMORY_BYTES = 2 * 1024**3
"""Memory assumed for a board that reported none."""
MIN_OBSERVED_BYTES = 4 * 1024**2
"""Parameter and gradient bytes a board must have moved before its observed transfer rate counts."""

_model_costs: dict[tuple[str, int], ModelCost] = {}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Measure as one core does: torch on a single thread for the block, then as before."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def block_seconds(model: torch.nn.Module, batch: int, repeats: int = 2) -> list[float]:
    """Seconds of forward + backward of each block on a random batch (best of `repeats`)."""
    model.train()
    x = torch.randn(batch, 3, 32, 32)
    inputs = []
    with torch.no_grad():
        for block in model.block_modules():
            inputs.append(x)
            x = block(x)
    best = [float("inf")] * len(inputs)
    for _ in range(repeats):
        for b, (block, inp) in enumerate(zip(model.block_modules(), inputs, strict=True)):
            inp = inp.clone().requires_grad_()
            started = time.perf_counter()
            out = block(inp)
            out.backward(torch.ones_like(out))
            best[b] = min(best[b], time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    return best


def measure_model_cost(model_name: str, batch: int = 16, *, num_classes: int = 10) -> ModelCost:
    """The model's blocks as the planner sees them (cached per model and batch in this process)."""
    key = (model_name, batch)
    if key not in _model_costs:
        model = build_model(model_name, num_classes=num_classes, seed=0)
        counted = block_costs(model, 1)
        seconds = block_seconds(model, batch)
        flops = sum(3 * b.forward_flops for b in counted)
        total_s = sum(seconds)
        _model_costs[key] = ModelCost(tuple(
            BlockCost(name=b.name, param_bytes=b.param_bytes, activation_bytes=b.output_bytes,
                      forward_flops=flops * s / total_s / 3)
            for b, s in zip(counted, seconds, strict=True)))
    return _model_costs[key]


def train_flops_per_sample(model: ModelCost) -> float:
    return sum(b.train_flops for b in model.blocks)


def board_from_record(record: DeviceRecord, model: ModelCost) -> BoardCost:
    """A live board: the registry's speed estimate and the newest telemetry."""
    if record.speed is None:
        raise ValueError(f"{record.device_id} has no speed estimate yet (not profiled)")
    t = record.latest_telemetry
    memory = record.profile.memory_available_bytes if record.profile else 0
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
    return BoardCost(
        name=record.name, flops_per_s=record.speed.samples_per_s * train_flops_per_sample(model),
        memory_bytes=float(memory or UNKNOWN_MEMORY_BYTES), mbit_per_s=mbit,
        rtt_s=(t.rtt_ms or 0.0) / 1000 if t else 0.0, idle_w=idle_w, busy_w=max(busy_w, idle_w),
        battery_percent=t.battery_percent if t else None, plugged=plugged,
        overhead_s=record.speed.overhead_s)


def one_core_speed(model_name: str, batches: tuple[int, int] = (4, 32)) -> SpeedEstimate:
    """Training speed of the model on one core of this machine: samples/s and the fixed cost
    per forward+backward call (fitted over two batch sizes), for a fleet file's speeds."""
    with _one_thread():
        model = build_model(model_name, seed=0)
        model.train()
        timings = []
        for batch in batches:
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
            best = float("inf")
            for _ in range(2):
                started = time.perf_counter()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                best = min(best, time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
            timings.append((batch, best))
        return fit_speed(timings)


def transfer_cpu_s_per_byte(nbytes: int = 16 * 1024**2) -> float:
    """CPU seconds one core of this machine spends per byte a board moves: packing, chunking
    with checksums, and unpacking (what a transfer costs besides the link)."""
    from edgetrain.streaming import ChunkAssembler, iter_chunks
    from edgetrain.tensors import pack, unpack

    with _one_thread():
        tensors = {"x": torch.randn(nbytes // 4)}
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            metas, payload = pack(tensors)
            assembler = ChunkAssembler(len(payload))
            for chunk in iter_chunks(payload):
                assembler.add(chunk.offset, chunk.data, chunk.crc32)
            unpack(metas, assembler.payload())
            best = min(best, time.perf_counter() - started)
        return best / nbytes


def boards_from_fleet(boards: list, model: ModelCost, one_core: SpeedEstimate,
                      memory_bytes: Mapping[str, float] | None = None,
                      cpu_s_per_byte: float = 0.0) -> list[BoardCost]:
    """BoardCosts of a fleet file's boards (edgetrain.emulator.fleet_config.BoardSpec); a board with
    `speed` s of a core computes s x as fast as one core here, its per-call overhead 1/s as long,
    and its link rate is what remains after its CPU's cost per byte (`cpu_s_per_byte` at one core)."""
    flops = train_flops_per_sample(model) * one_core.samples_per_s
    out = []
    for b in boards:
        battery = b.battery
        idle = b.idle_w if b.idle_w is not None else (battery.idle_w if battery else 0.0)
        busy = b.busy_w if b.busy_w is not None else (battery.busy_w if battery else idle)
        out.append(BoardCost(
            name=b.name, flops_per_s=b.speed * flops,
            memory_bytes=float((memory_bytes or {}).get(b.name, UNKNOWN_MEMORY_BYTES)),
            mbit_per_s=8e-6 / (8e-6 / (b.link.mbit_per_s if b.link else 1000.0) + cpu_s_per_byte / b.speed),
            rtt_s=2 * b.link.delay_ms / 1000 if b.link else 0.0,
            idle_w=idle, busy_w=max(busy, idle),
            battery_percent=battery.initial_percent if battery else None,
            plugged=battery.plugged if battery else True, overhead_s=one_core.overhead_s / b.speed))
    return out
