"""The `edgetrain` command: the one face above both roles.

  edgetrain coordinator --config JOB.yaml      serve a job and drive its training
  edgetrain client --coordinator HOST:PORT     run this board's part of the job
  edgetrain local JOB.yaml --speeds 0.5,0.3    coordinator + emulated boards on this machine
  edgetrain demo                               the demo job on 4 emulated boards
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from edgetrain.config import ConfigError, load_job, parse_override
from edgetrain.launch import DEMO_JOB, DEMO_SPEEDS, LocalRun, run_local


def _speeds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, e.g. 0.5,0.3, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgetrain", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="serve a training job")
    coord.add_argument("--config", type=Path, default=DEMO_JOB, help="job YAML (default: the demo job)")
    coord.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a job setting, e.g. training.steps=20 (repeatable)")
    coord.add_argument("--bind", default="0.0.0.0:50051", help="address to serve on (port 0: any free port)")
    coord.add_argument("--port-file", help="write the bound host:port here once serving")
    coord.add_argument("--data-dir", default="data", help="dataset directory (for evaluation)")
    coord.add_argument("--runs-dir", default="runs", help="results go to RUNS_DIR/<job name>/")
    coord.add_argument("--resume", action="store_true", help="continue from the run's checkpoint")

    client = sub.add_parser("client", help="run this board's part of a job")
    client.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="coordinator address")
    client.add_argument("--name", default=None, help="device name (default: the hostname)")
    client.add_argument("--speed", type=float, default=None,
                        help="emulate a board with this fraction of one core (cgroup quota as root)")
    client.add_argument("--threads", type=int, default=None, help="torch threads (default: all, or per --speed)")
    client.add_argument("--data-dir", default="data", help="dataset directory")
    client.add_argument("--download", action="store_true", help="download CIFAR-10 if missing (needs internet)")

    for name, help_text in (("local", "a job on emulated boards on this machine"),
                            ("demo", "the demo job on 4 emulated boards")):
        local = sub.add_parser(name, help=help_text)
        if name == "local":
            local.add_argument("config", type=Path, help="job YAML")
        local.add_argument("--speeds", type=_speeds, default=DEMO_SPEEDS,
                           help="emulated board speeds, comma-separated (default 0.5,0.3,0.2,0.1)")
        local.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job override")
        local.add_argument("--data-dir", type=Path, default=Path("data"), help="dataset directory")
        local.add_argument("--runs-dir", type=Path, default=Path("runs"), help="results directory")
    return parser


def _coordinator(args: argparse.Namespace) -> int:
    from coordinator.main import run_coordinator

    job = load_job(args.config, dict(parse_override(o) for o in args.set))
    run_coordinator(job, bind=args.bind, data_dir=args.data_dir, runs_dir=args.runs_dir,
                    port_file=args.port_file, resume=args.resume)
    return 0


def _client(args: argparse.Namespace) -> int:
    import socket

    from edge_client.main import run_client
    from edge_client.worker import ClientOptions

    options = ClientOptions(name=args.name or socket.gethostname(), data_dir=args.data_dir,
                            download=args.download, emulated_speed=args.speed)
    run_client(args.coordinator, options, threads=args.threads)
    return 0


def _local(args: argparse.Namespace) -> int:
    job_file = getattr(args, "config", DEMO_JOB)
    job = load_job(job_file, dict(parse_override(o) for o in args.set))
    run = LocalRun(job_file=job_file, speeds=args.speeds, overrides=tuple(args.set), runs_dir=args.runs_dir,
                   data_dir=args.data_dir)
    code = run_local(run, job_name=job.name)
    if code == 0:
        print(f"results: {args.runs_dir / job.name}/ (metrics.jsonl, summary.json, checkpoint)")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `edgetrain` console script."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    handlers = {"coordinator": _coordinator, "client": _client, "local": _local, "demo": _local}
    try:
        return handlers[args.command](args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"edgetrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
