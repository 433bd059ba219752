"""The planner's view of the fleet, for the report's throughput and Pareto plots.

`edgetrain plan FLEET --json` runs as a subprocess (the planner lives in the coordinator role,
which the core does not import) on the fleet the runs record: the caller's FleetSpec, the fleet
file arm.json names, or the boards it recorded. It gives the fleet's ideal throughput and, with
a hybrid arm, the Pareto front; without a fleet the boards' profiled speeds give the ideal.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from edgetrain.experiment.results import RunData

logger = logging.getLogger(__name__)

PLAN_TIMEOUT_S = 900
"""How long `edgetrain plan` may take (it measures the model once when the cache lacks it)."""


@dataclass
class PlanView:
    """What `edgetrain plan` said about the fleet, for the throughput and Pareto plots."""

    ideal_samples_per_s: float | None
    ideal_how: str
    front: list[dict] | None
    """The Pareto front (the plan JSON's `plans`); None: not computed (see `front_note`)."""
    front_note: str
    chosen: list[tuple[str, dict]]
    """(arm, its last plan record) for every arm the planner ran (hybrid arms)."""
    fleet_name: str = ""
    model: str = ""


def plan_view(runs: list[RunData], rows: list[dict], fleet, out_dir: Path) -> PlanView:
    """The fleet's ideal throughput and, with a hybrid arm, the planner's Pareto front."""
    chosen = []
    for run in runs:
        plans = run.kind("plan")
        switched = [p for p in plans if p.get("switched")] or plans
        if switched and run.name not in {a for a, _ in chosen}:
            chosen.append((run.name, switched[-1]))
    trained = [run for run in runs if run.kind("train")]
    source = next((run for run in trained if run.kind("plan")), trained[0] if trained else runs[0])
    model = source.job.get("model") or source.summary.get("model")
    batch = (source.job.get("training") or {}).get("global_batch")
    pipeline = source.job.get("pipeline") or {}
    view = PlanView(ideal_samples_per_s=None, ideal_how="", front=None, front_note="", chosen=chosen,
                    model=model or "")
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        fleet_file = _fleet_file(runs, fleet, model or "", Path(scratch)) if model else None
        if fleet_file is None:
            view.front_note = "No Pareto front: the runs record no fleet (run them through `edgetrain experiment run`)."
        else:
            try:
                planned = plan_for_fleet(fleet_file, model=model, batch=batch, pareto=bool(chosen),
                                         stage_state=pipeline.get("stage_state"),
                                         replicate=pipeline.get("replicate", True))
            except RuntimeError as e:
                view.front_note = f"No Pareto front and no planned fleet ideal: {e}."
                logger.warning("[report] %s", e)
            else:
                view.fleet_name = planned.get("fleet", "")
                view.ideal_samples_per_s = planned.get("ideal_samples_per_s")
                view.ideal_how = (f"fleet ideal {view.ideal_samples_per_s:.1f} samples/s = Σ board speed × "
                                  f"{model}'s one-core samples/s on this machine "
                                  f"({planned.get('one_core_samples_per_s')}, measured by `edgetrain plan`)")
                if chosen:
                    view.front = planned.get("plans") or []
                else:
                    view.front_note = "No Pareto front: no arm ran the planner (no hybrid arm)."
    if view.ideal_samples_per_s is None:
        profiled = _profiled_ideal(trained)
        if profiled is not None:
            view.ideal_samples_per_s = profiled
            view.ideal_how = (f"fleet ideal {profiled:.1f} samples/s = Σ the boards' profiled samples/s "
                              "(their join profile; no fleet file)")
    return view


def _fleet_yaml(fleet, model: str, path: Path) -> None:
    """A fleet file holding `fleet`'s boards (a FleetSpec), for `edgetrain plan`."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        return value
    boards = [plain(b) for b in fleet.boards]
    path.write_text(yaml.safe_dump({"name": fleet.name, "job": {"model": model}, "boards": boards}))


def plan_for_fleet(fleet_file: Path, *, model: str, batch: int | None, pareto: bool,
                   stage_state: str | None = None, replicate: bool = True) -> dict:
    """`edgetrain plan FLEET --json` run as a subprocess of this checkout (the planner lives in
    the coordinator role, which the core does not import). Raises RuntimeError with its error."""
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "edgetrain", "plan", str(fleet_file), "--model", model, "--json",
            "--objective", "pareto" if pareto else "time"]
    if batch:
        argv += ["--batch", str(batch)]
    if stage_state:
        argv += ["--stage-state", stage_state]
    if not replicate:
        argv.append("--no-replicate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PLAN_TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"edgetrain plan took more than {PLAN_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"edgetrain plan exited {done.returncode}: {last}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RuntimeError("edgetrain plan printed no JSON") from None


def _fleet_file(runs: list[RunData], fleet, model: str, scratch: Path) -> Path | None:
    """The fleet to plan for: the caller's FleetSpec (written out), else arm.json's fleet file."""
    if fleet is not None:
        path = scratch / "fleet.yaml"
        _fleet_yaml(fleet, model, path)
        return path
    for run in runs:
        given = run.arm.get("fleet")
        if isinstance(given, str) and given and Path(given).is_file():
            return Path(given)
    for run in runs:  # the boards arm.json recorded (the fleet file may be elsewhere or gone)
        boards = run.arm.get("fleet_boards")
        if boards:
            path = scratch / "fleet.yaml"
            path.write_text(yaml.safe_dump({"name": str(run.arm.get("fleet") or "fleet"), "job": {"model": model},
                                            "boards": [_recorded_board(b) for b in boards]}))
            return path
    return None


def _recorded_board(board: dict) -> dict:
    """A fleet file's board entry from arm.json's `fleet_boards` record."""
    entry = {"name": board["name"], "speed": board["speed"], "idle_w": board.get("idle_w"),
             "busy_w": board.get("busy_w"),
             "link": {"mbit_per_s": board["mbit_per_s"]} if board.get("mbit_per_s") else None}
    return {k: v for k, v in entry.items() if v is not None}


def _profiled_ideal(runs: list[RunData]) -> float | None:
    """Fallback ideal: the boards' own profiled samples/s (their join profile, summary.json),
    summed, from the run with the most boards."""
    best = None
    for run in runs:
        rates = [d.get("samples_per_s_estimate") for d in run.summary.get("devices") or []]
        rates = [r for r in rates if isinstance(r, (int, float))]
        if rates and (best is None or len(rates) > best[0]):
            best = (len(rates), sum(rates))
    return best[1] if best else None
