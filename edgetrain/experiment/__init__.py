"""Experiments: arms run to one stop rule on one fleet, and the report built from their run
directories.

spec.py       an experiment file (and a trace file): arms, repeats or seeds, the stop rule;
              loaded and checked, every arm's job built, before anything runs
runner.py     runs each arm: EdgeTrain arms as a coordinator and one client process per board
              (or as jobs on a live job server), baselines through baselines.py, trace arms as
              a job server fed a trace; writes each run's arm.json, then the report
baselines.py  the baselines users would otherwise run: PyTorch DDP (gloo), one board alone,
              the gateway alone (centralized)
results.py    one row per run directory (time and energy to the target accuracy, throughput, the
              plan)
report.py     results.csv and report.md over an experiment's arms and repeats
fleet_plan.py the planner's view of the fleet for the report (`edgetrain plan` as a subprocess):
              the ideal throughput and the Pareto front
bench_output.py  what scripts/bench_*.py share: --smoke, --record (docs/results/), the JSON
              last line, SIGTERM handled as Ctrl-C
plots.py      the report's figures (matplotlib, Agg): accuracy vs time and energy, samples/s vs the
              fleet's ideal, the planner's Pareto front, a per-board timeline of a few steps

`edgetrain experiment run EXP.yaml` and `edgetrain report RUN_DIR...` are the CLI's faces of this.
"""
