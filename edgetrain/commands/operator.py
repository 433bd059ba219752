"""The operator's commands: `submit`, `jobs` and `cancel` on a job server, `devices` (advertised
coordinators and their boards), `plan` (the hybrid plan for a fleet, explained) and `dashboard`
(the URLs of the dashboards served here)."""

from __future__ import annotations

import argparse
import sys

from edgetrain.config import parse_override


def operator_security(args: argparse.Namespace):
    """What `submit`, `jobs`, `cancel` and `devices` dial with: an operator credential, or nothing
    with --insecure."""
    from edgetrain import transport, trust

    if args.insecure:
        return transport.INSECURE
    return trust.operator_identity(args.identity, args.authority).security(trust.GATEWAY_SERVER_NAME)


def jobs(args: argparse.Namespace) -> int:
    """submit, jobs, cancel: queue a job on a job server, list its jobs, cancel one."""
    from coordinator.jobs.command import JobsCommandError, cancel_job, jobs_report, submit_job

    security = operator_security(args)
    try:
        if args.command == "submit":
            print(submit_job(args.config, [parse_override(o) for o in args.set], server=args.server,
                             cluster=args.cluster, interfaces=args.interface, security=security))
        elif args.command == "cancel":
            print(cancel_job(args.id, server=args.server, cluster=args.cluster, interfaces=args.interface,
                             security=security))
        else:
            print(jobs_report(server=args.server, cluster=args.cluster, interfaces=args.interface, as_json=args.json,
                              security=security))
    except JobsCommandError as e:
        print(f"edgetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


def devices(args: argparse.Namespace) -> int:
    """Print the advertised coordinators and their boards."""
    from coordinator.devices import devices_report

    print(devices_report(coordinator=args.coordinator, interfaces=args.interface, as_json=args.json,
                         security=operator_security(args)))
    return 0


def plan(args: argparse.Namespace) -> int:
    """Print the hybrid plan for a fleet, explained (or as JSON)."""
    from coordinator.planning.command import plan_report

    try:
        print(plan_report(args.fleet, model=args.model, objective=args.objective, batch=args.batch,
                          stage_state=args.stage_state, replicate=args.replicate, as_json=args.json,
                          remeasure=args.remeasure))
    except ValueError as e:
        print(f"edgetrain plan: error: {e}", file=sys.stderr)
        return 2
    return 0


def dashboard_urls(args: argparse.Namespace) -> int:
    """Print each live dashboard's URL: a coordinator or job server writes it (owner-only) while
    its page is served and removes it when the page closes."""
    files = sorted({*args.runs_dir.glob("*/dashboard.url"), *args.runs_dir.glob("*/job-server/dashboard.url"),
                    *(d / "dashboard.url" for d in args.state_dir if (d / "dashboard.url").exists())})
    found = [(f.parent.name if f.parent.name != "job-server" else f"{f.parent.parent.name} (job server)",
              f.read_text().strip()) for f in files]
    if not found:
        where = ", ".join(str(p) for p in [args.runs_dir, *args.state_dir])
        print(f"edgetrain dashboard: no dashboard is being served from {where} (start one with --dashboard, "
              f"or pass --runs-dir / --state-dir)", file=sys.stderr)
        return 1
    for name, url in found:
        print(f"{name}  {url}")
    return 0
