"""Benchmark: the emulated fleet under faults — one clean run and one chaos run of the same job.

The fleet: four emulated boards (0.5, 0.3, 0.2, 0.1 of a core) training MobileNetV2 with a global
batch of 64 on SYNTHETIC CIFAR-shaped data (the demo job), with mutual TLS (a fresh fleet
authority per run; boards pair with one-use join tokens). As root, each board runs in its own
network namespace behind a bridge (edgetrain.emulator.netns) and the coordinator serves on the
bridge; otherwise everything is on loopback.

The chaos run, driven by the job's progress (metrics.jsonl):
- every `--kill-every` steps, kill -9 a random board (seeded) and start it again at once;
- once, cut a board's link for `--cut-s` seconds: its veth goes down (as root; otherwise the
  board's process is frozen with SIGSTOP for that long, which the coordinator sees the same way —
  silence — and which the output says);
- once, kill -9 the coordinator and start it again with `--resume` on the same address after
  `--down-s` seconds; the boards are left running and must come back by themselves.
Checkpoints use the default policy (every 60 s by time, and at the end).

Reported (last line: one JSON object):
- `kills`: board kills. `board_recovery_s`: per kill, from the kill to the moment every
  surviving board had taken the first step attempt opened without the victim (the redone attempt
  when it was in one), median; `redo_opened_s_each`: from the kill to that attempt's opening.
- `coordinator_recovery_s`: from the restart to the next completed step.
- `boards_rejoined`: fraction of the boards alive at the coordinator kill (and not killed
  since) that trained again on the restarted coordinator without being restarted.
- `lost_steps`, `doubled_steps`: judged on the model: the final checkpoint carries, with the
  model state, how many times each step's update was applied to it (0: lost, >1: doubled).
- `redone_steps`: steps computed again after the resume (the checkpoint policy bounds them).
- `false_lost`: boards declared lost in the clean run.
- `accuracy_clean`, `accuracy_chaos`: final test accuracy (synthetic test set), same seed.
- `heartbeat_p99_ms_at_256`: 256 light boards with their own certificates on one coordinator
  (edgetrain.emulator.fleet_load), heartbeat round trips.

    python scripts/bench_chaos.py [--steps 150] [--kill-every 12] [--cut-s 20] [--down-s 30] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from edgetrain.emulator.launch import EmulatedTrust, plain_demo_job
from edgetrain.emulator.netns import VirtualLan, netns_available
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm
from edgetrain.supervisor import edgetrain_command, terminate

SPEEDS = (0.5, 0.3, 0.2, 0.1)
NAMES = tuple(f"board{i}" for i in range(len(SPEEDS)))


def _free_port_pair(host: str) -> int:
    """A port P on `host` with P + 1 free too (the fleet port and the pairing port after it)."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind((host, 0))
            port = first.getsockname()[1]
            try:
                second.bind((host, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def read_records(run_dir: Path, kind: str = "train") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


class Fleet:
    """The processes of one run: a coordinator and the boards, on a virtual LAN or loopback."""

    def __init__(self, workdir: Path, job_file: Path, lan: VirtualLan | None) -> None:
        self.workdir, self.job_file, self.lan = workdir, job_file, lan
        self.trust = EmulatedTrust(workdir / "trust")
        self.host = lan.gateway_ip if lan else "127.0.0.1"
        self.port = _free_port_pair(self.host)
        self.address = f"{self.host}:{self.port}"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.coordinator: subprocess.Popen | None = None
        self.boards: dict[str, subprocess.Popen] = {}
        self.starts = 0

    def start_coordinator(self, resume: bool = False) -> float:
        self.starts += 1
        log = (self.logs / f"coordinator-{self.starts}.log").open("w")
        self.coordinator = subprocess.Popen(edgetrain_command(
            "coordinator", "--config", str(self.job_file), "--bind", self.address, "--no-advertise",
            "--runs-dir", str(self.workdir / "runs"), "--data-dir", str(self.workdir / "data"),
            *(["--resume"] if resume else []), *self.trust.gateway_args()), stdout=log, stderr=subprocess.STDOUT)
        return time.time()

    def start_board(self, name: str) -> None:
        args, env = self.trust.board(name)
        prefix = self.lan.exec_args(name) if self.lan else []
        with (self.logs / f"{name}.log").open("a") as log:
            self.boards[name] = subprocess.Popen([*prefix, *edgetrain_command(
                "client", "--coordinator", self.address, "--name", name, "--speed", f"{SPEEDS[NAMES.index(name)]:g}",
                "--data-dir", str(self.workdir / "data"), "--probe-interval", "5", *args)],
                stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill_board(self, name: str) -> float:
        self.boards[name].kill()
        killed = time.time()
        self.boards[name].wait()
        return killed

    def cut(self, name: str, seconds: float) -> None:
        """Cut the board's link (or freeze it without root) for `seconds`, in the background."""
        def run() -> None:
            if self.lan:
                self.lan.set_link_up(name, False)
            else:
                os.kill(self.boards[name].pid, signal.SIGSTOP)
            time.sleep(seconds)
            if self.lan:
                self.lan.set_link_up(name, True)
            else:
                os.kill(self.boards[name].pid, signal.SIGCONT)
        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        for proc in [*self.boards.values(), self.coordinator]:
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        terminate(*[p for p in [*self.boards.values(), self.coordinator] if p is not None], grace_s=15)


def _job_file(workdir: Path, steps: int, seed: int, smoke: bool = False) -> tuple[Path, str]:
    job = plain_demo_job()
    job["name"] = "chaos"
    job["seed"] = seed
    job["training"].update(steps=steps, eval_every=0, log_every=10)
    if smoke:  # a small model and data set; a checkpoint every second, so the coordinator can be resumed at once
        job["model"] = "small_cnn"
        job["dataset"].update(train_size=256, test_size=64)
        job["training"].update(global_batch=16, checkpoint_every_s=1.0)
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, job["name"]


def _wait(predicate, timeout_s: float, what: str, fleet: Fleet):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if fleet.coordinator is not None and fleet.coordinator.poll() not in (None, 0):
            raise RuntimeError(f"the coordinator exited with {fleet.coordinator.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _newest_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_records(run_dir)), default=-1)


def clean_run(workdir: Path, job_file: Path, name: str, lan: VirtualLan | None, timeout_s: float) -> dict:
    fleet = Fleet(workdir, job_file, lan)
    run_dir = workdir / "runs" / name
    try:
        fleet.start_coordinator()
        for board in NAMES:
            fleet.start_board(board)
        fleet.coordinator.wait(timeout=timeout_s)
    finally:
        fleet.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    lost = {d for r in read_records(run_dir) for d in r["failed"]}
    lost |= {d["device"] for d in summary["devices"] if d.get("left_reason")}
    return {"summary": summary, "false_lost": len(lost), "lost_devices": sorted(lost), "run_dir": run_dir}


def chaos_run(workdir: Path, job_file: Path, name: str, lan: VirtualLan | None, steps: int, args) -> dict:
    rng = random.Random(args.seed)
    fleet = Fleet(workdir, job_file, lan)
    run_dir = workdir / "runs" / name
    coordinator_at = steps // 2
    cut_at = max(5, steps // 5)
    cut_window = range(cut_at - 3, cut_at + 15)
    kill_steps = [s for s in range(args.kill_every // 2, steps - 10, args.kill_every)
                  if abs(s - coordinator_at) > 8 and s not in cut_window]
    kills: list[tuple[str, float]] = []
    cut_board = NAMES[1]
    events: list[str] = []
    try:
        fleet.start_coordinator()
        for board in NAMES:
            fleet.start_board(board)
        pending = sorted([(s, "kill") for s in kill_steps] + [(cut_at, "cut"), (coordinator_at, "coordinator")])
        restart_at = None
        alive_at_coordinator_kill: set[str] = set()
        for at, what in pending:
            _wait(lambda at=at: _newest_step(run_dir) >= at, args.timeout, f"step {at}", fleet)
            if what == "kill":
                victim = rng.choice([b for b in NAMES if b != cut_board])
                kills.append((victim, fleet.kill_board(victim)))
                alive_at_coordinator_kill.discard(victim)
                fleet.start_board(victim)
                events.append(f"step {at}: killed {victim} (restarted)")
            elif what == "cut":
                fleet.cut(cut_board, args.cut_s)
                events.append(f"step {at}: {'cut the link of' if lan else 'froze'} {cut_board} for {args.cut_s:g} s")
            else:  # the resume needs a checkpoint (by default one every 60 s of training)
                _wait(lambda: read_records(run_dir, "checkpoint"), args.timeout, "a first checkpoint", fleet)
                fleet.coordinator.kill()
                fleet.coordinator.wait()
                alive_at_coordinator_kill = set(NAMES)
                events.append(f"step {at}: killed the coordinator; restarting it with --resume in {args.down_s:g} s")
                time.sleep(args.down_s)
                restart_at = fleet.start_coordinator(resume=True)
                resumed = _wait(lambda: read_records(run_dir, "resume"), 120, "the resume record", fleet)
                resumed_step = resumed[-1]["from_step"]
                _wait(lambda since=restart_at: any(r["time"] > since for r in read_records(run_dir)), 120,
                      "a step on the restarted coordinator", fleet)
        fleet.coordinator.wait(timeout=args.timeout)
    finally:
        fleet.close()
    records = read_records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    recoveries, opened = [], []
    for victim, killed in kills:
        later = [e for r in records for e in r["attempt_log"] if e["opened"] > killed
                 and not any(b.rsplit("-", 1)[0] == victim for b in e["boards"])]
        if later:
            first = min(later, key=lambda e: e["opened"])
            opened.append(first["opened"] - killed)
            recoveries.append(max(first["taken"].values(), default=first["opened"]) - killed)
    after = [r for r in records if r["time"] > restart_at] if restart_at else []
    first_after = min((r["time"] for r in after), default=None)
    came_back = {d.rsplit("-", 1)[0] for r in after for d in r["devices"]}
    seen: dict[int, int] = {}
    for r in records:
        seen[r["step"]] = seen.get(r["step"], 0) + 1
    return {"summary": summary, "kills": len(kills), "recoveries": recoveries, "opened": opened,
            "coordinator_recovery_s": None if first_after is None else first_after - restart_at,
            "rejoined": len(came_back & alive_at_coordinator_kill) / max(1, len(alive_at_coordinator_kill)),
            "redone_steps": sum(n - 1 for n in seen.values()), "resumed_from": resumed_step if restart_at else None,
            "events": events, "run_dir": run_dir}


def ledger_counts(run_dir: Path, steps: int) -> tuple[int, int]:
    """(lost, doubled) steps, from the final checkpoint's record of the updates applied to its model."""
    from coordinator.training.checkpoint import read_ledger

    ledger = read_ledger(run_dir)[:steps]
    return sum(1 for n in ledger if n == 0), sum(1 for n in ledger if n > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-every", type=int, default=12, help="steps between two board kills")
    parser.add_argument("--cut-s", type=float, default=20.0, help="how long a board's link is cut")
    parser.add_argument("--down-s", type=float, default=30.0, help="how long the coordinator stays dead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="longest a run may take")
    parser.add_argument("--load-boards", type=int, default=256, help="light boards of the load phase (0: skip)")
    parser.add_argument("--load-seconds", type=float, default=20.0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs and logs in this directory")
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:  # 30 steps of a small model: one board kill, a 1 s cut, the coordinator down 1 s; 8 light boards
        args.steps, args.kill_every, args.cut_s, args.down_s = 30, 4, 1.0, 1.0
        args.timeout, args.load_boards, args.load_seconds = 300.0, 8, 2.0
    stop_on_sigterm()

    use_lan, why = netns_available()
    network = "network namespaces (link cuts are real)" if use_lan else \
        f"loopback ({why}: a link cut freezes the board instead)"
    print(f"fleet: {len(SPEEDS)} emulated boards {SPEEDS} of a core, MobileNetV2, SYNTHETIC CIFAR-shaped data, "
          f"{args.steps} steps; {network}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        tmp = Path(tmp)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        results = {}
        for arm in ("clean", "chaos"):
            workdir = tmp / arm
            workdir.mkdir()
            job_file, name = _job_file(workdir, args.steps, args.seed, args.smoke)
            lan = VirtualLan(name=f"ch{arm[:2]}{os.getpid() % 10000}") if use_lan else None
            try:
                if lan:
                    lan.create()
                    for i, board in enumerate(NAMES, start=1):
                        lan.add_host(board, i)
                started = time.monotonic()
                if arm == "clean":
                    results[arm] = clean_run(workdir, job_file, name, lan, args.timeout)
                else:
                    results[arm] = chaos_run(workdir, job_file, name, lan, args.steps, args)
                results[arm]["seconds"] = time.monotonic() - started
                results[arm]["ledger"] = ledger_counts(results[arm]["run_dir"], args.steps)
            finally:
                if lan:
                    lan.destroy()
            print(f"{arm}: {results[arm]['seconds']:.0f} s, test accuracy "
                  f"{results[arm]['summary']['test_accuracy']:.4f} (synthetic data)", flush=True)
        for line in results["chaos"]["events"]:
            print(f"  {line}")
        heartbeat_p99 = None
        if args.load_boards:
            from edgetrain.emulator.fleet_load import run_fleet_load

            load = run_fleet_load(boards=args.load_boards, seconds=args.load_seconds)
            heartbeat_p99 = load["p99_ms"]
            print(f"load: {args.load_boards} light boards, heartbeat p50 {load['p50_ms']:.1f} ms, "
                  f"p99 {load['p99_ms']:.1f} ms, {load['alive']} alive, {os.cpu_count()} cores")
    chaos, clean = results["chaos"], results["clean"]
    lost, doubled = chaos["ledger"]
    clean_lost, clean_doubled = clean["ledger"]
    row = {
        "kills": chaos["kills"], "lost_steps": lost, "redone_steps": chaos["redone_steps"], "doubled_steps": doubled,
        "board_recovery_s": round(statistics.median(chaos["recoveries"]), 2) if chaos["recoveries"] else None,
        "board_recovery_s_each": [round(r, 2) for r in chaos["recoveries"]],
        "redo_opened_s_each": [round(r, 2) for r in chaos["opened"]],
        "coordinator_recovery_s": None if chaos["coordinator_recovery_s"] is None
        else round(chaos["coordinator_recovery_s"], 2),
        "resumed_from_step": chaos["resumed_from"],
        "boards_rejoined": chaos["rejoined"], "false_lost": clean["false_lost"],
        "clean_lost_doubled": [clean_lost, clean_doubled],
        "accuracy_clean": clean["summary"]["test_accuracy"], "accuracy_chaos": chaos["summary"]["test_accuracy"],
        "heartbeat_p99_ms_at_256": heartbeat_p99, "link_cut": "veth down" if use_lan else "SIGSTOP freeze",
        "seconds_clean": round(clean["seconds"], 1), "seconds_chaos": round(chaos["seconds"], 1),
        "synthetic_data": True,
    }
    finish(__file__, row, args)


if __name__ == "__main__":
    sys.exit(main())
