"""The planner's measured trials in a report: which plans it tried, what each measured, which it kept.

Read from the `plan_trial` records of a run's metrics.jsonl (coordinator.planning.trials).
"""

from __future__ import annotations

from collections.abc import Sequence


def trials_section(runs: Sequence) -> list[str]:
    """report.md lines: one table per run whose planner measured plans (empty when none did)."""
    lines: list[str] = []
    for run in runs:
        trials = run.kind("plan_trial")
        if not trials:
            continue
        if not lines:
            lines += ["## Plans the planner measured", "",
                      "Each candidate trained a hand-over step and then its scored steps (their updates count); "
                      "score = samples per step / measured step time x efficiency (phi + M0) / (phi + M), "
                      "phi the gradient noise scale (unknown: efficiency 1). The best score was kept.", ""]
        for trial in trials:
            phi = trial.get("noise_scale")
            lines += [f"{run.name}, steps {trial['started']}-{trial['step'] - 1} "
                      f"({'; '.join(trial.get('reasons') or []) or 'no reason recorded'}; noise scale "
                      f"{'unknown' if phi is None else f'{phi:.0f}'}; {trial.get('trial_s', 0):.1f} s):", "",
                      "| plan | measured s/step | predicted s/step | samples/step | efficiency | score | |",
                      "|---|---|---|---|---|---|---|"]
            for i, c in enumerate(trial.get("candidates", [])):
                lines.append(f"| {c['plan']} | {_num(c.get('measured_step_s'))} | {_num(c.get('predicted_step_s'))} | "
                             f"{_num(c.get('samples_per_step'))} | {_num(c.get('efficiency'))} | "
                             f"{_num(c.get('score'))} | {'kept' if i == trial.get('chosen') else ''} |")
            lines.append("")
    return lines


def _num(value) -> str:
    return "—" if value is None else f"{value:.3g}"
