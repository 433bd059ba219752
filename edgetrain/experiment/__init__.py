"""Experiments: arms run to one stop rule on one fleet, and what they measured, as a report.

  spec.py       an experiment file (and a trace file): arms, repeats or seeds, the stop rule;
                loaded and checked, every arm's job built, before anything runs
  runner.py     runs each arm: EdgeTrain arms as a coordinator and one client process per board
                (or as jobs on a live job server), baselines through baselines.py, trace arms as
                a job server fed a trace; writes each run's arm.json, then the report
  baselines.py  the baselines users would otherwise run: PyTorch DDP (gloo), one board alone,
                the gateway alone (centralized)
  results.py    rows from run directories (time and energy to target, ...): results.csv, report.md
  plots.py      the report's plots (matplotlib, Agg)

`edgetrain experiment run EXP.yaml` and `edgetrain report RUN_DIR...` are the CLI's faces of this.
"""
