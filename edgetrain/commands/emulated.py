"""Commands that run on this machine: `local` and `demo` (a coordinator and emulated boards),
`fleet` (an emulated fleet: up, down, supervise), `experiment run` (an experiment's arms, then
its report) and `report` (results.csv, report.md and plots from finished runs)."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from edgetrain.config import ConfigError, load_job, parse_override
from edgetrain.emulator.launch import DEMO_JOB, LocalRun, run_local


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the command as Ctrl-C does, so the processes it started are stopped on the way
    out (a plain SIGTERM would leave its coordinator and boards running)."""
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def local(args: argparse.Namespace) -> int:
    """local, demo: a coordinator and emulated boards on this machine."""
    job_file = getattr(args, "config", DEMO_JOB)
    overrides = list(args.set)
    if args.dataset:  # an imported dataset: all of it (the job's sizes were for its own dataset)
        overrides = [f"dataset.name={args.dataset}", "dataset.train_size=null", "dataset.test_size=null", *overrides]
    job = load_job(job_file, dict(parse_override(o) for o in overrides))
    if args.dataset:
        from edgetrain.data import dataset_classes

        dataset_classes(replace(job.dataset, data_dir=str(args.data_dir)))  # FileNotFoundError: says which import
    run = LocalRun(job_file=job_file, speeds=args.speeds, overrides=tuple(overrides), runs_dir=args.runs_dir,
                   data_dir=args.data_dir, insecure=args.insecure,
                   dashboard=None if args.dashboard == "none" else args.dashboard)
    with sigterm_as_interrupt():
        code = run_local(run, job_name=job.name)
    if code == 0:
        print(f"results: {args.runs_dir / job.name}/ (metrics.jsonl, summary.json, checkpoints/)")
    return code


def fleet(args: argparse.Namespace) -> int:
    """fleet up, down, supervise: an emulated fleet on this machine."""
    from edgetrain.emulator.fleet import fleet_down, fleet_up, supervise
    from edgetrain.fleet_file import load_fleet

    if args.fleet_command == "supervise":
        return supervise(Path(args.fleet), args.state_dir / f"{load_fleet(args.fleet).name}.json",
                         args.runs_dir, args.data_dir, insecure=args.insecure,
                         dashboard=None if args.dashboard == "none" else args.dashboard)
    if args.fleet_command == "up":
        state = fleet_up(Path(args.fleet), state_dir=args.state_dir, runs_dir=args.runs_dir,
                         data_dir=args.data_dir, insecure=args.insecure,
                         dashboard=None if args.dashboard == "none" else args.dashboard)
        page = (f"\ndashboard: {Path(state['dashboard_url_file']).read_text().strip()} (the token in it grants "
                f"access)") if state.get("dashboard_url_file") else ""
        if load_fleet(args.fleet).jobs:
            server = f"--server {state['coordinator']} {' '.join(state['operator_args'])}"
            print(f"fleet {state['name']} is up ({state['mode']} network): job server {state['coordinator']}, "
                  f"{len(state['pids']) - 1} boards; `edgetrain submit JOB.yaml {server}` "
                  f"queues a job, `edgetrain jobs {server}` shows them, "
                  f"`edgetrain fleet down {state['name']}` stops it{page}")
            return 0
        print(f"fleet {state['name']} is up ({state['mode']} network): coordinator {state['coordinator']}, "
              f"{len(state['pids']) - 1} boards; `edgetrain devices --coordinator {state['coordinator']} "
              f"{' '.join(state['operator_args'])}` shows them, "
              f"`edgetrain fleet down {state['name']}` stops it{page}")
        return 0
    name = load_fleet(args.fleet).name if args.fleet.endswith((".yaml", ".yml")) else args.fleet
    removed = fleet_down(name, state_dir=args.state_dir)
    print(f"fleet {name}: " + ("removed " + ", ".join(removed) if removed else "nothing was running"))
    return 0


def experiment(args: argparse.Namespace) -> int:
    """experiment run: an experiment's arms on a fleet, then its report."""
    from edgetrain.experiment.runner import (
        Options,
        check_live,
        emulated_fleet,
        live_fleet,
        run_experiment,
    )
    from edgetrain.experiment.spec import load_experiment
    from edgetrain.fleet_file import load_fleet

    exp = load_experiment(args.experiment)
    names = [a.name for a in exp.arms]
    unknown = [a for a in args.arms if a not in names]
    if unknown:
        raise ConfigError(f"{exp.source}: --arms: no arm {unknown[0]!r} (arms: {', '.join(names)})")
    arms = [a for a in exp.arms if not args.arms or a.name in args.arms]
    if args.live:
        check_live(arms, insecure=args.insecure)
        if not args.server:
            raise ConfigError("--live needs the job server's address: --server HOST:PORT (or $EDGETRAIN_SERVER)")
        fleet = live_fleet(args.server)
    else:
        path = args.fleet or exp.fleet_file
        if path is None:
            raise ConfigError(f"{exp.source}: no fleet: name one in the file (fleet: FILE) or pass --fleet FLEET.yaml")
        fleet = emulated_fleet(load_fleet(path))
    runs = exp.runs(list(args.arms), boards=len(fleet.boards))
    with sigterm_as_interrupt():
        return run_experiment(exp, runs, fleet, Options(out_dir=args.out, arms=args.arms, live=args.live,
                                                        server=args.server, insecure=args.insecure,
                                                        data_dir=args.data_dir))


def report(args: argparse.Namespace) -> int:
    """Write results.csv, report.md and plots from finished run directories."""
    for run_dir in args.run_dirs:
        if not any((run_dir / name).is_file() for name in ("arm.json", "metrics.jsonl", "trace.json")):
            raise ConfigError(f"{run_dir}: not a run directory (no arm.json, metrics.jsonl or trace.json)")
    from edgetrain.experiment.report import build_report

    parents = {d.resolve().parent for d in args.run_dirs}
    out = args.out or (parents.pop() if len(parents) == 1 else Path("report"))
    print(f"report: {build_report(args.run_dirs, out, target_accuracy=args.target)}")
    return 0
