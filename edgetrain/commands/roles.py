"""`edgetrain coordinator` and `edgetrain client`: serve a job (or a job server) on the gateway,
and run a board's part of it."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from edgetrain.config import load_job, parse_override


def coordinator(args: argparse.Namespace) -> int:
    """Serve a job (or, with --jobs, a job server) until it ends or SIGTERM arrives."""
    import threading

    from coordinator.main import run_coordinator
    from coordinator.training.checkpoint import CheckpointError
    from coordinator.training.rounds import JobAborted
    from edgetrain.discovery import default_interfaces
    from edgetrain.trust import gateway_authority

    authority = gateway_authority(args.authority, insecure=args.insecure)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # end the job cleanly: boards are told it ended
    host = args.bind.rsplit(":", 1)[0]
    advertise = None if args.no_advertise else (
        args.advertise or (default_interfaces() if host in ("0.0.0.0", "") else [host]))
    if args.jobs:
        from coordinator.jobs.servicer import serve_jobs

        serve_jobs(bind=args.bind, state_dir=args.state_dir, runs_dir=args.runs_dir, data_dir=args.data_dir,
                   scheduler=args.scheduler, port_file=args.port_file, stop=stop, cluster=args.cluster,
                   advertise=advertise, authority=authority, pair_bind=args.pair_bind,
                   dashboard=None if args.dashboard == "none" else args.dashboard)
        return 0
    job = load_job(args.config, dict(parse_override(o) for o in args.set))
    try:
        run_coordinator(job, bind=args.bind, data_dir=args.data_dir, runs_dir=args.runs_dir, port_file=args.port_file,
                        resume=args.resume, resume_or_start=args.resume_or_start, stop=stop, cluster=args.cluster,
                        advertise=advertise, authority=authority, pair_bind=args.pair_bind,
                        dashboard=None if args.dashboard == "none" else args.dashboard)
    except CheckpointError as e:
        print(f"edgetrain coordinator: error: {e}", file=sys.stderr)
        return 2
    except JobAborted as e:
        print(f"edgetrain coordinator: job {job.name} stopped: {e}", file=sys.stderr)
        return 4
    return 0


def client(args: argparse.Namespace) -> int:
    """Run this board's part of the coordinator's job; exit 3 when the battery ran empty."""
    import socket

    from edge_client.main import BATTERY_EMPTY, run_client
    from edge_client.worker import ClientOptions

    join = args.join
    if join and join.startswith("@"):
        join = Path(join[1:]).read_text().strip()
    options = ClientOptions(name=args.name or socket.gethostname(), data_dir=args.data_dir,
                            identity=args.identity, join_token=join, insecure=args.insecure,
                            pair_address=args.pair_address, give_up_after_s=args.give_up_after,
                            download=args.download, emulated_speed=args.speed,
                            probe_interval_s=args.probe_interval, stage_bind=args.stage_bind,
                            power_w=tuple(args.power_watts) if args.power_watts else None,
                            local_data=args.local_data, deterministic=args.deterministic)
    where = {"threads": args.threads, "cluster": args.cluster, "interfaces": args.interface}
    if args.emulate or args.speed:  # an emulated board: its throttle, link and battery installed here
        from edgetrain.emulator.board import run_emulated_client

        reason = run_emulated_client(args.coordinator, options,
                                     board_file=str(args.emulate) if args.emulate else None,
                                     speed=args.speed, **where)
    else:
        reason = run_client(args.coordinator, options, **where)
    return 3 if reason == BATTERY_EMPTY else 0
