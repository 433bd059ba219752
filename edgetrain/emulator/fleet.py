"""`edgetrain fleet up|down`: run an emulated fleet of boards on this machine, and remove it.

`fleet up` starts a supervisor process (detached) and returns once the coordinator serves. The
supervisor builds the virtual LAN (as root: a network namespace per board on a bridge, `tc tbf`
shaping each link, mDNS running across it; otherwise loopback with application-level shaping),
starts the coordinator and one client process per board (each finding the coordinator over
mDNS), plays the scripted events, and on SIGTERM stops everything and removes what it created.
Every process, namespace and cgroup is recorded in a state file first, so `fleet down` cleans
up after a crashed supervisor too. Roles are started as processes, never imported.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import psutil
import yaml

from edgetrain.config import job_to_dict
from edgetrain.emulator.launch import EmulatedTrust
from edgetrain.emulator.netns import HostNetwork, VirtualLan, destroy_resources, netns_available
from edgetrain.emulator.throttle import DEFAULT_MEMORY_CGROUP_ROOT, remove_stale_cgroups
from edgetrain.fleet_file import (
    BoardSpec,
    FleetEvent,
    FleetSpec,
    board_to_dict,
    load_fleet,
)
from edgetrain.supervisor import ChildExited, edgetrain_command, terminate, wait_for_address

logger = logging.getLogger(__name__)

DEFAULT_DASHBOARD = "127.0.0.1:0"
"""Where a fleet's coordinator serves its dashboard unless told otherwise (None: no dashboard)."""
UNSHAPED_MBIT = 1e6
"""Rate given to a client's application-level shaper when `tc` shapes the link instead."""


def state_path(state_dir: Path, name: str) -> Path:
    """Where the state of fleet `name` is recorded."""
    return state_dir / f"{name}.json"


def _write_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


class Supervisor:
    """Owns one running fleet: its network, coordinator, boards and events."""

    def __init__(self, spec: FleetSpec, state_file: Path, runs_dir: Path, data_dir: Path, *,
                 insecure: bool = False, dashboard: str | None = DEFAULT_DASHBOARD) -> None:
        self.spec = spec
        self.dashboard = dashboard
        self.state_file = state_file
        self.work_dir = state_file.with_suffix("")
        self.trust = EmulatedTrust(self.work_dir / "trust", insecure=insecure)
        self.log_dir = runs_dir / spec.name / "fleet-logs"
        self.runs_dir = runs_dir
        self.data_dir = data_dir
        self.lan: VirtualLan | None = None
        self.hosts: dict[str, HostNetwork] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.state = {"name": spec.name, "supervisor_pid": os.getpid(), "pids": {}, "network": None,
                      "mode": None, "coordinator": None, "started": time.time(), "events": []}
        self._stopping = False

    def _save(self) -> None:
        live = {k: p.pid for k, p in self.procs.items() if p.poll() is None}
        self.state["pids"] = live
        self.state["created"] = {k: _create_time(pid) for k, pid in live.items()}
        _write_state(self.state_file, self.state)

    def _use_namespaces(self) -> bool:
        if self.spec.network == "loopback":
            return False
        ok, why = netns_available()
        if not ok and self.spec.network == "namespaces":
            raise RuntimeError(f"fleet {self.spec.name}: network namespaces unavailable: {why}")
        return ok

    def start(self) -> None:
        """Build the network, start the coordinator and every board."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.state["work_dir"] = str(self.work_dir)
        self.state["operator_args"] = self.trust.operator_args()
        self.state["mode"] = "namespaces" if self._use_namespaces() else "loopback"
        gateway = "127.0.0.1"
        if self.state["mode"] == "namespaces":
            self.lan = VirtualLan(name=f"et{os.getpid() % 10000}", subnet_prefix=f"10.77.{os.getpid() % 200 + 20}")
            self.state["network"] = {**self.lan.resources(), "bridge": self.lan.bridge}  # before it exists
            self._save()
            self.lan.create()
            gateway = self.lan.gateway_ip
            for index, board in enumerate(self.spec.boards, start=1):
                self.hosts[board.name] = self.lan.add_host(board.name, index)
                self.state["network"] = {**self.lan.resources(), "bridge": self.lan.bridge}
                self._save()
                if board.link:
                    self.lan.set_rate(board.name, board.link.mbit_per_s)
        self.gateway = gateway
        self._start_coordinator()
        for board in self.spec.boards:
            self._start_board(board)
        self._save()

    def _start_coordinator(self) -> None:
        job_file = self.work_dir / "job.yaml"
        job_file.write_text(yaml.safe_dump(job_to_dict(self.spec.job)))
        address_file = self.work_dir / "coordinator.address"
        address_file.unlink(missing_ok=True)
        log = (self.log_dir / "coordinator.log").open("a")
        server_dir = self.runs_dir / self.spec.name / "job-server"
        role = (["--jobs", "--state-dir", str(server_dir)] if self.spec.jobs else ["--config", str(job_file)])
        url_file = (server_dir if self.spec.jobs else self.runs_dir / self.spec.job.name) / "dashboard.url"
        url_file.unlink(missing_ok=True)  # an earlier run's: the new one is written before the address
        self.procs["coordinator"] = subprocess.Popen(edgetrain_command(
            "coordinator", *role, "--bind", f"{self.gateway}:0", "--port-file",
            str(address_file), "--cluster", self.spec.cluster, "--advertise", self.gateway, "--runs-dir",
            str(self.runs_dir), "--data-dir", str(self.data_dir), *self.trust.gateway_args(),
            "--dashboard", self.dashboard or "none"),
            stdout=log, stderr=subprocess.STDOUT)
        self._save()
        try:
            self.state["coordinator"] = wait_for_address(address_file, self.procs["coordinator"], 120)
        except (ChildExited, TimeoutError) as e:
            raise RuntimeError(f"{e}; see {self.log_dir / 'coordinator.log'}") from e
        # the URL holds the dashboard's token: the state file names the file (owner-only), not the URL
        self.state["dashboard_url_file"] = str(url_file) if self.dashboard and url_file.exists() else None

    def _board_file(self, board: BoardSpec) -> Path:
        path = self.work_dir / f"{board.name}.yaml"
        if self.lan is not None and board.link:  # tc shapes the rate; the client only adds delay and loss
            board = replace(board, link=replace(board.link, mbit_per_s=UNSHAPED_MBIT))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(board_to_dict(board)))
        os.replace(tmp, path)
        return path

    def _start_board(self, board: BoardSpec) -> None:
        prefix, interface = ([], "127.0.0.1") if self.lan is None else (
            self.lan.exec_args(board.name), self.hosts[board.name].ip)
        log = (self.log_dir / f"{board.name}.log").open("a")
        credentials, env = self.trust.board(board.name)  # pairs through mDNS + a one-use token
        self.procs[board.name] = subprocess.Popen([*prefix, *edgetrain_command(
            "client", "--name", board.name, "--emulate", str(self._board_file(board)), "--cluster",
            self.spec.cluster, "--interface", interface, "--data-dir", str(self.data_dir), "--threads", "1",
            "--probe-interval", str(self.spec.probe_interval_s), *credentials)],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        self._save()

    def apply(self, event: FleetEvent) -> None:
        """Play one scripted event."""
        board = next(b for b in self.spec.boards if b.name == event.board)
        logger.info("[Fleet] t=%.0f s: %s %s %s", event.at_s, event.board, event.action, event.link or "")
        if event.action == "link":
            updated = replace(board, link=event.link)
            self.spec = replace(self.spec, boards=tuple(updated if b is board else b for b in self.spec.boards))
            if self.lan is not None:
                self.lan.set_rate(board.name, event.link.mbit_per_s)
            self._board_file(updated)
        elif event.action == "leave":
            proc = self.procs.get(board.name)
            if proc:
                terminate(proc, grace_s=30)
        elif event.action == "join" and (board.name not in self.procs or self.procs[board.name].poll() is not None):
            self._start_board(board)
        self.state["events"].append({"at_s": event.at_s, "board": event.board, "action": event.action})
        self._save()

    def run(self) -> None:
        """Play the events until stopped (SIGTERM)."""
        started = time.monotonic()
        pending = list(self.spec.events)
        while not self._stopping:
            now = time.monotonic() - started
            while pending and pending[0].at_s <= now:
                self.apply(pending.pop(0))
            self._save()
            time.sleep(0.2)

    def stop(self, *_: object) -> None:
        """Ask `run` to return (signal handler)."""
        self._stopping = True

    def teardown(self) -> None:
        """Stop every process and remove every namespace, cgroup and file this fleet created."""
        terminate(*self.procs.values(), grace_s=10)
        if self.lan is not None:
            self.lan.destroy()
        remove_stale_cgroups()
        remove_stale_cgroups(DEFAULT_MEMORY_CGROUP_ROOT)
        shutil.rmtree(self.work_dir, ignore_errors=True)
        self.state_file.unlink(missing_ok=True)


def supervise(spec_file: Path, state_file: Path, runs_dir: Path, data_dir: Path, *, insecure: bool = False,
              dashboard: str | None = DEFAULT_DASHBOARD) -> int:
    """Entry point of the supervisor process."""
    supervisor = Supervisor(load_fleet(spec_file), state_file, runs_dir, data_dir, insecure=insecure,
                            dashboard=dashboard)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    try:
        supervisor.start()
        supervisor.state["ready"] = True
        supervisor._save()
        supervisor.run()
        return 0
    except Exception as e:
        supervisor.state["error"] = str(e)
        _write_state(state_file, supervisor.state)
        logger.exception("[Fleet] supervisor failed")
        return 1
    finally:
        supervisor.teardown()
        if "error" in supervisor.state:
            _write_state(state_file.with_suffix(".error.json"), supervisor.state)


def fleet_up(spec_file: Path, *, state_dir: Path, runs_dir: Path, data_dir: Path, timeout_s: float = 180,
             insecure: bool = False, dashboard: str | None = DEFAULT_DASHBOARD) -> dict:
    """Start the fleet's supervisor in the background; returns its state once the coordinator serves.
    `dashboard` ("host:port", None: none): where the coordinator serves its dashboard; the state's
    `dashboard_url_file` names the file holding its URL."""
    spec = load_fleet(spec_file)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_path(state_dir, spec.name)
    if path.exists():
        raise RuntimeError(f"fleet {spec.name!r} is already up (state in {path}); run `edgetrain fleet down` first")
    (runs_dir / spec.name).mkdir(parents=True, exist_ok=True)
    log = (runs_dir / spec.name / "fleet-supervisor.log").open("a")
    proc = subprocess.Popen(edgetrain_command("fleet", "supervise", str(spec_file.resolve()), "--state-dir",
                                       str(state_dir.resolve()), "--runs-dir", str(runs_dir.resolve()),
                                       "--data-dir", str(data_dir.resolve()), *(["--insecure"] if insecure else []),
                                       "--dashboard", dashboard or "none"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            state = json.loads(path.read_text())
            if state.get("ready"):
                return state
        if proc.poll() is not None:
            error = path.with_suffix(".error.json")
            detail = json.loads(error.read_text()).get("error") if error.exists() else "see the supervisor log"
            raise RuntimeError(f"fleet {spec.name!r} failed to start: {detail} ({log.name})")
        time.sleep(0.2)
    raise TimeoutError(f"fleet {spec.name!r} did not come up within {timeout_s:.0f} s ({log.name})")


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def fleet_down(name: str, *, state_dir: Path, timeout_s: float = 30) -> list[str]:
    """Stop fleet `name` and remove everything it created, also after a supervisor crash."""
    path = state_path(state_dir, name)
    if not path.exists():
        return []
    state = json.loads(path.read_text())
    removed = []
    supervisor = state.get("supervisor_pid")
    if supervisor and _alive(supervisor):
        os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.1)
        removed.append(f"supervisor {supervisor}")
    created = state.get("created", {})
    for role, pid in state.get("pids", {}).items():  # whatever a crashed supervisor left
        if _alive(pid) and _create_time(pid) == created.get(role):  # never a reused pid
            os.kill(pid, signal.SIGKILL)
            removed.append(f"{role} process {pid}")
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in state.get("pids", {}).values()) and time.monotonic() < deadline:
        time.sleep(0.1)  # a cgroup can only be removed once its processes are gone
    if state.get("network"):
        destroy_resources(state["network"])
        removed.append("network namespaces and bridge")
    removed += [f"cgroup {p}" for p in remove_stale_cgroups() + remove_stale_cgroups(DEFAULT_MEMORY_CGROUP_ROOT)]
    if state.get("work_dir") and Path(state["work_dir"]).exists():
        shutil.rmtree(state["work_dir"], ignore_errors=True)
        removed.append(f"files in {state['work_dir']}")
    path.unlink(missing_ok=True)
    return removed
