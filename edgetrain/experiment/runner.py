"""Run an experiment's arms and write what each did: `edgetrain experiment run EXP.yaml`.

On an emulated fleet (a fleet file) every arm runs with the same boards, one after another:
- an EdgeTrain arm as a real coordinator process and one client process per board of the fleet
  (`edgetrain client --emulate BOARD.yaml`: its speed as a CPU quota, its link shaped in the
  application, on loopback), under a fleet authority of the run's own (mutual TLS, boards
  pairing with one-use join tokens), as ``edgetrain.emulator.launch`` starts a local run;
- a baseline arm through ``edgetrain.experiment.baselines.run_baseline`` (DDP over gloo, which
  has no authentication, runs only there: on loopback or in namespaces the tool made);
- a trace arm as a job server (`edgetrain coordinator --jobs --scheduler S`) with the fleet's
  boards, fed the trace's jobs at their arrival times; it writes trace.json.
With `--live`, EdgeTrain arms are submitted as jobs to a running job server with this machine's
operator credential, and their run directories are copied from the server's runs directory when
it is on this machine. Baselines and traces are refused on a live fleet (see ``check_live``).

Every run directory gets arm.json (which arm, repeat, seed, the commit it ran, fleet, stop rule, when
it ran, its exit code, its set-up seconds); then ``edgetrain.experiment.report.build_report`` writes results.csv,
report.md and the plots beside them.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from edgetrain import supervisor
from edgetrain.emulator.launch import EmulatedTrust
from edgetrain.experiment.bench_output import commit_id
from edgetrain.experiment.spec import Arm, Experiment, Run, SpecError, Trace
from edgetrain.fleet_file import BoardSpec, FleetSpec, board_to_dict
from edgetrain.supervisor import edgetrain_command

logger = logging.getLogger(__name__)

RESULTS_DIR = Path("results")
"""Where results go by default: results/<experiment name>/."""
START_TIMEOUT_S = 300.0
"""Longest wait for a coordinator or job server to serve, and for a job server's boards to join."""
STOP_GRACE_S = 120.0
"""Past an arm's time cap (plus its start), how long its coordinator gets to end by itself (final
evaluation, checkpoint, summary) before it is stopped."""
POLL_S = 0.5
FINISHED_STATES = ("finished", "failed", "cancelled")


@dataclass(kw_only=True, frozen=True)
class Options:
    """How `edgetrain experiment run` was asked to run an experiment."""

    out_dir: Path | None = None
    """Results directory (default results/<name>/)."""
    arms: tuple[str, ...] = ()
    """Run only these arms (default all)."""
    live: bool = False
    """Run EdgeTrain arms as jobs on a live job server instead of an emulated fleet."""
    server: str | None = None
    """With live: the job server's HOST:PORT."""
    insecure: bool = False
    """Allow what needs no authentication where it is not the default (gloo DDP on a live fleet)."""
    data_dir: Path = Path("data")
    """Dataset directory shared by the coordinator and the emulated boards."""


@dataclass(frozen=True)
class Fleet:
    """What the arms run on: an emulated fleet (its spec), or a live job server's boards."""

    name: str
    boards: tuple[dict, ...]
    """{"name", "speed", "mbit_per_s", "idle_w", "busy_w"} per board (arm.json's fleet_boards)."""
    spec: FleetSpec | None = None
    """The emulated fleet's spec (None on a live fleet)."""


def emulated_fleet(spec: FleetSpec) -> Fleet:
    """The arm.json view of an emulated fleet: its boards with their speed, link and power."""
    return Fleet(name=spec.name, spec=spec, boards=tuple(_board_view(b) for b in spec.boards))


def _board_view(board: BoardSpec) -> dict:
    idle_w, busy_w = board.idle_w, board.busy_w
    try:  # the power model of every emulated board (idle and busy W from its figures, or by speed)
        from edgetrain.power import board_power
    except ModuleNotFoundError as e:
        if e.name != "edgetrain.power":
            raise
        if board.battery is not None:
            idle_w, busy_w = idle_w or board.battery.idle_w, busy_w or board.battery.busy_w
    else:
        power = board_power(board)
        idle_w, busy_w = power.idle_w, power.busy_w
    return {"name": board.name, "speed": board.speed, "mbit_per_s": board.link.mbit_per_s if board.link else None,
            "idle_w": idle_w, "busy_w": busy_w}


def check_live(arms: Sequence[Arm], *, insecure: bool) -> None:
    """Refuse, in one line and before anything runs, what a live fleet cannot run truthfully."""
    for arm in arms:
        if arm.baseline == "ddp" and not insecure:
            raise SpecError(f"arm {arm.name}: baseline ddp trains over gloo, which has no authentication: "
                            "on a live fleet it needs --insecure")
        if arm.baseline == "ddp":
            raise SpecError(f"arm {arm.name}: baseline ddp on live boards is not supported yet (it runs on an "
                            "emulated fleet: --fleet FLEET.yaml); --insecure does not change that")
        if arm.baseline:
            raise SpecError(f"arm {arm.name}: baseline {arm.baseline} on --live is not supported yet (the job "
                            "server does not run it on its boards); run it on an emulated fleet with --fleet")
        if arm.trace:
            raise SpecError(f"arm {arm.name}: a trace arm starts its own job server with its scheduler; "
                            "it runs on an emulated fleet (--fleet), not --live")


def live_fleet(server: str) -> Fleet:
    """The boards of the live job server at `server` (asked with this machine's operator credential)."""
    from edgetrain import transport, trust
    from edgetrain.job_client import JobServerClient

    security = trust.operator_identity(None, None).security(trust.GATEWAY_SERVER_NAME)
    with JobServerClient(server, security, timeout_s=30) as client:
        try:
            reply = client.list_jobs()
        except (grpc.RpcError, transport.Unreachable) as e:
            raise ConnectionError(f"job server {server}: {transport.describe(e)}") from None
    return Fleet(name=f"live {server}", boards=tuple(
        {"name": b.name, "speed": b.speed, "mbit_per_s": b.link_mbit_per_s, "idle_w": None, "busy_w": None}
        for b in reply.boards))


def _baselines_importable() -> bool:
    try:
        import edgetrain.experiment.baselines  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "edgetrain.experiment.baselines":
            raise
        return False
    return True


class Progress:
    """One tqdm bar per arm, fed from the run's metrics.jsonl (steps done / planned, the last
    test accuracy), or from a callback (baselines, traces)."""

    def __init__(self, label: str, total: int | None) -> None:
        from tqdm import tqdm

        self.steps_from_metrics = True
        """False once a callback (a baseline's progress) counts the steps: metrics.jsonl then
        gives only the accuracy."""
        self.bar = tqdm(total=total, desc=label, unit="step", mininterval=1.0, dynamic_ncols=True)
        self._offset = 0
        self._partial = b""
        self.first_step_start: float | None = None

    def set(self, done: int, total: int | None = None) -> None:
        """Steps (or trace steps) done of `total`."""
        if total is not None and total != self.bar.total:
            self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def accuracy(self, value: float) -> None:
        self.bar.set_postfix(acc=f"{value:.3f}", refresh=True)

    def follow(self, metrics: Path) -> None:
        """Read the records written since the last call."""
        try:
            with metrics.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "train":
                if self.first_step_start is None:
                    self.first_step_start = record["time"] - record.get("step_s", 0.0)
                if self.steps_from_metrics:
                    self.set(int(record["step"]) + 1)
            elif record.get("kind") == "eval" and record.get("test_accuracy") is not None:
                self.accuracy(float(record["test_accuracy"]))

    def close(self) -> None:
        self.bar.close()


def _planned_steps(run: Run) -> int | None:
    """Steps the bar counts to (None under a time or accuracy rule: the step count is a cap)."""
    training = run.job["training"]
    return None if training.get("target_accuracy") or training.get("time_limit_s") else int(training["steps"])


def _free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P on `host` with P + 1 free too (the coordinator's port and its pairing port), so
    the boards can be started with its address before it serves."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind((host, 0))
            port = first.getsockname()[1]
            try:
                second.bind((host, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


class _Processes:
    """A coordinator (or job server) and one client process per board, on loopback."""

    def __init__(self, run_dir: Path, fleet: FleetSpec, data_dir: Path) -> None:
        self.run_dir, self.fleet, self.data_dir = run_dir, fleet, data_dir
        self.launch = run_dir / "launch"
        self.logs = run_dir / "logs"
        (self.launch / "boards").mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.trust = EmulatedTrust(self.launch / "trust")
        self.server: subprocess.Popen | None = None
        self.boards: list[subprocess.Popen] = []

    def start_server(self, *role: str) -> str:
        """Start `edgetrain coordinator ROLE...` on 127.0.0.1 at a free port (pairing on the next);
        its address. The boards may start at once: they keep dialing until it serves."""
        self.address = f"127.0.0.1:{_free_port_pair()}"
        with (self.logs / "coordinator.log").open("w") as log:
            self.server = subprocess.Popen(edgetrain_command(
                "coordinator", *role, "--bind", self.address, "--no-advertise", "--data-dir", str(self.data_dir),
                *self.trust.gateway_args()), stdout=log, stderr=subprocess.STDOUT)
        return self.address

    def start_boards(self, address: str) -> None:
        """One `edgetrain client --emulate BOARD.yaml` per board of the fleet."""
        for board in self.fleet.boards:
            board_file = self.launch / "boards" / f"{board.name}.yaml"
            board_file.write_text(yaml.safe_dump(board_to_dict(board)))
            credentials, env = self.trust.board(board.name)
            with (self.logs / f"{board.name}.log").open("w") as log:
                self.boards.append(subprocess.Popen(edgetrain_command(
                    "client", "--coordinator", address, "--name", board.name, "--emulate", str(board_file),
                    "--threads", "1", "--probe-interval", f"{self.fleet.probe_interval_s:g}",
                    "--data-dir", str(self.data_dir), *credentials), stdout=log, stderr=subprocess.STDOUT, env=env))

    def boards_gone(self) -> bool:
        """Every board process exited."""
        return bool(self.boards) and all(p.poll() is not None for p in self.boards)

    def a_board_gone(self) -> bool:
        """Some board process exited (before the job started: it cannot start without it)."""
        return any(p.poll() is not None for p in self.boards)

    def stop(self, grace_s: float) -> None:
        """Let the boards end by themselves for `grace_s`, then terminate what is left."""
        supervisor.stop([*self.boards, *([self.server] if self.server else [])], grace_s, terminate_wait_s=10)
        shutil.rmtree(self.trust.directory, ignore_errors=True)  # the run's own throwaway authority


def run_edgetrain_arm(run: Run, fleet: FleetSpec, run_dir: Path, *, data_dir: Path, cap_s: float | None,
                      progress: Progress) -> int:
    """An EdgeTrain arm on the emulated fleet; the coordinator's exit code."""
    procs = _Processes(run_dir, fleet, data_dir)
    job_file = procs.launch / "job.yaml"
    job_file.write_text(yaml.safe_dump(run.job))
    started = time.monotonic()
    try:
        address = procs.start_server("--config", str(job_file), "--runs-dir", str(run_dir.parent))
        procs.start_boards(address)
        gone_since = None
        while procs.server.poll() is None:
            progress.follow(run_dir / "metrics.jsonl")
            over = cap_s is not None and time.monotonic() - started > cap_s + START_TIMEOUT_S + STOP_GRACE_S
            if procs.boards_gone() or (progress.first_step_start is None and procs.a_board_gone()):
                gone_since = gone_since or time.monotonic()  # the job cannot start (or go on) without it
            if over or (gone_since and time.monotonic() - gone_since > STOP_GRACE_S):
                why = "its time cap passed long ago" if over else "board processes exited"
                logger.warning("arm %s: stopping its coordinator: %s (logs in %s)", run.name, why, procs.logs)
                supervisor.terminate(procs.server, grace_s=STOP_GRACE_S)  # ends the job cleanly
                break
            time.sleep(POLL_S)
        progress.follow(run_dir / "metrics.jsonl")
        return procs.server.returncode
    finally:
        procs.stop(grace_s=15)


def run_trace_arm(trace: Trace, fleet: FleetSpec, run_dir: Path, *, data_dir: Path, cap_s: float | None,
                  progress: Progress) -> int:
    """A job server with `trace.scheduler` on the fleet's boards, fed the trace's jobs at their
    arrival times (counted from the moment every board joined); writes trace.json. 0 when every
    job finished."""
    from edgetrain import trust
    from edgetrain.job_client import JobServerClient

    procs = _Processes(run_dir, fleet, data_dir)
    try:
        address = procs.start_server("--jobs", "--scheduler", trace.scheduler, "--state-dir",
                                     str(run_dir / "state"), "--runs-dir", str(run_dir / "runs"))
        procs.start_boards(address)
        security = trust.Authority(procs.trust.authority_dir).operator_identity().security(trust.GATEWAY_SERVER_NAME)
        with JobServerClient(address, security) as client:
            deadline = time.monotonic() + START_TIMEOUT_S
            while client.boards_joined() < len(fleet.boards):
                if time.monotonic() > deadline or procs.server.poll() is not None:
                    raise RuntimeError(f"the boards did not join the job server; see {procs.logs}")
                time.sleep(POLL_S)
            t0 = time.time()
            total = sum(j.job["training"]["steps"] for j in trace.jobs)
            progress.set(0, total)
            pending, ids = list(trace.jobs), []
            while True:
                while pending and time.time() >= t0 + pending[0].at_s:
                    ids.append(client.submit(yaml.safe_dump(pending.pop(0).job)).id)
                listing = client.list_jobs()
                ours = [j for j in listing.jobs if j.id in ids]
                progress.set(sum(j.steps_done for j in ours), total)
                if not pending and all(j.state in FINISHED_STATES for j in ours):
                    break
                if cap_s is not None and time.time() - t0 > cap_s:
                    logger.warning("trace %s: the cap of %.0f s passed; cancelling the jobs still open",
                                   trace.scheduler, cap_s)
                    for j in ours:
                        if j.state not in FINISHED_STATES:
                            client.cancel(j.id)
                    pending.clear()
                time.sleep(POLL_S if pending else 2.0)
        jobs = [{"id": j.id, "name": j.name, "state": j.state, "boards": list(j.boards), "submitted": j.submitted,
                 "started": j.started or None, "finished": j.finished or None, "steps": j.steps,
                 "steps_done": j.steps_done, "message": j.message} for j in ours]
        ended = [j for j in jobs if j["state"] == "finished"]
        summary = {"scheduler": trace.scheduler, "trace_file": str(trace.file), "jobs": jobs,
                   "makespan_s": (max(j["finished"] for j in ended) - min(j["submitted"] for j in jobs)
                                  if len(ended) == len(jobs) else None),
                   "mean_jct_s": (statistics.mean(j["finished"] - j["submitted"] for j in ended)
                                  if len(ended) == len(jobs) else None)}
        (run_dir / "trace.json").write_text(json.dumps(summary, indent=2))
        return 0 if len(ended) == len(jobs) else 1
    finally:
        if procs.server is not None:
            supervisor.terminate(procs.server, grace_s=0)
        procs.stop(grace_s=0)


def run_live_arm(run: Run, run_dir: Path, *, server: str, progress: Progress) -> int:
    """An EdgeTrain arm submitted to the live job server `server` with this machine's operator
    credential; waits for it and copies its run directory when the server's runs directory is on
    this machine. 0 when the job finished."""
    from edgetrain import trust
    from edgetrain.job_client import JobServerClient

    security = trust.operator_identity(None, None).security(trust.GATEWAY_SERVER_NAME)
    with JobServerClient(server, security) as client:
        view = client.submit(yaml.safe_dump(run.job))
        logger.info("arm %s: job %s submitted to %s", run.name, view.id, server)
        while view.state not in FINISHED_STATES:
            time.sleep(2.0)
            view = client.job(view.id) or view
            progress.set(view.steps_done, view.steps)
    source = Path(view.run_dir) if view.run_dir else None
    if source is not None and source.is_dir():
        shutil.copytree(source, run_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("checkpoints"))
        progress.follow(run_dir / "metrics.jsonl")
    else:
        logger.warning("arm %s: its run directory %s is on the job server's machine; copy it here to report it",
                       run.name, view.run_dir or "(none)")
    if view.state != "finished":
        logger.warning("arm %s: job %s %s: %s", run.name, view.id, view.state, view.message)
    return 0 if view.state == "finished" else 1


def _setup_seconds(run_dir: Path) -> dict[str, float]:
    """The set-up a run reports beside its timed window: its `setup` records by what they were
    (the time from launch to the first step is arm.json's launched_at against metrics.jsonl)."""
    setup: dict[str, float] = {}
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return setup
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "setup":
            setup[record["what"]] = setup.get(record["what"], 0.0) + float(record["seconds"])
    return setup


def _synthetic(run: Run) -> bool:
    jobs = [t.job for t in run.arm.trace.jobs] if run.arm.trace else [run.job]
    return any(str(job["dataset"]["name"]).startswith("synthetic") for job in jobs)


def _arm_record(exp: Experiment, run: Run, fleet: Fleet, *, network: str, launched_at: float, ended_at: float,
                exit_code: int | None, setup: dict[str, float], commit: str) -> dict[str, Any]:
    return {"experiment": exp.name, "arm": run.arm.name, "repeat": run.repeat, "seed": run.seed, "commit": commit,
            "baseline": run.arm.baseline, "kind": run.arm.kind, "fleet": fleet.name,
            "fleet_boards": list(fleet.boards), "network": network, "launched_at": launched_at,
            "ended_at": ended_at, "exit_code": exit_code, "stop": exp.stop.to_dict() if exp.stop else {},
            "target_accuracy": exp.stop.target_accuracy if exp.stop else None,
            "insecure": run.arm.baseline == "ddp", "synthetic_data": _synthetic(run), "setup": setup}


def run_experiment(exp: Experiment, runs: Sequence[Run], fleet: Fleet, options: Options) -> int:
    """Run `runs` one after another, write each run's arm.json, then the report. 0 when every run
    ended with exit code 0, else 1 (the report still covers the runs that ended)."""
    if options.live:
        check_live([r.arm for r in runs], insecure=options.insecure)
    if any(r.arm.baseline for r in runs) and not _baselines_importable():
        raise SpecError("baseline arms need edgetrain.experiment.baselines, which this installation lacks; "
                        "leave them out with --arms")
    out_dir = options.out_dir or RESULTS_DIR / exp.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "experiment.yaml").write_text(exp.source.read_text())
    cap_s = exp.stop.cap_s if exp.stop else None
    commit = commit_id()  # the code every run of this invocation trains with
    run_dirs, failed = [], []
    for run in runs:
        run_dir = out_dir / run.name
        if run_dir.exists():
            logger.info("arm %s: replacing the earlier run in %s", run.name, run_dir)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        label = f"{run.arm.name} r{run.repeat} (seed {run.seed})"
        progress = Progress(label, None if run.arm.trace else _planned_steps(run))
        launched_at = time.time()
        network = "live" if options.live else "loopback"
        code: int | None = None
        try:
            if run.arm.trace:
                code = run_trace_arm(run.arm.trace, fleet.spec, run_dir, data_dir=options.data_dir, cap_s=cap_s,
                                     progress=progress)
            elif run.arm.baseline:
                from edgetrain.experiment.baselines import run_baseline

                network = fleet.spec.network
                code = _with_follower(progress, run_dir, functools.partial(
                    run_baseline, run.arm.baseline, run.job, fleet.spec, run_dir, network=network,
                    progress=progress.set))
            elif options.live:
                code = run_live_arm(run, run_dir, server=options.server, progress=progress)
            else:
                code = run_edgetrain_arm(run, fleet.spec, run_dir, data_dir=options.data_dir, cap_s=cap_s,
                                         progress=progress)
        except (RuntimeError, TimeoutError, OSError) as e:
            logger.error("arm %s failed: %s", run.name, e)
        finally:
            progress.close()
            ended_at = time.time()
            record = _arm_record(exp, run, fleet, network=network, launched_at=launched_at, ended_at=ended_at,
                                 exit_code=code, setup=_setup_seconds(run_dir), commit=commit)
            (run_dir / "arm.json").write_text(json.dumps(record, indent=2))
        run_dirs.append(run_dir)
        if code != 0:
            failed.append(f"{run.name} (exit code {code})")
    _report(exp, run_dirs, out_dir, fleet)
    if failed:
        logger.error("runs that did not end cleanly: %s; their arm.json says so", ", ".join(failed))
    return 1 if failed else 0


def _with_follower(progress: Progress, run_dir: Path, call: Callable[[], int]) -> int:
    """Run `call` while a thread feeds the bar's accuracy from the run's metrics.jsonl (the
    steps come from `call`'s own progress callback)."""
    progress.steps_from_metrics = False
    done = threading.Event()

    def follow() -> None:
        while not done.wait(1.0):
            progress.follow(run_dir / "metrics.jsonl")

    thread = threading.Thread(target=follow, name="arm-progress", daemon=True)
    thread.start()
    try:
        return call()
    finally:
        done.set()
        thread.join()


def _report(exp: Experiment, run_dirs: list[Path], out_dir: Path, fleet: Fleet) -> None:
    try:
        from edgetrain.experiment.report import build_report
    except ModuleNotFoundError as e:
        if e.name != "edgetrain.experiment.report":
            raise
        logger.warning("no report: edgetrain.experiment.report is not in this installation; the run directories "
                       "are in %s (`edgetrain report %s/*/` builds it once it is)", out_dir, out_dir)
        return
    report = build_report(run_dirs, out_dir, title=exp.name,
                          target_accuracy=exp.stop.target_accuracy if exp.stop else None, fleet=fleet.spec)
    logger.info("report: %s (results.csv and plots/ beside it)", report)
