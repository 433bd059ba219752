"""The report's figures (matplotlib, Agg backend, no pyplot state): accuracy vs training time and
vs energy per arm, samples/s per arm against the fleet's ideal, the planner's time/energy Pareto
front with the chosen plan, and a per-board timeline of a few steps for each arm.

Every figure drawn from synthetic data says so in its title. A missing piece (an arm that never
reached the target, no energy figures, one repeat, no fleet file) never stops a figure: the
figure, or the report line in its place, says what is missing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from edgetrain.experiment.fleet_plan import PlanView
from edgetrain.experiment.results import RunData, accuracy_curve, group_by_arm, step_timings

TIMELINE_STEPS = 4
"""Consecutive steps a timeline shows (after the first, warm-up, step)."""
SEGMENTS = (("compute", "compute", "tab:blue"), ("comm", "communication", "tab:orange"),
            ("wait", "waiting on pipeline peers", "tab:purple"), ("idle", "idle", "0.85"))
"""Timeline segments: key in StepTiming.boards, legend text, colour."""


@dataclass(frozen=True)
class PlotFile:
    """One figure of the report: its file (None: not drawn) and the caption that says what it
    shows, or why it is missing."""

    path: Path | None
    caption: str


def _title(text: str, synthetic: bool) -> str:
    return f"{text} (synthetic data)" if synthetic else text


def _note(ax, text: str) -> None:
    """Say what is missing, in the plot itself."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True, fontsize=9,
            bbox={"boxstyle": "round", "facecolor": "lightyellow", "edgecolor": "0.6"})


def _save(fig: Figure, path: Path) -> Path:
    """Write the figure as PNG, its title also in the file's metadata (Title), where a reader or
    a test finds it without looking at pixels."""
    title = " / ".join(ax.get_title() for ax in fig.axes if ax.get_title())
    fig.savefig(path, dpi=110, metadata={"Title": title})
    return path


def _colours(arms: list[str]) -> dict[str, str]:
    return {arm: f"C{i % 10}" for i, arm in enumerate(arms)}


def _median_index(rows: list[dict]) -> int:
    """The repeat drawn thick: the one with the median time to target (final accuracy if none reached)."""
    key = [(r["time_to_target_s"] if r["reached"] else math.inf, -(r["final_accuracy"] or 0)) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: key[i])
    return order[(len(order) - 1) // 2]


def accuracy_plot(runs: list[RunData], rows: list[dict], path: Path, *, by: str, synthetic: bool) -> PlotFile:
    """Test accuracy vs training time (`by="time"`) or vs the boards' energy (`by="energy"`):
    one colour per arm, every repeat a thin line, the median repeat thick, the target dashed."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    by_path = {r["run_dir"]: run for run, r in zip(runs, rows)}
    groups = {a: g for a, g in group_by_arm(rows).items() if any(by_path[r["run_dir"]].kind("eval") for r in g)}
    colours = _colours(list(groups))
    missing, unreached = [], []
    for arm, group in groups.items():
        thick = _median_index(group)
        drawn = False
        for i, row in enumerate(group):
            curve = accuracy_curve(by_path[row["run_dir"]])
            if by == "energy":
                curve = [p for p in curve if p.energy_j is not None]
            if not curve:
                continue
            xs = [p.training_s if by == "time" else p.energy_j for p in curve]
            ax.plot(xs, [p.accuracy for p in curve], color=colours[arm], lw=2.2 if i == thick else 0.9,
                    alpha=1.0 if i == thick else 0.5, marker="o" if len(curve) < 12 else None, ms=3)
            drawn = True
        if drawn:  # the legend shows the arm's median-repeat style
            ax.plot([], [], color=colours[arm], lw=2.2, marker="o", ms=3,
                    label=arm + ("" if any(r["reached"] for r in group) else " (target not reached)"))
        else:
            missing.append(arm)
        if drawn and not any(r["reached"] for r in group):
            unreached.append(arm)
    targets = sorted({r["target_accuracy"] for r in rows if r["target_accuracy"] is not None})
    for t in targets:
        ax.axhline(t, ls="--", color="0.3", lw=1, label=f"target {t:.3f}")
    what = "training time (s; evaluation excluded, counted set-up included)" if by == "time" \
        else "energy of the boards (J)"
    ax.set_xlabel(what)
    ax.set_ylabel("test accuracy")
    ax.set_title(_title(f"Test accuracy vs {'training time' if by == 'time' else 'energy'}", synthetic))
    notes = []
    if missing:
        notes.append(("no energy figures" if by == "energy" else "no evaluations") + ": " + ", ".join(missing))
    if not targets:
        notes.append("no target accuracy given")
    if notes and not (groups.keys() - set(missing)):
        _note(ax, "; ".join(notes))
    elif notes:
        ax.text(0.99, 0.02, "; ".join(notes), transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
                color="0.3")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right" if not notes else "center right", fontsize=8)
    ax.grid(alpha=0.3)
    name = "accuracy_vs_time.png" if by == "time" else "accuracy_vs_energy.png"
    caption = (f"Test accuracy vs {'training time' if by == 'time' else 'the boards’ energy'}, one colour per "
               "arm (thick: the median repeat, thin: the other repeats); dashed: the target")
    if unreached:
        caption += f"; never reached the target: {', '.join(unreached)}"
    if missing:
        caption += f"; left out ({'no energy figures' if by == 'energy' else 'no evaluations'}): {', '.join(missing)}"
    return PlotFile(_save(fig, path / name), caption + ".")


def throughput_plot(rows: list[dict], view: PlanView | None, path: Path, *, synthetic: bool) -> PlotFile:
    """Samples/s per arm (median, whiskers min–max over repeats) against the fleet's ideal."""
    groups = {a: g for a, g in group_by_arm(rows).items()
              if any(isinstance(r["samples_per_s"], (int, float)) for r in g)}
    fig = Figure(figsize=(max(5.0, 1.2 * len(groups) + 3), 4.5), layout="constrained")
    ax = fig.add_subplot()
    colours = _colours(list(groups))
    ideal = view.ideal_samples_per_s if view else None
    for i, (arm, group) in enumerate(groups.items()):
        values = [r["samples_per_s"] for r in group if isinstance(r["samples_per_s"], (int, float))]
        median = statistics.median(values)
        ax.bar(i, median, color=colours[arm], alpha=0.8)
        share = f"\n{median / ideal:.0%} of ideal" if ideal else ""
        ax.annotate(f"{median:.3g}{share}", (i, median), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points")
        if len(values) > 1:
            ax.errorbar(i, median, yerr=[[median - min(values)], [max(values) - median]], color="k", capsize=4)
    ax.set_xticks(range(len(groups)), list(groups), rotation=20 if len(groups) > 4 else 0)
    ax.set_ylabel("training samples/s")
    ax.set_title(_title("Throughput per arm vs the fleet's ideal", synthetic))
    if ideal:
        ax.axhline(ideal, color="k", ls="--", lw=1.2,
                   label=f"fleet ideal {ideal:.3g} samples/s (every board computing, no communication)")
        ax.legend(fontsize=8, loc="upper right")
        ax.set_ylim(0, max([ideal] + [b.get_height() for b in ax.patches]) * 1.15)
    if not groups:
        _note(ax, "no arm recorded training steps")
    elif not ideal:
        ax.text(0.99, 0.98, "fleet ideal unknown: no fleet file and no board profiles", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="0.3")
    ax.grid(axis="y", alpha=0.3)
    caption = "Training samples/s per arm (bar: median over repeats; whiskers: min–max); dashed: " + (
        view.ideal_how if ideal else "no fleet ideal (no fleet file and no board profiles)")
    return PlotFile(_save(fig, path / "samples_per_s.png"), caption + ".")


def _same_plan(a: dict, b: dict) -> bool:
    keys = ("stages", "dp_boards", "microbatches", "schedule")
    if not a.get("stages") and not b.get("stages"):
        return sorted(a.get("dp_boards") or []) == sorted(b.get("dp_boards") or [])
    return all(a.get(k) == b.get(k) for k in keys)


def pareto_plot(view: PlanView | None, path: Path, *, synthetic: bool) -> PlotFile:
    """The planner's predicted time/energy front for the fleet with each hybrid arm's plan marked;
    no figure (only a report line) when there is no front."""
    if view is None or view.front is None:
        return PlotFile(None, view.front_note if view else "No Pareto front: no training arm.")
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    front = sorted(view.front, key=lambda p: p["predicted_step_s"])
    xs = [p["predicted_step_s"] for p in front]
    ys = [p["predicted_energy_per_sample_j"] for p in front]
    ax.plot(xs, ys, "-o", color="0.4", ms=4, lw=1, label=f"Pareto front ({len(front)} plans, predicted)")
    for i, (arm, record) in enumerate(view.chosen):
        colour = f"C{(i + 1) % 10}"
        on_front = [p for p in front if _same_plan(p, record.get("plan") or {})]
        for p in on_front:
            ax.plot(p["predicted_step_s"], p["predicted_energy_per_sample_j"], "o", ms=13, mfc="none", mec=colour,
                    mew=2, label=f"{arm}'s plan, on the front")
        if isinstance(record.get("predicted_step_s"), (int, float)):
            ax.plot(record["predicted_step_s"], record.get("predicted_energy_per_sample_j") or 0.0, "*", ms=14,
                    color=colour, label=f"{arm}'s plan as predicted live ({record.get('plan_kind', '')})")
    ax.set_xlabel("predicted seconds per step")
    ax.set_ylabel("predicted energy per sample (J)")
    ax.set_title(_title(f"Planner's time/energy front: {view.fleet_name}, {view.model}", synthetic))
    if ys and not any(ys):
        ax.text(0.5, 0.95, "the fleet has no power figures: every plan's predicted energy is 0",
                transform=ax.transAxes, ha="center", va="top", fontsize=8, color="0.3")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    caption = (f"The planner's predicted time/energy Pareto front for fleet {view.fleet_name} ({view.model}, "
               "from `edgetrain plan --objective pareto`); star: the plan each hybrid arm ran, as the planner "
               "predicted it from the live boards' measured figures (so it may sit off the fleet file's front); "
               "ring: the same plan on the front")
    return PlotFile(_save(fig, path / "pareto_front.png"), caption + ".")


def timeline_plot(run: RunData, path: Path, *, synthetic: bool) -> PlotFile | None:
    """Per-board compute / communication / waiting / idle over a few consecutive steps of one run;
    None when its records carry no per-board timings."""
    steps = step_timings(run, TIMELINE_STEPS)
    if not steps:
        return None
    boards = sorted({b for s in steps for b in s.boards})
    fig = Figure(figsize=(9, 1.2 + 0.5 * len(boards)), layout="constrained")
    ax = fig.add_subplot()
    used = set()
    for y, board in enumerate(boards):
        for s in steps:
            t = s.start_s
            for key, label, colour in SEGMENTS:
                width = s.boards.get(board, {}).get(key, 0.0)
                if width <= 0:
                    continue
                ax.broken_barh([(t, width)], (y - 0.35, 0.7), color=colour,
                               label=label if key not in used else None)
                used.add(key)
                t += width
    for s in steps:
        ax.axvline(s.start_s, color="k", lw=0.6, ls=":")
        ax.text(s.start_s, len(boards) - 0.4, f" step {s.step}", fontsize=7, va="bottom")
    ax.set_yticks(range(len(boards)), boards)
    ax.set_ylim(-0.6, len(boards) + 0.2)
    ax.set_xlabel("seconds from the first step shown")
    first, last = steps[0].step, steps[-1].step
    ax.set_title(_title(f"{run.name}: where each board's time goes, steps {first}–{last}", synthetic))
    fig.legend(loc="outside lower center", ncols=len(used), fontsize=8)
    name = "timeline_" + "".join(c if c.isalnum() or c in "-_" else "_" for c in run.name) + ".png"
    caption = (f"{run.name} (repeat {run.arm.get('repeat', 0)}): per board and step, compute, communication "
               "(download, encode, upload), waiting on pipeline peers and idle time to the end of the step; the "
               "order inside a step is schematic (communication drawn after compute)")
    return PlotFile(_save(fig, path / name), caption + ".")


def make_plots(runs: list[RunData], rows: list[dict], path: Path, *, synthetic: bool,
               plan_view: PlanView | None) -> list[PlotFile]:
    """Every figure of the report, written under `path`; the captions go into report.md."""
    path.mkdir(parents=True, exist_ok=True)
    trained = [(run, row) for run, row in zip(runs, rows) if row["makespan_s"] is None]
    if not trained:
        return []
    t_runs, t_rows = [r for r, _ in trained], [w for _, w in trained]
    figures = [accuracy_plot(t_runs, t_rows, path, by="time", synthetic=synthetic),
               accuracy_plot(t_runs, t_rows, path, by="energy", synthetic=synthetic),
               throughput_plot(t_rows, plan_view, path, synthetic=synthetic),
               pareto_plot(plan_view, path, synthetic=synthetic)]
    by_arm: dict[str, list[RunData]] = {}
    for run in t_runs:
        by_arm.setdefault(run.name, []).append(run)
    for arm, arm_runs in by_arm.items():
        first = min(arm_runs, key=lambda r: r.arm.get("repeat", 0) if isinstance(r.arm.get("repeat", 0), int) else 0)
        figure = timeline_plot(first, path, synthetic=synthetic)
        figures.append(figure or PlotFile(None, f"No timeline for {arm}: its records carry no per-board timings."))
    return figures
