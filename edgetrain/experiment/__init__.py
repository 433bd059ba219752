"""Experiments: arms run to a stop rule, and the report built from their run directories.

results.py  one row per run directory (time and energy to the target accuracy, throughput, the
            plan), results.csv and report.md over an experiment's arms and repeats
plots.py    the report's figures (matplotlib, Agg): accuracy vs time and energy, samples/s vs the
            fleet's ideal, the planner's Pareto front, a per-board timeline of a few steps
"""
