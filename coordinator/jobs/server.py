"""The job server: several training jobs share one fleet (`edgetrain coordinator --jobs`).

Boards wait in its lobby (``JobServer.Join`` / ``NextJob``). Users submit jobs (``Submit``),
list them (``ListJobs``) and cancel them (``Cancel``). At every event — a job submitted,
finished or cancelled, a board joining or leaving — the scheduler (``coordinator.jobs.scheduler``,
``rolling`` by default) plans every waiting job's boards and start over a rolling horizon, with
each job's speed on a set of boards predicted by the hybrid planner (``coordinator.jobs.speed``).
Jobs planned to start now are launched: each gets its own coordinator process (the ordinary
``edgetrain coordinator``, on a free port of this host, not advertised), and its boards are
told that port on their next ``NextJob``. They work for it until it finishes, then come back.
Running jobs are never preempted, migrated or reconfigured. Job coordinators serve under the job
server's fleet authority (mutual TLS; boards pair with the job server only), or plaintext when
the job server runs ``--insecure``.

A board's claimed speed is checked against the steps of the jobs it ran alone
(``coordinator.jobs.claims``): a claim far off is flagged and the board planned by the measurement.

Jobs live in ``<state-dir>/jobs.json`` (``coordinator.jobs.store``): a restarted job server adopts
job coordinators that are still running and re-queues the others to resume from their newest
complete checkpoint (``--resume-or-start``: from step 0 when a job died before its first
checkpoint). Every scheduling decision is appended to ``<state-dir>/decisions.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from coordinator.jobs.claims import ClaimChecker, judge, judgements
from coordinator.jobs.launcher import JobLauncher
from coordinator.jobs.lobby import LobbyBoard
from coordinator.jobs.runfiles import RunFiles
from coordinator.jobs.scheduler import SCHEDULERS, Board, FleetState, Job, Running
from coordinator.jobs.speed import PlannerSpeed, board_spec, warm
from coordinator.jobs.store import ACTIVE, DONE, JobRecord, JobStore
from coordinator.jobs.submission import parse_job, request_text, submitted_job
from edgetrain import trust
from edgetrain.config import JobConfig
from edgetrain.supervisor import (
    ChildExited,
    adopt,
    create_time,
    exit_code,
    first_port,
    terminate,
    wait_for,
)

logger = logging.getLogger(__name__)

DEFAULT_OVERHEAD_S = 25.0
"""A job's time besides training (launch to first step, last step to exit) before one measured it."""
START_TIMEOUT_S = 180.0
"""A job coordinator that does not serve within this long has failed."""
FIRST_STEP_TIMEOUT_S = 300.0
"""A running job that has not finished a step this long after its coordinator started serving lost a
board before it started (its coordinator waits for all of them): it is stopped and queued again."""


class KeyReused(ValueError):
    """A Submit's idempotency key was already used for a different job."""


class JobServer:
    """Jobs, boards and the scheduling loop; its gRPC face is ``servicer.JobServerServicer``.

    The job coordinators it launches serve under `authority` (mutual TLS, boards pair with this
    server, not with them), or plaintext (``--insecure``) when it is None."""

    def __init__(self, *, state_dir: Path, runs_dir: Path, data_dir: Path, host: str = "127.0.0.1",
                 scheduler: str = "rolling", poll_s: float = 5.0, board_timeout_s: float = 20.0,
                 reference_s: float | None = None, clock: Callable[[], float] = time.time,
                 authority: trust.Authority | None = None, job_dashboards: str | None = None) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
        self.state_dir, self.runs_dir, self.data_dir = Path(state_dir), Path(runs_dir), Path(data_dir)
        self.scheduler_name = scheduler
        self.poll_s, self.board_timeout_s = poll_s, board_timeout_s
        self.clock = clock
        self.job_dashboards = job_dashboards
        """HOST (or None): each job's coordinator serves its run's dashboard on HOST, a free port."""
        self.runs = RunFiles(self.runs_dir)
        self.claims = ClaimChecker(self.runs, poll_s)
        self.launcher = JobLauncher(state_dir=self.state_dir, runs_dir=self.runs_dir, data_dir=self.data_dir,
                                    host=host, authority=authority, job_dashboards=job_dashboards)
        self.store = JobStore(self.state_dir / "jobs.json")
        self.boards: dict[str, LobbyBoard] = {}
        self.procs: dict[str, subprocess.Popen | psutil.Process] = {}
        self.serving_since: dict[str, float] = {}
        """When each launched job's coordinator started serving (its boards may join from then on)."""
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.dirty = True
        self.plan_exact = False
        self.arrivals = [j.submitted for j in self.store.jobs.values()]
        self._reference_s = reference_s
        self._adopt()

    # --- reference speed ---------------------------------------------------------------------

    @property
    def reference_s(self) -> float:
        """This machine's time for the reference workload on one core (measured once)."""
        if self._reference_s is None:
            from coordinator.planning.measure import num_threads
            from edgetrain.speed_reference import reference_seconds

            with num_threads(1):
                self._reference_s = reference_seconds()
            logger.info("[JobServer] reference workload: %.3f s on one core here", self._reference_s)
        return self._reference_s

    # --- restart -----------------------------------------------------------------------------

    def _adopt(self) -> None:
        """After a restart: keep coordinators still running, re-queue the rest to resume."""
        for job in self.store.in_state(*ACTIVE):
            proc = adopt(job.pid, job.pid_started)
            if proc is not None and job.port:
                self.procs[job.id] = proc
                job.state = "running"
                logger.info("[JobServer] adopted job %s (coordinator pid %d, port %d)", job.id, job.pid, job.port)
                for name in job.boards:
                    self.boards[name] = LobbyBoard(name=name, claimed_speed=0.0, mbit_per_s=0.0,
                                               last_seen=self.clock(), job=job.id)
            else:
                self._requeue(job, "the job server restarted while it ran; it resumes from its newest checkpoint")
        self.store.save()

    def _requeue(self, job: JobRecord, why: str) -> None:
        job.state, job.resume, job.message = "waiting", True, why
        self.runs.progress(job)
        job.boards, job.pid, job.port = [], 0, 0

    # --- users -------------------------------------------------------------------------------

    def submit(self, text: str, idempotency_key: str = "") -> JobRecord:
        """Queue a job YAML (ConfigError, nothing queued, when it is invalid, empty or leaves its
        name, model or length to the defaults: ``submission.submitted_job``). A key already
        submitted returns the job it queued (KeyReused when that job's YAML differs)."""
        config = submitted_job(text)
        warm(config.model)
        with self.lock:
            known = self.store.by_key(idempotency_key)
            if known is not None:
                if known.yaml != text:
                    raise KeyReused(f"idempotency key {idempotency_key!r} already queued job {known.id} "
                                    "with a different job YAML")
                return known
            now = self.clock()
            record = JobRecord(id=self.store.new_id(), name=config.name, yaml=text, model=config.model,
                               kind=config.schedule.kind, request=request_text(config),
                               priority=config.schedule.priority, submitted=now, steps=config.training.steps,
                               global_batch=config.training.global_batch, idempotency_key=idempotency_key)
            self.store.add(record)
            self.arrivals.append(now)
            logger.info("[JobServer] job %s (%s, %s, %s) submitted", record.id, record.name, record.model,
                        record.request)
            self._event()
            return record

    def cancel(self, job_id: str) -> JobRecord:
        with self.lock:
            job = self.store.jobs.get(job_id)
            if job is None:
                raise KeyError(job_id)
            if job.state in DONE:
                raise ValueError(f"job {job_id} is already {job.state}")
            proc = self.procs.pop(job_id, None)
            job.state, job.finished, job.message = "cancelled", self.clock(), "cancelled by a user"
            self._free_boards(job)
            self.store.save()
            self._event()
        if proc is not None:
            terminate(proc)
        logger.info("[JobServer] job %s cancelled", job_id)
        return job

    def snapshot(self) -> tuple[list[JobRecord], list[LobbyBoard]]:
        with self.lock:
            for job in self.store.in_state("running"):
                self.runs.progress(job)
            return list(self.store.jobs.values()), list(self.boards.values())

    # --- boards ------------------------------------------------------------------------------

    def join(self, name: str, reference_s: float, mbit_per_s: float) -> None:
        """Board `name` enters the lobby claiming its reference time and link (ValueError when
        they are not numbers it could have measured). What its jobs measured stays with it."""
        if not name:
            raise ValueError("a board needs a name")
        if not (reference_s > 0 and math.isfinite(reference_s)):
            raise ValueError(f"reference_s must be a positive number of seconds, got {reference_s}")
        if not (mbit_per_s >= 0 and math.isfinite(mbit_per_s)):
            raise ValueError(f"link_mbit_per_s must be >= 0, got {mbit_per_s}")
        claimed = self.reference_s / reference_s
        with self.lock:
            old = self.boards.get(name)
            before = judgements(self.boards)
            self.boards[name] = LobbyBoard(name=name, claimed_speed=claimed, mbit_per_s=mbit_per_s,
                                           last_seen=self.clock(), job=old.job if old else "",
                                           implied_speed=old.implied_speed if old else 0.0,
                                           measured_in=old.measured_in if old else "")
            logger.info("[JobServer] board %s joined: claims %.2f of a core here, link %s", name, claimed,
                        f"{mbit_per_s:.0f} Mbit/s" if mbit_per_s else "unknown")
            changed = judge(self.boards, before)
            if changed or old is None or not old.alive or old.mbit_per_s != mbit_per_s:
                self._event()

    def next_job(self, name: str, max_wait_s: float) -> JobRecord | None:
        """The running job this board should serve, waiting up to `max_wait_s` for one."""
        deadline = time.monotonic() + max(0.0, min(max_wait_s, 30.0))
        with self.lock:
            while True:
                board = self.boards.get(name)
                if board is None or board.claimed_speed <= 0:  # unknown, or adopted after a restart: join again
                    raise KeyError(name)
                board.last_seen = self.clock()
                if not board.alive:
                    board.alive = True
                    self._event()
                job = self.store.jobs.get(board.job)
                if job is not None and job.state == "running" and job.port:
                    return job
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(min(left, 1.0))

    # --- the loop ----------------------------------------------------------------------------

    def _event(self) -> None:
        self.dirty = True
        self.changed.notify_all()

    def run(self, stop: threading.Event) -> None:
        """Watch jobs and boards and schedule at every event, until `stop`."""
        while not stop.is_set():
            with self.lock:
                self._reap()
                if self.claims.check(list(self.store.jobs.values()), self.boards):
                    self._event()
                self._restart_stalled()
                self._expire()
                if self.dirty:
                    self.dirty = False
                    try:
                        self._schedule()
                    except Exception:  # never let one bad decision stop the server
                        logger.exception("[JobServer] scheduling failed")
                self.changed.wait(0.5)

    def shutdown(self) -> None:
        """Stop every job coordinator this server runs; their jobs resume when it starts again."""
        with self.lock:
            procs = dict(self.procs)
            self.procs.clear()
            for job_id in procs:
                job = self.store.jobs[job_id]
                self._free_boards(job)
                self._requeue(job, "the job server stopped while it ran; it resumes from its newest checkpoint")
            self.store.save()
        terminate(*procs.values())

    def _reap(self) -> None:
        for job_id, proc in list(self.procs.items()):
            code = exit_code(proc)
            if code is None:
                continue
            del self.procs[job_id]
            job = self.store.jobs[job_id]
            self.runs.progress(job)
            job.finished = self.clock()
            job.overhead_s = self.runs.measured_overhead(job)
            summary = self.runs.summary(job)
            if summary is not None and summary.get("stopped"):  # it stopped before its last step
                job.state = "failed"
                job.message = f"stopped after {summary.get('steps_applied', '?')} applied steps: {summary['stopped']}"
            elif code == 0 or (code == -1 and summary is not None):
                job.state = "finished"
                acc = (summary or {}).get("test_accuracy")
                job.message = f"test accuracy {acc:.3f}" if isinstance(acc, (int, float)) else ""
            else:
                job.state = "failed"
                job.message = f"its coordinator exited with code {code}; see {self.launcher.log(job)}"
            logger.info("[JobServer] job %s %s after %.0f s", job_id, job.state, job.finished - job.started)
            self._free_boards(job)
            self.store.save()
            self.claims.due()  # its last steps count
            self._event()

    def _restart_stalled(self) -> None:
        now = self.clock()
        for job in self.store.in_state("running"):
            since = self.serving_since.get(job.id, job.started)
            if job.id not in self.procs or now - since < FIRST_STEP_TIMEOUT_S or job.stepped:
                continue
            job.stepped = self.runs.stepped_since(job, job.started)
            if job.stepped:
                continue
            logger.warning("[JobServer] job %s: no step %.0f s after its coordinator started serving; a board "
                           "did not join. Queued again", job.id, now - since)
            proc = self.procs.pop(job.id)
            self._free_boards(job)
            for name in job.boards:  # each must poll the lobby again before it gets another job
                self.boards[name].alive = False
            self._requeue(job, f"queued again: not all of {', '.join(job.boards)} joined its coordinator")
            self.store.save()
            self._event()
            threading.Thread(target=terminate, args=(proc,), daemon=True).start()

    def _expire(self) -> None:
        now = self.clock()
        for board in self.boards.values():
            if board.alive and not board.job and now - board.last_seen > self.board_timeout_s:
                board.alive = False
                logger.info("[JobServer] board %s left (silent for %.0f s)", board.name, now - board.last_seen)
                self._event()

    def _free_boards(self, job: JobRecord) -> None:
        now = self.clock()
        for board in self.boards.values():
            if board.job == job.id:
                board.job, board.last_seen = "", now  # it has board_timeout_s to come back

    def overhead_estimate(self) -> float:
        """Median time besides training of the last jobs that measured it."""
        measured = [j.overhead_s for j in sorted(self.store.jobs.values(), key=lambda j: j.finished) if j.overhead_s > 0]
        return statistics.median(measured[-5:]) if measured else DEFAULT_OVERHEAD_S

    # --- scheduling --------------------------------------------------------------------------

    def _configs(self) -> dict[str, JobConfig]:
        return {j.id: parse_job(j.yaml) for j in self.store.jobs.values() if j.state not in DONE}

    def _scheduler_job(self, record: JobRecord, config: JobConfig, overhead_s: float = 0.0) -> Job:
        s = config.schedule
        return Job(id=record.id, arrival=record.submitted, kind=s.kind, model=record.model,
                   work=record.work_samples, priority=s.priority, overhead_s=overhead_s,
                   boards=frozenset(s.boards) if s.kind == "hard" and s.boards else None,
                   count=s.count if s.kind == "hard" and s.count else None,
                   min_boards=s.min_boards if s.kind == "soft" else 1,
                   max_boards=(s.max_boards or max(1, len(self.boards))) if s.kind == "soft" else 1)

    def _schedule(self) -> None:
        now = self.clock()
        configs = self._configs()
        setup = self.overhead_estimate()
        usable = [b for b in self.boards.values() if b.alive and b.speed > 0]
        fleet = tuple(Board(b.name, f"{b.speed:.2f}@{b.mbit_per_s:.0f}") for b in sorted(usable, key=lambda b: b.name))
        speed = PlannerSpeed(configs, {b.name: board_spec(b.name, b.speed, b.mbit_per_s) for b in usable})
        running = []
        for job in self.store.in_state(*ACTIVE):
            sjob = self._scheduler_job(job, configs[job.id])
            on = tuple(b for b in fleet if b.name in job.boards)
            finish = job.predicted_finish
            if on and finish <= now:  # overran its prediction: re-predict what is left
                finish = now + sjob.work / max(speed(sjob, on), 1e-9)
            running.append(Running(job=sjob, boards=frozenset(job.boards), start=job.started or now,
                                   finish=max(finish, now + 1.0)))
        fleet_names = {b.name for b in fleet}
        held = {n for r in running for n in r.boards}
        # boards of running jobs that the lobby no longer counts still hold their job's place
        fleet = fleet + tuple(Board(n, "held") for n in sorted(held - fleet_names))
        waiting = [j for j in self.store.in_state("waiting")]
        state = FleetState(boards=fleet, speed=speed, running=tuple(running),
                           waiting=tuple(self._scheduler_job(j, configs[j.id], setup) for j in waiting),
                           leaving=frozenset(held - fleet_names), arrivals=tuple(sorted(self.arrivals)))
        if not waiting:
            return
        started = time.perf_counter()
        plan = SCHEDULERS[self.scheduler_name](now, state)
        seconds = time.perf_counter() - started
        self.plan_exact = plan.exact
        by_id = {a.job_id: a for a in plan.assignments}
        for job in waiting:
            a = by_id.get(job.id)
            if a is None:
                job.boards, job.planned_start, job.predicted_finish = [], 0.0, 0.0
                job.message = job.message if job.resume else "no plan places it yet (its request does not fit the fleet)"
                continue
            job.boards = sorted(a.boards)
            job.planned_start, job.predicted_finish = a.start, a.finish
            sjob = next(j for j in state.waiting if j.id == job.id)
            job.predicted_samples_per_s = sjob.work / max(a.finish - a.start - sjob.overhead_s, 1e-9)
        launches = plan.launches(now)
        self._record_decision(now, seconds, plan, state, launches)
        for a in launches:
            self._launch(self.store.jobs[a.job_id], configs[a.job_id], sorted(a.boards), now)
        self.store.save()

    def _record_decision(self, now, seconds, plan, state, launches) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        record = {"time": round(now, 3), "scheduler": self.scheduler_name, "plan_seconds": round(seconds, 4),
                  "exact": plan.exact, "boards": {b.name: b.kind for b in state.boards},
                  "running": [{"job": r.job.id, "boards": sorted(r.boards), "finish": round(r.finish, 1)}
                              for r in state.running],
                  "plan": [{"job": a.job_id, "boards": sorted(a.boards), "start": round(a.start, 1),
                            "finish": round(a.finish, 1)} for a in plan.assignments],
                  "launch": [a.job_id for a in launches]}
        with (self.state_dir / "decisions.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def dashboard_url(self, job: JobRecord) -> str | None:
        """The URL (token included) of the job's own dashboard while its coordinator runs."""
        if job.state not in ("starting", "running") or not self.job_dashboards:
            return None
        return self.runs.dashboard_url(job)

    def _launch(self, job: JobRecord, config: JobConfig, boards: list[str], now: float) -> None:
        proc, port_file = self.launcher.start(job, config, boards)
        self.procs[job.id] = proc
        job.state, job.boards, job.started, job.message, job.stepped = "starting", boards, now, "", False
        job.measured_samples_per_s = 0.0
        job.launches += 1
        job.pid, job.pid_started = proc.pid, create_time(proc.pid)
        for name in boards:
            self.boards[name].job = job.id
        logger.info("[JobServer] job %s starts on %s (predicted finish in %.0f s)", job.id, ", ".join(boards),
                    job.predicted_finish - now)
        threading.Thread(target=self._await_port, args=(job, proc, port_file), daemon=True).start()

    def _await_port(self, job: JobRecord, proc: subprocess.Popen, port_file: Path) -> None:
        """Mark the job running once its coordinator wrote its address (line 1 of its port file)."""
        try:
            wait_for(lambda: bool(first_port(port_file)), proc, timeout_s=START_TIMEOUT_S,
                     what=f"job {job.id}'s coordinator")
        except ChildExited:
            return  # the scheduling loop reaps it and records how it ended
        except TimeoutError as e:
            logger.error("[JobServer] %s", e)
            terminate(proc)
            return
        with self.lock:
            if job.state == "starting":
                job.port, job.state = first_port(port_file), "running"
                self.serving_since[job.id] = self.clock()
                self.store.save()
                self.changed.notify_all()
