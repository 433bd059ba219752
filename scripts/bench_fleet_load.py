"""Benchmark: one coordinator holding hundreds of boards' registration and telemetry.

Light fake boards (edgetrain/emulator/light_boards.py) in several processes, each board its own thread,
channel and certificate under the run's fleet CA, register with a real coordinator (`python -m
edgetrain coordinator`, mutual TLS, a job that never starts training), report a SYNTHETIC
profile, send a heartbeat with SYNTHETIC telemetry every second and, as idle real boards do,
hold their presence stream open and long-poll for work. Measured: the heartbeat round trips the boards see (p50/p99/max over every
heartbeat of the window) and how many boards the coordinator lists as alive at its end
(ListDevices as the operator). Target: p99 < 100 ms at 256 boards.

Everything runs on this machine: the boards' processes take CPU from the coordinator they
measure, and other work on the machine does too — the table gives the cores each side used, the
load average (before -> after the window) and how late an idle thread woke meanwhile (wake p99,
ms: scheduling delay alone), and the runs of one size are repeated to show the spread.

    python scripts/bench_fleet_load.py [--boards 64,128,256] [--processes 8] [--seconds 20] [--repeat 3] [--smoke] [--record]
                                       [--heartbeats-only]

The last line printed is one JSON object (the largest fleet's median run, and every run).
"""

from __future__ import annotations

import argparse
import os
import time

from edgetrain.emulator.fleet_load import SYNTHETIC_NOTE, run_fleet_load
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm

TARGET_P99_MS = 100.0
COLUMNS = (("boards", 7), ("processes", 6), ("alive", 6), ("heartbeats", 11), ("heartbeat_errors", 7),
           ("p50_ms", 8), ("p99_ms", 9), ("max_ms", 9), ("coordinator_cpu_cores", 12), ("boards_cpu_cores", 12),
           ("wakeup_p99_ms", 11), ("load_average", 13))
HEADERS = ("boards", "procs", "alive", "heartbeats", "errors", "p50 ms", "p99 ms", "max ms", "coord cores",
           "board cores", "wake p99", "load avg")


def _row(values: list[str]) -> str:
    return "".join(f"{v:>{width}}" for v, (_, width) in zip(values, COLUMNS))


def _cells(run: dict) -> list[str]:
    return [f"{run[key][0]:.1f}->{run[key][1]:.1f}" if key == "load_average" else
            "-" if run[key] is None else str(run[key]) for key, _ in COLUMNS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--boards", default="256", help="comma-separated fleet sizes (default 256)")
    parser.add_argument("--processes", type=int, default=8, help="light-board processes (at most one per board)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window per run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per fleet size")
    parser.add_argument("--heartbeats-only", action="store_true",
                        help="boards hold no presence stream and no work poll open")
    parser.add_argument("--board-nice", type=int, default=0,
                        help="run the boards' processes at this nice level (they stand for other machines)")
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.boards, args.processes, args.seconds, args.repeat = "8", 2, 2.0, 1
    stop_on_sigterm()
    sizes = [int(s) for s in args.boards.split(",") if s.strip()]
    polls = not args.heartbeats_only
    print(f"# {os.cpu_count()} cores shared by the coordinator and the boards"
          f"{f' (boards at nice {args.board_nice})' if args.board_nice else ''}; heartbeat every 1 s"
          f"{', presence stream and work poll held open' if polls else ', heartbeats only'}; {SYNTHETIC_NOTE}", flush=True)
    print(_row(list(HEADERS)), flush=True)
    started = time.monotonic()
    runs: list[dict] = []
    for boards in sizes:
        for _ in range(args.repeat):
            run = run_fleet_load(boards, min(args.processes, boards), args.seconds, idle_calls=polls,
                                 board_nice=args.board_nice)
            runs.append(run)
            print(_row(_cells(run)), flush=True)
    largest = [r for r in runs if r["boards"] == max(sizes)]
    median = sorted(largest, key=lambda r: r["p99_ms"] if r["p99_ms"] is not None else float("inf"))[
        (len(largest) - 1) // 2]
    met = median["p99_ms"] is not None and median["p99_ms"] < TARGET_P99_MS and median["alive"] == median["boards"]
    print(f"{median['boards']} boards: p99 {median['p99_ms']} ms (the median run of {len(largest)}: "
          f"{sorted(r['p99_ms'] for r in largest if r['p99_ms'] is not None)}), {median['alive']} alive; target p99 < {TARGET_P99_MS:.0f} ms {'met' if met else 'NOT met'}; "
          f"{time.monotonic() - started:.0f} s in all", flush=True)
    finish(__file__, {**{k: median[k] for k in ("boards", "processes", "cores", "alive", "p50_ms", "p99_ms",
                                                "max_ms", "idle_calls")},
                      "target_p99_ms": TARGET_P99_MS, "met": met, "synthetic": SYNTHETIC_NOTE, "runs": runs}, args)


if __name__ == "__main__":
    main()
