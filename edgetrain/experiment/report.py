"""The report over an experiment's arms: results.csv, report.md and its plots.

`build_report` reads each run directory into one row (edgetrain.experiment.results), writes the
rows as results.csv, and report.md as tables of arms (median and range over repeats), runs and
multi-job traces, the planner's trials, and the figures (edgetrain.experiment.plots) with the
fleet's ideal throughput and Pareto front (edgetrain.experiment.fleet_plan). How each figure is
measured is said in edgetrain.experiment.results and in report.md itself.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from edgetrain.config import ConfigError
from edgetrain.experiment.fleet_plan import plan_view
from edgetrain.experiment.plan_trials import trials_section
from edgetrain.experiment.results import ROW_FIELDS, group_by_arm, load_run, row_of

INSECURE_LABEL = "insecure (gloo, no authentication)"
"""How every output labels a DDP arm: gloo's process group authenticates nobody."""

NO_TARGET = "no target given"
"""What the report says for time and energy to target of a run that had no target accuracy."""


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _seconds(x: float) -> str:
    return f"{x:.0f} s" if x >= 100 else f"{x:.1f} s"


def _joules(x: float) -> str:
    return f"{x / 1000:.3g} kJ" if x >= 10_000 else f"{x:.0f} J" if x >= 100 else f"{x:.3g} J"


def _number(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def arm_median(values: list[float | None]) -> float | None:
    """Median over repeats, a repeat without a figure counting as infinitely slow (MLPerf ranks
    a run that missed the target last): None when no repeat has a figure, inf when the median
    repeat has none."""
    known = _finite(values)
    if not known:
        return None
    return statistics.median(sorted(known) + [math.inf] * (len(values) - len(known)))


def spread(values: list[float | None], fmt, *, missing: str) -> str:
    """`median [min–max]` over repeats (arm_median); `missing` (e.g. "not reached within the
    cap") stands for a figure a repeat does not have."""
    median = arm_median(values)
    if median is None:
        return missing
    head = fmt(median) if math.isfinite(median) else missing
    if len(values) == 1:
        return head
    known = sorted(_finite(values))
    top = missing if len(known) < len(values) else fmt(known[-1])
    return f"{head} [{fmt(known[0])}–{top}]"


def _ratio(arm: float | None, ddp: float | None, word: str) -> str:
    if arm is None or not math.isfinite(arm):
        return "—"
    if ddp is None or not math.isfinite(ddp):
        return "ddp did not reach the target"
    if ddp == 0:
        return "—"
    r = arm / ddp
    return f"{r:.2f}× ({1 / r:.1f}× {word})" if r > 0 else "—"


def _arm_label(rows: list[dict]) -> str:
    name = rows[0]["arm"]
    return f"{name} — {INSECURE_LABEL}" if any(r["insecure"] for r in rows) else name


def _energy_cells(rows: list[dict]) -> str:
    """Energy to target over repeats: "unknown" when a repeat reached the target without energy figures."""
    if all(r["target_accuracy"] is None for r in rows):
        return NO_TARGET
    if any(r["reached"] and r["energy_to_target_j"] is None for r in rows):
        return "unknown"
    return spread([r["energy_to_target_j"] for r in rows], _joules, missing="not reached within the cap")


def arms_table(rows: list[dict]) -> list[str]:
    """Markdown: one line per arm, median [min–max] over repeats, ratios to ddp when there is one."""
    arms = {a: g for a, g in group_by_arm(rows).items() if not all(r["makespan_s"] is not None for r in g)}
    ddp = next((g for a, g in arms.items() if a == "ddp" or any(r["baseline"] == "ddp" for r in g)), None)
    ddp_time = arm_median([r["time_to_target_s"] for r in ddp]) if ddp else None
    ddp_energy = arm_median([r["energy_to_target_j"] for r in ddp]) if ddp else None
    head = ["arm", "runs", "reached", "time to target", "energy to target", "final accuracy", "samples/s",
            "bytes/sample", "setup", "plan"]
    if ddp:
        head += ["time vs ddp", "energy vs ddp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in arms.values():
        cells = [_arm_label(group), str(len(group)), f"{sum(r['reached'] for r in group)} of {len(group)}",
                 NO_TARGET if all(r["target_accuracy"] is None for r in group) else
                 spread([r["time_to_target_s"] for r in group], _seconds, missing="not reached within the cap"),
                 _energy_cells(group),
                 spread([r["final_accuracy"] for r in group], lambda x: f"{x:.3f}", missing="no evaluation"),
                 spread([r["samples_per_s"] for r in group], _number, missing="—"),
                 spread([r["bytes_per_sample"] for r in group], lambda x: f"{x / 1e3:.1f} kB", missing="—"),
                 spread([r["setup_s"] for r in group], _seconds, missing="—"),
                 group[0]["plan"] or "—"]
        if group is ddp:
            cells += ["1 (reference)", "1 (reference)"]
        elif ddp:
            energy_unknown = any(r["reached"] and r["energy_to_target_j"] is None for r in group + ddp)
            cells += [_ratio(arm_median([r["time_to_target_s"] for r in group]), ddp_time, "sooner"),
                      "unknown" if energy_unknown else
                      _ratio(arm_median([r["energy_to_target_j"] for r in group]), ddp_energy, "less")]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def runs_table(rows: list[dict]) -> list[str]:
    """Markdown: one line per run (arm and repeat)."""
    head = ["arm", "repeat", "seed", "time to target", "steps to target", "energy to target", "final accuracy",
            "samples/s", "set-up", "run directory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["makespan_s"] is not None:
            continue
        energy = (NO_TARGET if r["target_accuracy"] is None else "unknown" if r["reached"] and r["energy_to_target_j"] is None else
                  _joules(r["energy_to_target_j"]) if r["reached"] else "not reached within the cap")
        cells = [_arm_label([r]), str(r["repeat"]), str(r["seed"]),
                 NO_TARGET if r["target_accuracy"] is None else
                 _seconds(r["time_to_target_s"]) if r["reached"] else "not reached within the cap",
                 str(r["steps_to_target"]) if r["reached"] else "—", energy,
                 f"{r['final_accuracy']:.3f}" if r["final_accuracy"] is not None else "no evaluation",
                 _number(r["samples_per_s"]) if r["samples_per_s"] else "—", r["setup"] or "—",
                 f"`{r['run_dir']}`"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def trace_table(rows: list[dict]) -> list[str]:
    """Markdown: multi-job trace arms (makespan and mean job completion time over repeats)."""
    head = ["arm", "runs", "makespan", "mean JCT", "scheduler"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in group_by_arm([r for r in rows if r["makespan_s"] is not None]).values():
        lines.append("| " + " | ".join([
            _arm_label(group), str(len(group)),
            spread([r["makespan_s"] for r in group], _seconds, missing="—"),
            spread([r["mean_jct_s"] for r in group], _seconds, missing="—"), group[0]["plan"] or "—"]) + " |")
    return lines


def write_csv(rows: list[dict], path: Path) -> None:
    """results.csv: ROW_FIELDS, one line per run; an unknown figure is an empty cell."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in ROW_FIELDS})


def _title_and_notes(rows: list[dict], title: str | None) -> tuple[str, list[str]]:
    experiments = sorted({r["experiment"] for r in rows})
    name = title or (f"Experiment {experiments[0]}" if len(experiments) == 1 else "EdgeTrain results")
    notes = []
    if any(r["synthetic_data"] for r in rows):
        which = "every run" if all(r["synthetic_data"] for r in rows) else "some runs (marked in results.csv)"
        notes.append(f"**Synthetic data**: {which} trained on EdgeTrain's synthetic dataset, not CIFAR-10; "
                     "the figures say how the methods compare on it, not what CIFAR-10 would give.")
    return name, notes


def build_report(run_dirs: Sequence[Path], out_dir: Path, *, title: str | None = None,
                 target_accuracy: float | None = None, fleet=None) -> Path:
    """Write out_dir/results.csv, out_dir/report.md and out_dir/plots/*.png for the run
    directories given; returns report.md's path. `fleet` (a FleetSpec; else the fleet file named
    in arm.json) gives the fleet's ideal throughput and the planner's Pareto front, both from
    `edgetrain plan`. ConfigError when a directory is not a run directory."""
    from edgetrain.experiment import plots

    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise ConfigError("report: no run directories given")
    rows = [row_of(run, target_accuracy) for run in runs]
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "results.csv")
    synthetic = any(r["synthetic_data"] for r in rows)
    name, notes = _title_and_notes(rows, title)
    targets = sorted({r["target_accuracy"] for r in rows if r["target_accuracy"] is not None})
    caps = sorted({run.arm.get("stop", {}).get("time_cap_s") for run in runs
                   if isinstance(run.arm.get("stop"), dict) and run.arm["stop"].get("time_cap_s")})
    trained = [r for r in rows if r["makespan_s"] is None]
    lines = [f"# {name}", ""] + [n + "\n" for n in notes]
    if targets:
        lines.append("Target: test accuracy ≥ " + ", ".join(f"{t:.3f}" for t in targets)
                     + (f", time cap {', '.join(_seconds(c) for c in caps)} per run" if caps else "") + ".")
    elif trained:
        lines.append("Target: none given (no arm has a target accuracy): time and energy to target are not reported.")
    lines += ["", "How the figures are measured:",
              "- **Time to target**: from the first training step's start to the evaluation that first reaches "
              "the target, less the time spent evaluating inside that window (evaluation is measurement, not "
              "training; every arm gets the same treatment), plus set-up that the arm must pay on every run and "
              "marks as counted (e.g. the centralized baseline shipping the boards' data to the gateway).",
              "- **Energy to target**: the boards' energy over the training steps in the same window (plus counted "
              "set-up energy); \"unknown\" when a board reported none.",
              "- **Set-up** (profiling, process-group start, data fetch; or launch to first step when longer) is "
              "reported beside the window and not included in it unless counted.",
              "- Each arm: median and [min–max] over its repeats; a repeat that did not reach the target counts "
              "as slower than every one that did.", ""]
    if trained:
        lines += ["## Arms", ""] + arms_table(trained) + ["", "## Runs", ""] + runs_table(trained) + [""]
    if len(trained) < len(rows):
        lines += ["## Multi-job traces", ""] + trace_table(rows) + [""]
    lines += trials_section(runs)
    lines += ["## Plots", ""]
    figures = plots.make_plots(runs, rows, out_dir / "plots", synthetic=synthetic,
                               plan_view=plan_view(runs, rows, fleet, out_dir) if trained else None)
    for figure in figures:
        if figure.path is not None:
            lines += [f"![{figure.path.stem}](plots/{figure.path.name})", "", f"*{figure.caption}*", ""]
        else:
            lines += [f"- {figure.caption}", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report
