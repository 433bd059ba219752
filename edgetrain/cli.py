"""The `edgetrain` command: the one face above both roles.

  edgetrain coordinator --config JOB.yaml      serve a job and drive its training
  edgetrain client [--coordinator HOST:PORT]   run this board's part of the job (mDNS finds it)
  edgetrain devices [--json]                   advertised coordinators and their boards
  edgetrain local JOB.yaml --speeds 0.5,0.3    coordinator + emulated boards on this machine
  edgetrain demo                               the demo job on 4 emulated boards
  edgetrain fleet up FLEET.yaml | down NAME    an emulated fleet (namespaces, links, batteries)
  edgetrain plan FLEET.yaml [--model M]        the hybrid plan for a fleet, explained
  edgetrain coordinator --jobs                 a job server: several jobs share the fleet
  edgetrain submit JOB.yaml | jobs | cancel ID its jobs: queue one, list them, cancel one
  edgetrain init                               make the fleet authority on the gateway (CA, first token)
  edgetrain data import cifar10 ARCHIVE        place CIFAR-10 on the gateway; boards fetch what they need
  edgetrain data import imagefolder DIR --name N   your own images (one folder per class), decoded once
  edgetrain token new | list | revoke ID       join tokens for boards
  edgetrain boards list | revoke NAME          paired boards; a revoked board is refused from its next call
  edgetrain operator add NAME --out FILE       an operator credential for another machine
  edgetrain experiment run EXP.yaml            an experiment's arms on a fleet, then its report
  edgetrain report RUN_DIR...                  results.csv, report.md and plots from finished runs
  edgetrain dashboard                          the URLs (with their access tokens) of the dashboards served here

This module is the parser and the dispatch; the handlers live in edgetrain/commands/. Role
modules and torch are imported by the handler that needs them, never at the top: `--help`,
`devices`, `submit`, `jobs`, `cancel`, `dashboard` and `fleet down` start without torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# gRPC's C core logs informational lines (e.g. every refused TLS handshake) to stderr by default;
# a refusal reaches the user as one line of ours instead. `-v` turns them back on.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from edgetrain.allocator import keep_freed_memory  # noqa: E402
from edgetrain.commands import authority, emulated, operator, roles  # noqa: E402
from edgetrain.config import ConfigError  # noqa: E402
from edgetrain.dataset_import import add_data_arguments, run_data_command  # noqa: E402
from edgetrain.emulator.launch import DEMO_JOB, DEMO_SPEEDS  # noqa: E402
from edgetrain.trust import TrustError  # noqa: E402


def _speeds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, e.g. 0.5,0.3, got {text!r}") from None


def _dashboard(text: str) -> str:
    """HOST:PORT for a dashboard (port 0: any free one), or "none"."""
    host, _, port = text.rpartition(":")
    if text == "none" or (host and port.isdigit() and int(port) < 65536):
        return text
    raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:8080, port 0: any free one), got {text!r}")


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected a duration such as 30m, 24h or 7d, got {text!r}") from None


def _authority_arg(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--authority", type=Path, default=None, metavar="DIR",
                     help="the fleet authority's directory (default: $EDGETRAIN_HOME/authority, ~/.edgetrain)")


def _insecure_arg(cmd: argparse.ArgumentParser, who: str) -> None:
    cmd.add_argument("--insecure", action="store_true",
                     help=f"{who} without TLS or authentication (loopback experiments only; prints a warning)")


def _memory_arg(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--return-freed-memory", action="store_true",
                     help="give freed memory back to the system as soon as glibc's defaults do (lower resident "
                          "memory between steps; by default it is kept for the next step, which saves a page fault "
                          "per 4 KiB of every buffer a step allocates)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgetrain", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="serve a training job")
    coord.add_argument("--config", type=Path, default=DEMO_JOB, help="job YAML (default: the demo job)")
    coord.add_argument("--jobs", action="store_true",
                       help="serve as a job server: jobs are submitted with `edgetrain submit` and share the boards")
    coord.add_argument("--state-dir", type=Path, default=Path(".jobs"), help="with --jobs: where jobs are kept")
    coord.add_argument("--scheduler", default="rolling", choices=("rolling", "fifo", "first_fit", "static"),
                       help="with --jobs: how jobs get boards (default rolling)")
    coord.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a job setting, e.g. training.steps=20 (repeatable)")
    coord.add_argument("--bind", default="0.0.0.0:50051", help="address to serve on (port 0: any free port)")
    coord.add_argument("--port-file", help="write the bound host:port here once serving")
    coord.add_argument("--data-dir", default="data", help="dataset directory (for evaluation)")
    coord.add_argument("--runs-dir", default="runs", help="results go to RUNS_DIR/<job name>/")
    resume = coord.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the run's newest complete checkpoint; an error (exit 2) when there is none")
    resume.add_argument("--resume-or-start", action="store_true",
                        help="continue from the run's newest complete checkpoint, or start from step 0 without one")
    coord.add_argument("--cluster", default="edgetrain", help="cluster name advertised over mDNS")
    coord.add_argument("--advertise", action="append", default=None, metavar="IP",
                       help="advertise over mDNS on this interface address (repeatable; default: the bind "
                            "address, or every LAN interface for a wildcard bind)")
    coord.add_argument("--no-advertise", action="store_true", help="do not advertise over mDNS")
    coord.add_argument("--pair-bind", default=None, metavar="HOST:PORT",
                       help="where boards pair with a join token (default: the next port, or any with port 0)")
    coord.add_argument("--dashboard", default=None, metavar="HOST:PORT", type=_dashboard,
                       help="serve the live dashboard and Prometheus /metrics here (port 0: any free port); "
                            "its URL, with the access token, is printed and written to RUNS_DIR/<job>/dashboard.url "
                            "(a job server: STATE_DIR/dashboard.url)")
    _authority_arg(coord)
    _memory_arg(coord)
    _insecure_arg(coord, "serve")

    client = sub.add_parser("client", help="run this board's part of a job")
    client.add_argument("--coordinator", metavar="HOST:PORT",
                        help="coordinator address (default: find it over mDNS)")
    client.add_argument("--cluster", help="with several advertised coordinators, join this cluster")
    client.add_argument("--interface", action="append", default=None, metavar="IP",
                        help="browse mDNS on this interface address (repeatable; default: all LAN interfaces)")
    client.add_argument("--emulate", type=Path, metavar="BOARD.yaml",
                        help="emulate a board: speed, link, battery (written by `edgetrain fleet`)")
    client.add_argument("--power-watts", type=float, nargs=2, metavar=("IDLE", "BUSY"),
                        help="the board's power draw idle and training, W, for energy accounting")
    client.add_argument("--stage-bind", default="0.0.0.0:0", metavar="HOST:PORT",
                        help="where to serve pipeline traffic from neighbouring boards (default: any free port)")
    client.add_argument("--probe-interval", type=float, default=30.0, metavar="S",
                        help="probe the link this often when no large transfer measured it")
    client.add_argument("--name", default=None, help="device name (default: the hostname)")
    client.add_argument("--speed", type=float, default=None,
                        help="emulate a board with this fraction of one core (cgroup quota as root)")
    client.add_argument("--threads", type=int, default=None, help="torch threads (default: all, or per --speed)")
    client.add_argument("--data-dir", default="data", help="dataset directory (and the board's caches)")
    client.add_argument("--download", action="store_true", help="download CIFAR-10 if missing (needs internet)")
    client.add_argument("--deterministic", action="store_true",
                        help="on a GPU: no TF32, deterministic kernels (slower; to check it against a CPU)")
    client.add_argument("--local-data", metavar="DIR", default=None,
                        help="train only on this board's own images: a folder with one sub-folder of images per "
                             "class, decoded once; the images never leave the board")
    client.add_argument("--join", metavar="TOKEN", default=os.environ.get("EDGETRAIN_JOIN_TOKEN"),
                        help="pair with the gateway using this join token (or @FILE, or $EDGETRAIN_JOIN_TOKEN); "
                             "needed once, later starts use the stored certificate")
    client.add_argument("--identity", type=Path, default=None, metavar="DIR",
                        help="where this board keeps its key and certificate (default: $EDGETRAIN_HOME/boards/NAME)")
    client.add_argument("--give-up-after", type=_duration, default=None, metavar="DURATION",
                        help="stop (exit 6) after this long without reaching a coordinator (default: keep "
                             "trying; 90s, 10m, ...)")
    client.add_argument("--pair-address", metavar="HOST:PORT", default=None,
                        help="the gateway's pairing address (default: the coordinator's port + 1)")
    _memory_arg(client)
    _insecure_arg(client, "talk to an --insecure coordinator")

    submit = sub.add_parser("submit", help="queue a job at a job server")
    submit.add_argument("config", type=Path, help="job YAML (its schedule section says what it asks for)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job override")
    jobs = sub.add_parser("jobs", help="a job server's jobs: state, boards, planned start, predicted finish")
    jobs.add_argument("--json", action="store_true", help="machine-readable output")
    cancel = sub.add_parser("cancel", help="cancel a job at a job server")
    cancel.add_argument("id", help="job id (see `edgetrain jobs`)")
    for cmd in (submit, jobs, cancel):
        cmd.add_argument("--server", metavar="HOST:PORT", help="job server (default: find it over mDNS)")
        cmd.add_argument("--cluster", help="with several advertised servers, this cluster's")
        cmd.add_argument("--interface", action="append", default=None, metavar="IP", help="mDNS interface")

    devices = sub.add_parser("devices", help="advertised coordinators and their registered boards")
    devices.add_argument("--coordinator", metavar="HOST:PORT", help="ask this coordinator (default: all found)")
    devices.add_argument("--interface", action="append", default=None, metavar="IP", help="mDNS interface")
    devices.add_argument("--json", action="store_true", help="machine-readable output")
    for cmd in (submit, jobs, cancel, devices):
        cmd.add_argument("--identity", type=Path, default=None, metavar="FILE",
                         help="operator credential (default: $EDGETRAIN_HOME/operator.pem, or the gateway's own)")
        _authority_arg(cmd)
        _insecure_arg(cmd, "call an --insecure server")

    init = sub.add_parser("init", help="make the fleet authority on the gateway: CA, certificates, a join token")
    init.add_argument("--fleet", default="edgetrain", help="fleet name (in the CA's name)")
    add_data_arguments(sub.add_parser("data", help="datasets on the gateway: import CIFAR-10, CIFAR-format sets or "
                                                   "image folders for the boards"))
    token = sub.add_parser("token", help="join tokens: new, list, revoke")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_new = token_sub.add_parser("new", help="a join token (printed once; only its hash is kept)")
    token_new.add_argument("--ttl", type=_duration, default=24 * 3600.0, help="lifetime (default 24h; 30m, 7d, ...)")
    token_new.add_argument("--uses", type=int, default=1, help="how many boards may pair with it (default 1)")
    token_new.add_argument("--note", default="", help="what the token is for")
    token_sub.add_parser("list", help="tokens with their expiry and uses left")
    token_revoke = token_sub.add_parser("revoke", help="revoke a token before it is used")
    token_revoke.add_argument("id", help="token id (its first 6 characters)")
    boards = sub.add_parser("boards", help="paired boards: list, revoke")
    boards_sub = boards.add_subparsers(dest="boards_command", required=True)
    boards_sub.add_parser("list", help="certificates issued, with role, expiry and revocation")
    boards_revoke = boards_sub.add_parser("revoke", help="refuse a board from its next call on")
    boards_revoke.add_argument("name", help="board name")
    operator = sub.add_parser("operator", help="operator credentials: add")
    operator_sub = operator.add_subparsers(dest="operator_command", required=True)
    operator_add = operator_sub.add_parser("add", help="issue an operator credential (key, certificate, CA) file")
    operator_add.add_argument("name", help="operator name, e.g. alice-laptop")
    operator_add.add_argument("--out", type=Path, required=True, help="where to write it (0600; keep it secret)")
    for cmd in (init, token_new, token_revoke, boards_revoke, operator_add, *token_sub.choices.values(),
                *boards_sub.choices.values()):
        if not any(a.dest == "authority" for a in cmd._actions):
            _authority_arg(cmd)

    page = sub.add_parser("dashboard", help="the URLs, access tokens included, of the dashboards served on this "
                                            "machine (from their owner-only dashboard.url files)")
    page.add_argument("--runs-dir", type=Path, default=Path("runs"),
                      help="where runs (and fleets' job servers) keep their files (default: runs)")
    page.add_argument("--state-dir", type=Path, action="append", default=[], metavar="DIR",
                      help="a job server's --state-dir to look in too (repeatable)")

    fleet = sub.add_parser("fleet", help="emulated fleets on this machine")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True)
    for name in ("up", "down", "supervise"):
        cmd = fleet_sub.add_parser(name, help=argparse.SUPPRESS if name == "supervise" else f"fleet {name}")
        cmd.add_argument("fleet", help="fleet YAML (up) or fleet name / YAML (down)")
        cmd.add_argument("--state-dir", type=Path, default=Path(".fleet"), help="where fleet state is kept")
        cmd.add_argument("--runs-dir", type=Path, default=Path("runs"), help="results directory")
        cmd.add_argument("--data-dir", type=Path, default=Path("data"), help="dataset directory")
        if name != "down":
            cmd.add_argument("--dashboard", default="127.0.0.1:0", metavar="HOST:PORT", type=_dashboard,
                             help="where the fleet's coordinator serves its live dashboard (default: a free port "
                                  "on 127.0.0.1; 'none': no dashboard)")
        _insecure_arg(cmd, "run the fleet")

    plan = sub.add_parser("plan", help="the plan the coordinator would choose for a fleet file, explained")
    plan.add_argument("fleet", type=Path, help="fleet YAML (its boards: speed, link, battery)")
    plan.add_argument("--model", default=None, help="model (default: the fleet's job's)")
    plan.add_argument("--objective", default="time",
                      help="time, energy, pareto (the time/energy front), or a weight of energy in [0, 1]")
    plan.add_argument("--batch", type=int, default=None, help="global batch (default: the fleet's job's)")
    plan.add_argument("--stage-state", choices=("hosts", "coordinator"), default="hosts",
                      help="where single-host stages keep parameters and optimizer state")
    plan.add_argument("--no-replicate", dest="replicate", action="store_false",
                      help="with --stage-state hosts: no replica of owned stages on the coordinator "
                           "(pipeline.replicate: false), so their gradients do not go up every step")
    plan.add_argument("--json", action="store_true", help="one JSON object")
    plan.add_argument("--remeasure", action="store_true",
                      help="measure this machine again instead of using the figures kept from an earlier run")

    for name, help_text in (("local", "a job on emulated boards on this machine"),
                            ("demo", "the demo job on 4 emulated boards")):
        local = sub.add_parser(name, help=help_text)
        if name == "local":
            local.add_argument("config", type=Path, help="job YAML")
        local.add_argument("--speeds", type=_speeds, default=DEMO_SPEEDS,
                           help="emulated board speeds, comma-separated (default 0.5,0.3,0.2,0.1)")
        local.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job override")
        local.add_argument("--dataset", metavar="NAME", default=None,
                           help="train on this imported dataset (`edgetrain data import ... --name NAME`), all of "
                                "its samples, instead of the job's")
        local.add_argument("--data-dir", type=Path, default=Path("data"), help="dataset directory")
        local.add_argument("--runs-dir", type=Path, default=Path("runs"), help="results directory")
        local.add_argument("--dashboard", default="127.0.0.1:0", metavar="HOST:PORT", type=_dashboard,
                           help="where the live dashboard listens (default: a free port on 127.0.0.1; "
                                "'none': no dashboard)")
        _insecure_arg(local, "run the coordinator and boards")

    experiment = sub.add_parser("experiment", help="experiments: arms run to one stop rule and compared")
    experiment_sub = experiment.add_subparsers(dest="experiment_command", required=True)
    run = experiment_sub.add_parser("run", help="run an experiment file's arms, then write its report")
    run.add_argument("experiment", type=Path, help="experiment YAML (see docs/experiments.md)")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--fleet", type=Path, help="emulated fleet YAML (replaces the file's fleet)")
    where.add_argument("--live", action="store_true", help="run EdgeTrain arms as jobs on a live job server")
    run.add_argument("--server", metavar="HOST:PORT", default=os.environ.get("EDGETRAIN_SERVER"),
                     help="with --live: the job server (default $EDGETRAIN_SERVER)")
    run.add_argument("--out", type=Path, help="results directory (default results/<experiment name>/)")
    run.add_argument("--arms", type=lambda text: tuple(a.strip() for a in text.split(",") if a.strip()),
                     default=(), metavar="A,B", help="run only these arms")
    run.add_argument("--insecure", action="store_true",
                     help="allow the gloo DDP baseline (no authentication) where it is not allowed by default")
    run.add_argument("--data-dir", type=Path, default=Path("data"), help="dataset directory")
    report = sub.add_parser("report", help="results.csv, report.md and plots from finished run directories")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    report.add_argument("--out", type=Path, help="where to write them (default: the run directories' parent)")
    report.add_argument("--target", type=float, default=None, metavar="ACC",
                        help="target accuracy (default: the one the runs' arm.json record)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `edgetrain` console script."""
    args = _parser().parse_args(argv)
    if args.verbose:
        os.environ["GRPC_VERBOSITY"] = "INFO"
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if getattr(args, "return_freed_memory", True) is False:  # the long-running roles (_memory_arg)
        keep_freed_memory()
    handlers = {"coordinator": roles.coordinator, "client": roles.client, "local": emulated.local,
                "demo": emulated.local, "data": run_data_command, "devices": operator.devices,
                "fleet": emulated.fleet, "plan": operator.plan, "submit": operator.jobs, "jobs": operator.jobs,
                "cancel": operator.jobs, "init": authority.records, "token": authority.records,
                "boards": authority.records, "operator": authority.records, "experiment": emulated.experiment,
                "report": emulated.report, "dashboard": operator.dashboard_urls}
    try:
        return handlers[args.command](args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"edgetrain: error: {e}", file=sys.stderr)
        return 2
    except (TrustError, PermissionError) as e:
        print(f"edgetrain {args.command}: {e}", file=sys.stderr)
        return 5
    except ConnectionError as e:  # a peer stayed unreachable for the whole retry budget
        print(f"edgetrain {args.command}: {e}", file=sys.stderr)
        return 6
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader stopped early (`edgetrain plan ... | head`): not an error to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail too
        return 141
