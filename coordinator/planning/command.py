"""`edgetrain plan FLEET.yaml`: the plan the coordinator would choose for a fleet file, explained.

The fleet file's boards become `BoardCost`s (coordinator.planning.inputs: speed x this machine's
measured samples/s on one core, link rate and delay less the CPU cost of moving bytes at that
speed, battery and power figures); the model's
per-block costs are measured here, once: the figures are kept in the measurement cache
(coordinator.planning.cache), so the same fleet and model give the same plan, without torch, the
next time. Printed: the plan table (board -> role, blocks, share,
predicted seconds, memory), its predicted step time, throughput and energy, and beside it the
same fleet's proportional data parallelism and the fleet's ideal throughput (every board
computing all the time, no communication).
"""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.planning.cache import cache_path
from coordinator.planning.cost import predict
from coordinator.planning.inputs import (
    MachineCosts,
    boards_from_fleet,
    machine_costs,
    train_flops_per_sample,
)
from coordinator.planning.local_members import add_local_members
from coordinator.planning.planner import pareto, plan_optimal
from edgetrain.fleet_file import load_fleet
from edgetrain.plan import Plan


def _objective(text: str) -> str | float:
    if text in ("time", "energy", "pareto"):
        return text
    try:
        weight = float(text)
    except ValueError:
        raise ValueError(f"--objective must be time, energy, pareto or a weight in [0, 1], got {text!r}") from None
    if not 0 <= weight <= 1:
        raise ValueError(f"--objective weight must be in [0, 1], got {weight}")
    return weight


PARETO_SHOWN = 8
"""Plans of a Pareto front `edgetrain plan` explains in text (a front can hold hundreds)."""


def spread(n: int, k: int) -> list[int]:
    """At most `k` indices of `range(n)`, evenly spaced, always the first and the last."""
    if n <= k:
        return list(range(n))
    if k <= 1:
        return [0][:k]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _measured(costs: MachineCosts) -> str:
    """Where the figures of this machine came from, for the report's first line."""
    if not any(costs.from_cache.values()):
        return "measured"
    if all(costs.from_cache.values()):
        return f"measured earlier, kept in {cache_path()}"
    return f"measured; some kept earlier in {cache_path()}"


def plan_report(fleet_file: str | Path, *, model: str | None = None, objective: str = "time",
                batch: int | None = None, stage_state: str = "hosts", replicate: bool = True,
                as_json: bool = False, remeasure: bool = False) -> str:
    """The report `edgetrain plan` prints (text, or one JSON object). This machine's figures come
    from the measurement cache when it has them (`remeasure`: measure them again regardless).
    `stage_state` and `replicate` as in the job's pipeline section."""
    fleet = load_fleet(fleet_file)
    model_name = model or fleet.job.model
    batch = batch or fleet.job.training.global_batch
    aim = _objective(objective)
    costs = machine_costs(model_name, remeasure=remeasure)
    cost, one_core, per_byte = costs.model, costs.one_core, costs.cpu_s_per_byte
    boards = boards_from_fleet(list(fleet.boards), cost, one_core, cpu_s_per_byte=per_byte)
    ideal = sum(b.flops_per_s for b in boards) / train_flops_per_sample(cost)
    dp = Plan(dp_boards=tuple(b.name for b in boards), dp_share=1.0)
    kw = dict(stage_state=stage_state, replicate=replicate)
    dp_pred = predict(dp, boards, cost, batch, **kw)
    plans = pareto(boards, cost, batch, **kw) if aim == "pareto" else [plan_optimal(boards, cost, batch, aim, **kw)]
    job = fleet.job
    if job.planner.local_updates:  # boards the plan would not wait for train beside it, as in a run
        plans = [add_local_members(p, boards, cost, global_batch=batch, staleness_bound=job.aggregation.staleness_bound,
                                   staleness_exponent=job.aggregation.staleness_exponent,
                                   local_batch=job.federated.local_batch, stage_state=stage_state) for p in plans]
    if as_json:
        return json.dumps({
            "fleet": fleet.name, "model": model_name, "global_batch": batch, "objective": objective,
            "one_core_samples_per_s": round(one_core.samples_per_s, 2),
            "one_core_overhead_s": round(one_core.overhead_s, 4),
            "transfer_cpu_ns_per_byte": round(per_byte * 1e9, 3),
            "from_cache": costs.from_cache, "measurement_cache": str(cache_path()),
            "ideal_samples_per_s": round(ideal, 2),
            "proportional_dp_samples_per_s": round(dp_pred.samples_per_s, 3),
            "devices": {b.name: b.device for b in boards},
            "plans": [{**p.to_pipeline_section(), "kind": p.kind, "left_out": dict(p.left_out),
                       "local_boards": list(p.local_boards),
                       "predicted_local_samples_per_s": {b: round(v, 3) for b, v in
                                                         p.prediction.local_samples_per_s.items()},
                       "predicted_step_s": round(p.prediction.step_s, 4),
                       "predicted_samples_per_s": round(p.prediction.samples_per_s, 3),
                       "predicted_energy_per_sample_j": round(p.prediction.energy_per_sample_j, 4)}
                      for p in plans]})
    lines = [f"fleet {fleet.name}: {len(boards)} boards; {model_name}, global batch {batch}, objective {objective}; "
             f"one core of this machine: {one_core.samples_per_s:.1f} samples/s + "
             f"{one_core.overhead_s * 1000:.0f} ms per call, {per_byte * 1e9:.2f} ns of CPU per byte moved "
             f"({_measured(costs)})"]
    shown = spread(len(plans), PARETO_SHOWN)
    if len(plans) > 1:
        lines.append(f"\nPareto front: {len(plans)} plans, fastest first"
                     + (f"; {len(shown)} spread along it are explained (--json lists all)" if len(shown) < len(plans)
                        else ""))
        lines.append(f"{'plan':>5} {'kind':<9} {'s/step':>8} {'samples/s':>10} {'J/sample':>9}")
        for i in shown:
            pred = plans[i].prediction
            lines.append(f"{i + 1:>5} {plans[i].kind:<9} {pred.step_s:>8.3f} {pred.samples_per_s:>10.2f} "
                         f"{pred.energy_per_sample_j:>9.3f}")
    for i in shown:
        if len(plans) > 1:
            lines.append(f"\n-- Pareto plan {i + 1} of {len(plans)}")
        lines.append(plans[i].explain({b.name: b.device for b in boards}))
    best = plans[0].prediction
    lines.append(f"\nfleet ideal {ideal:.1f} samples/s; proportional DP on every board {dp_pred.samples_per_s:.2f} "
                 f"samples/s ({dp_pred.energy_per_sample_j:.3f} J/sample); this plan {best.samples_per_s:.2f} "
                 f"samples/s = {best.samples_per_s / ideal:.0%} of ideal, "
                 f"{best.samples_per_s / dp_pred.samples_per_s:.2f}x proportional DP (predicted)")
    if job.planner.trial_steps:
        lines.append(f"(predictions: in a run the planner measures its choice and the best plan of each other kind "
                     f"within 2x of it for {job.planner.trial_steps} steps each, and keeps the fastest measured)")
    return "\n".join(lines)
