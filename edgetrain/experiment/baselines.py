"""The baselines users compare EdgeTrain with, run inside the product on the same fleet and job.

- `ddp`: PyTorch DistributedDataParallel over gloo, one process per board of the fleet, each held
  to its board's speed, with the framework's equal split of the global batch. gloo has no
  authentication, so its rendezvous (a FileStore in the run directory) and its traffic stay on
  127.0.0.1, or, as root, inside network namespaces made for this run with each board's link rate
  shaped by tc tbf, so DDP on slow links is measured for real. A shaped fleet run on loopback
  (not root, or `network: loopback`) says `"links_emulated": false` in summary.json. Link delay
  and loss are not emulated for DDP (netem is absent here, and gloo has no application hook).
- `single`: the fastest board alone, the whole global batch per step, no communication.
- `centralized`: the gateway (`FleetSpec.gateway`, default one full core) alone, after the boards
  shipped it their training data: a `setup` record `data_ship` with `"counted": true` gives the
  time that takes at their link rates, which the report adds to the time to target.

Every arm trains what the coordinator would (the same samples per step, augmentation, model
initialisation, optimizer, LR schedule, chunking, evaluation and stop rule; see ddp_worker.py;
the roles are never imported). An arm is one launcher process (this interpreter, started with
sys.executable) that imports torch once and forks one process per rank; the ranks write JSON
lines under RUN/ranks/, which this module merges as they come into the run directory contract:
metrics.jsonl (`setup`, `train`, `eval` records), summary.json, job.json, plus model.pt (the
final model) and ranks.json (each rank's pid). A rank that fails ends the arm at once with one
line naming it; gloo's own timeout (COLLECTIVE_TIMEOUT_S) bounds a rank that never arrives.

Energy per device and step comes from the board's power model (edgetrain.power): busy during its
compute (forward, backward and optimizer step), idle for the rest of the step, plus radio energy
for what a DDP rank sends and receives in the ring all-reduce: 2(N-1)/N x the gradient bytes each
way (rank 0's buffer broadcast, a few kB, is left out).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import edgetrain
from edgetrain import supervisor
from edgetrain.config import ConfigError, job_from_dict, job_to_dict
from edgetrain.data import dataset_is_synthetic
from edgetrain.emulator.netns import NetnsError, VirtualLan, netns_available
from edgetrain.fleet_file import BoardSpec, FleetSpec
from edgetrain.power import PowerModel, board_power, default_power

logger = logging.getLogger(__name__)

BASELINES = ("ddp", "single", "centralized")

DDP_LABEL = "DDP (gloo, no authentication: insecure, loopback/namespaces only)"
"""How every output of the DDP arm names it."""

CIFAR_SAMPLE_BYTES = 3073
"""One CIFAR-10 sample in the dataset's own format: a label byte and 32x32x3 pixel bytes."""

COLLECTIVE_TIMEOUT_S = 300.0
"""gloo's timeout for the process-group rendezvous and for each collective: a rank that never
arrives ends the arm after this long (a rank that dies ends it at once)."""

JOIN_TIMEOUT_S = 60.0
"""After rank 0 finished, the other ranks must exit within this long."""

KILL_GRACE_S = 5.0
"""A process asked to stop (SIGTERM) is killed after this long."""

POLL_S = 0.1
"""How often the parent checks its processes and merges their records."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """One process of an arm: where it runs and what it draws."""

    name: str
    speed: float
    power: PowerModel
    board: BoardSpec | None = None
    """The fleet board it stands for (None: the gateway)."""


def fastest_board(fleet: FleetSpec) -> BoardSpec:
    """The board with the highest speed (the first of equals)."""
    if not fleet.boards:
        raise ValueError(f"fleet {fleet.name} has no boards")
    return max(fleet.boards, key=lambda b: b.speed)


def gateway_machine(fleet: FleetSpec) -> Machine:
    """The centralized baseline's machine: the fleet's gateway (one full core unless the fleet
    file says otherwise) with its power figures."""
    gateway = getattr(fleet, "gateway", None)
    if gateway is None:
        return Machine(name="gateway", speed=1.0, power=default_power(1.0))
    return Machine(name="gateway", speed=gateway.speed,
                   power=PowerModel(idle_w=gateway.idle_w, busy_w=gateway.busy_w))


def data_ship(fleet: FleetSpec, train_size: int) -> dict:
    """The `data_ship` setup record: each board holds an equal part of the training set (the
    remainder on the first boards) and all send it to the gateway in parallel at their link
    rates, so the time is the slowest board's part bytes / rate (an unshaped link: 0 s). Its
    energy is the boards' radio energy for the bytes they send."""
    n = len(fleet.boards)
    seconds, energy, per_board = 0.0, 0.0, {}
    for i, board in enumerate(fleet.boards):
        part_bytes = (train_size // n + (i < train_size % n)) * CIFAR_SAMPLE_BYTES
        board_s = part_bytes / board.link.bytes_per_s if board.link else 0.0
        seconds = max(seconds, board_s)
        energy += board_power(board).energy_j(busy_s=0.0, idle_s=0.0, radio_bytes=part_bytes)
        per_board[board.name] = {"bytes": part_bytes, "seconds": round(board_s, 4)}
    return {"kind": "setup", "what": "data_ship", "seconds": round(seconds, 4), "counted": True,
            "energy_j": round(energy, 4), "boards": per_board}


def run_baseline(kind: str, job: dict, fleet: FleetSpec, run_dir: Path, *, network: str = "auto",
                 progress: Callable[[int, int], None] | None = None) -> int:
    """Run baseline `kind` of `job` (a full job dict, stop rule applied) on `fleet`; write the run
    directory `run_dir`; return 0, or 1 after a one-line error when a process failed.

    `network` (auto|namespaces|loopback; auto: the fleet file's choice) decides where DDP's
    traffic goes on a fleet with shaped links; `progress(steps done, total steps)` is called
    after each step.
    """
    if kind not in BASELINES:
        raise ValueError(f"unknown baseline {kind!r}; known: {', '.join(BASELINES)}")
    config = job_from_dict(job, source="baseline job")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job_to_dict(config), indent=2))
    machines = _machines(kind, fleet)
    label = _label(kind, machines)
    if config.training.global_batch < len(machines):
        raise ConfigError(f"{label}: training.global_batch {config.training.global_batch} is smaller than the "
                          f"{len(machines)} ranks")
    ranks_dir = run_dir / "ranks"
    ranks_dir.mkdir(exist_ok=True)
    for stale in ranks_dir.iterdir():
        stale.unlink()
    metrics = (run_dir / "metrics.jsonl").open("a", buffering=1)
    merger = _Merger(kind, config, machines, ranks_dir, metrics, progress)
    if kind == "centralized":
        merger.write(data_ship(fleet, config.dataset.split_size(train=True)))
    lan: VirtualLan | None = None
    try:
        try:
            mode, links_emulated = _network_mode(kind, fleet, network, machines)
            if mode == "namespaces":
                lan = _build_lan(machines)
        except (NetnsError, RuntimeError) as e:
            return _fail(run_dir, merger, label, f"{label}: network set-up failed: {e}", network="none",
                         links_emulated=False)
        logger.info("[Baseline] %s: %s on %s (%s)%s", label, config.model, ", ".join(
            f"{m.name} at {m.speed:g} core" for m in machines), mode,
            "" if links_emulated else "; the boards' link rates are NOT emulated (loopback)")
        spec = {"kind": kind, "label": label, "job": job_to_dict(config), "run_dir": str(run_dir),
                "store": str(ranks_dir / "store"), "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
                "join_timeout_s": JOIN_TIMEOUT_S,
                "ranks": [{"name": m.name, "speed": m.speed,
                           **({"namespace": lan.hosts[m.name].namespace, "ifname": lan.hosts[m.name].veth_ns}
                              if lan is not None else {})} for m in machines]}
        (ranks_dir / "spec.json").write_text(json.dumps(spec))
        error = _supervise(_spawn(ranks_dir), merger, ranks_dir)
        merger.poll()
        if error:
            return _fail(run_dir, merger, label, error, network=mode, links_emulated=links_emulated)
        summary = merger.summary(label=label, network=mode, links_emulated=links_emulated, stopped=None)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        acc = summary["test_accuracy"]
        logger.info("[Baseline] %s: %d steps, test accuracy %s, %.1f samples/s, %s J (estimated)%s", label,
                    summary["steps"],
                    "-" if acc is None else f"{acc:.3f}", summary["samples_per_s"],
                    "?" if summary["energy_j"] is None else f"{summary['energy_j']:.1f}",
                    " (SYNTHETIC data)" if summary["synthetic_data"] else "")
        return 0
    finally:
        metrics.close()
        if lan is not None:
            lan.destroy()


def _machines(kind: str, fleet: FleetSpec) -> list[Machine]:
    if kind == "centralized":
        return [gateway_machine(fleet)]
    boards = [fastest_board(fleet)] if kind == "single" else list(fleet.boards)
    if not boards:
        raise ValueError(f"fleet {fleet.name} has no boards")
    return [Machine(name=b.name, speed=b.speed, power=board_power(b), board=b) for b in boards]


def _label(kind: str, machines: list[Machine]) -> str:
    if kind == "ddp":
        return DDP_LABEL
    if kind == "single":
        return f"single board ({machines[0].name} at {machines[0].speed:g} core)"
    return f"centralized (gateway at {machines[0].speed:g} core)"


def _network_mode(kind: str, fleet: FleetSpec, network: str, machines: list[Machine]) -> tuple[str, bool]:
    """(where the ranks talk: none|loopback|namespaces, whether the boards' link rates hold)."""
    if kind != "ddp":
        return "none", True
    shaped = any(m.board is not None and m.board.link for m in machines)
    wanted = fleet.network if network == "auto" else network
    if wanted not in ("auto", "namespaces", "loopback"):
        raise RuntimeError(f"network {network!r} is not one of auto, namespaces, loopback")
    if not shaped or wanted == "loopback":
        return "loopback", not shaped
    ok, why = netns_available()
    if ok:
        return "namespaces", True
    if wanted == "namespaces":
        raise RuntimeError(f"network namespaces unavailable: {why}")
    logger.warning("[Baseline] %s: %s: running on loopback, the boards' link rates are not emulated",
                   DDP_LABEL, why)
    return "loopback", False


def _build_lan(machines: list[Machine]) -> VirtualLan:
    """A bridge and one namespace per rank, each link shaped to its board's rate (tc tbf)."""
    pid = os.getpid()
    lan = VirtualLan(name=f"bl{pid % 100000}", subnet_prefix=f"10.78.{pid % 200 + 20}")
    try:
        lan.create()
        for index, machine in enumerate(machines, start=1):
            lan.add_host(machine.name, index)
            if machine.board is not None and machine.board.link:
                lan.set_rate(machine.name, machine.board.link.mbit_per_s)
    except BaseException:
        lan.destroy()
        raise
    return lan


def _spawn(ranks_dir: Path) -> subprocess.Popen:
    """Start the arm's launcher (ddp_worker.py): this interpreter, the same code (PYTHONPATH); it
    forks the ranks, which write ranks/rank<R>.log; its own output goes to ranks/launcher.log."""
    env = dict(os.environ)
    root = str(Path(edgetrain.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "edgetrain.experiment.ddp_worker", "--spec", str(ranks_dir / "spec.json")]
    log = (ranks_dir / "launcher.log").open("w")
    try:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def _supervise(launcher: subprocess.Popen, merger: _Merger, ranks_dir: Path) -> str | None:
    """Merge records until the launcher exited; its failure (a rank failed, or outstayed rank 0)
    comes back as the one-line error it printed. The launcher is stopped if this is interrupted."""
    try:
        while launcher.poll() is None:
            merger.poll()
            time.sleep(POLL_S)
    finally:
        _stop_all([launcher])
    if launcher.returncode == 0:
        return None
    lines = [line.strip() for line in (ranks_dir / "launcher.log").read_text(errors="replace").splitlines()
             if line.strip()]
    why = lines[-1] if lines else (f"killed by signal {-launcher.returncode}" if launcher.returncode < 0
                                   else f"exit code {launcher.returncode}")
    return f"{merger.label}: {why}"


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, SIGKILL after KILL_GRACE_S; reap them all."""
    supervisor.terminate(*procs, grace_s=KILL_GRACE_S)


def _fail(run_dir: Path, merger: _Merger, label: str, error: str, *, network: str, links_emulated: bool) -> int:
    logger.error("[Baseline] %s", error)
    summary = merger.summary(label=label, network=network, links_emulated=links_emulated, stopped=error)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return 1


class _Merger:
    """Turns the ranks' JSON lines into metrics.jsonl records as they arrive: a `train` record
    once every rank finished the step, rank 0's `eval` records after their step, the ranks'
    `setup` times (the slowest rank's) before the first step."""

    def __init__(self, kind: str, job, machines: list[Machine], ranks_dir: Path, metrics,
                 progress: Callable[[int, int], None] | None) -> None:
        self.kind, self.job, self.machines = kind, job, machines
        self.label = _label(kind, machines)
        self.ranks_dir, self.metrics, self.progress = ranks_dir, metrics, progress
        self._offsets = [0] * len(machines)
        self._steps: list[dict[int, dict]] = [{} for _ in machines]
        self._rank0: list[dict] = []
        self._setup: dict[str, float] = {}
        self._setup_written = False
        self.gradient_bytes = 0
        self.throttle = ""
        self.done: dict = {}
        self.last_eval: dict = {}
        self.steps_written = 0
        self.totals = {m.name: {"samples": 0, "steps": 0, "compute_s": 0.0, "comm_s": 0.0, "energy_j": 0.0,
                                "energy_known": True, "upload_bytes": 0, "download_bytes": 0} for m in machines}
        self.train_seconds = 0.0
        self.samples = 0
        self.extra_setup: dict[str, float] = {}

    def write(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        if record.get("kind") == "setup":
            self.extra_setup[record["what"]] = record["seconds"]
        self.metrics.write(json.dumps(record) + "\n")

    def poll(self) -> None:
        for rank in range(len(self.machines)):
            for line in self._new_lines(rank):
                self._take(rank, json.loads(line))
        while self._rank0:
            head = self._rank0[0]
            if head["kind"] == "step":
                if not all(head["step"] in steps for steps in self._steps):
                    break
                self._write_train(head["step"])
            elif head["kind"] == "eval":
                self.last_eval = {k: v for k, v in head.items() if k != "time"}
                self.metrics.write(json.dumps(head) + "\n")
            self._rank0.pop(0)

    def _new_lines(self, rank: int) -> list[str]:
        path = self.ranks_dir / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        with path.open("rb") as f:
            f.seek(self._offsets[rank])
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offsets[rank] += len(complete)
        return complete.decode().splitlines()

    def _take(self, rank: int, record: dict) -> None:
        kind = record["kind"]
        if kind == "setup":
            seconds, at = self._setup.get(record["what"], (0.0, 0.0))
            self._setup[record["what"]] = (max(seconds, record["seconds"]), max(at, record["time"]))
        elif kind == "info":
            self.gradient_bytes = record["gradient_bytes"]
            self.throttle = record["throttle"]
        elif kind == "step":
            self._steps[rank][record["step"]] = record
        elif kind == "done":
            self.done = record
        if rank == 0 and kind in ("step", "eval"):
            self._rank0.append(record)

    def _write_setup(self) -> None:
        if not self._setup_written:
            self._setup_written = True
            for what, (seconds, at) in self._setup.items():
                self.metrics.write(json.dumps({"time": at, "kind": "setup", "what": what, "seconds": seconds,
                                               "counted": False}) + "\n")

    def ring_bytes(self) -> int:
        """Bytes one rank sends (and receives) in a ring all-reduce of the gradients: 2(N-1)/N of them."""
        n = len(self.machines)
        return round(2 * (n - 1) / n * self.gradient_bytes) if n > 1 else 0

    def _write_train(self, step: int) -> None:
        self._write_setup()
        parts = [steps.pop(step) for steps in self._steps]
        step_s = max(p["step_s"] for p in parts)
        samples = sum(p["samples"] for p in parts)
        sent = self.ring_bytes()
        devices = {}
        for machine, part in zip(self.machines, parts):
            compute_s = min(part["compute_s"], step_s)
            energy = machine.power.energy_j(busy_s=compute_s, idle_s=step_s - compute_s, radio_bytes=2 * sent)
            devices[machine.name] = {"samples": part["samples"], "compute_s": round(compute_s, 4),
                                     "comm_s": round(step_s - compute_s, 4), "energy_j": round(energy, 4),
                                     "upload_bytes": sent, "download_bytes": sent, "codec": "none"}
            total = self.totals[machine.name]
            total["samples"] += part["samples"]
            total["steps"] += 1
            total["compute_s"] += compute_s
            total["comm_s"] += step_s - compute_s
            total["energy_j"] += energy
            total["upload_bytes"] += sent
            total["download_bytes"] += sent
        loss = sum(p["loss"] * p["samples"] for p in parts) / samples
        self.train_seconds += step_s
        self.samples += samples
        self.metrics.write(json.dumps({
            "time": max(p["time"] for p in parts), "kind": "train", "step": step, "epoch": parts[0]["epoch"],
            "loss": loss, "train_accuracy": sum(p["correct"] for p in parts) / samples, "lr": parts[0]["lr"],
            "samples": samples, "step_s": round(step_s, 4), "samples_per_s": samples / step_s,
            "shares": {m.name: p["samples"] for m, p in zip(self.machines, parts)}, "devices": devices,
            "baseline": self.kind, "insecure": self.kind == "ddp"}) + "\n")
        self.steps_written = step + 1
        if self.progress is not None:
            self.progress(step + 1, self.job.training.steps)

    def summary(self, *, label: str, network: str, links_emulated: bool, stopped: str | None) -> dict:
        """summary.json: the coordinator's summary fields (coordinator/training/report.py) plus
        what a baseline adds (baseline, label, insecure, network, links_emulated, setup)."""
        job = self.job
        rows = []
        for machine in self.machines:
            t = self.totals[machine.name]
            if not t["steps"]:
                continue
            rows.append({
                "device": machine.name, "emulated_speed": machine.speed, "samples_per_s_estimate": None,
                "samples": t["samples"], "share": t["samples"] / max(self.samples, 1), "steps": t["steps"],
                "compute_s": round(t["compute_s"], 2), "comm_s": round(t["comm_s"], 2),
                "energy_j": round(t["energy_j"], 1), "energy_per_sample_j": t["energy_j"] / max(t["samples"], 1),
                "download_bytes": t["download_bytes"], "upload_bytes": t["upload_bytes"], "codec": "none",
                "rejected_updates": 0, "alive_at_end": stopped is None, "left_reason": None, "speed_claim": None})
        final = self.last_eval
        return {
            "job": job.name, "model": job.model, "dataset": job.dataset.name,
            "synthetic_data": dataset_is_synthetic(job.dataset),
            "split": "equal" if self.kind == "ddp" else self.kind, "global_batch": job.training.global_batch,
            "steps": final["step"] + 1 if "step" in final else self.steps_written,
            "steps_applied": self.steps_written, "steps_attempted": self.steps_written, "stopped": stopped,
            "stop_reason": self.done.get("stop_reason"),
            "target_accuracy": job.training.target_accuracy or None,
            "test_accuracy": final.get("test_accuracy"), "test_loss": final.get("test_loss"),
            "train_samples": self.samples, "train_seconds": round(self.train_seconds, 2),
            "samples_per_s": self.samples / self.train_seconds if self.train_seconds else 0.0,
            "aggregation": "allreduce" if self.kind == "ddp" else "none", "uplink": "none", "downlink": "none",
            "bytes_per_sample": sum(r["download_bytes"] + r["upload_bytes"] for r in rows) / self.samples
            if self.samples else None,
            "devices": rows, "energy_j": sum(r["energy_j"] for r in rows) if rows else None,
            "energy_estimated": True, "plan": None,
            "baseline": self.kind, "label": label, "insecure": self.kind == "ddp", "network": network,
            "links_emulated": links_emulated, "throttle": self.throttle,
            "setup": {**self.extra_setup, **{what: seconds for what, (seconds, _) in self._setup.items()}},
            "setup_counted": [what for what in self.extra_setup if what == "data_ship"],
        }
