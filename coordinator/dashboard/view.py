"""What the dashboard shows of a run: its boards (from the registry, live) and its records
(read from the run's metrics.jsonl as the trainer appends them).

`RunView.state()` is one JSON-ready snapshot: the page renders it, `/events` streams it and the
Prometheus collector reads its numbers, so the three never disagree.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

from coordinator.registry import DeviceRegistry

STEPS_KEPT = 500
"""Train records the view holds (the curves' points; older ones stay in metrics.jsonl)."""
TIMELINE_STEPS = 20
"""Steps shown in the per-board step timeline."""


class MetricsTail:
    """Reads the records appended to a metrics.jsonl since the last call (a line still being
    written is left for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_records(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data, self._partial = self._partial + data, b""
        lines = data.split(b"\n")
        if lines and lines[-1]:
            self._partial = lines[-1]
        out = []
        for line in lines[:-1]:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not ours to judge here: the run's report says what is wrong with the file
            if isinstance(record, dict):
                out.append(record)
        return out


class RunView:
    """A live view of one run: `registry` for the boards, `run_dir`/metrics.jsonl for the steps."""

    def __init__(self, job_name: str, run_dir: Path, registry: DeviceRegistry, *, synthetic: bool,
                 ideal_samples_per_s: float | None = None, classes: tuple[str, ...] = ()) -> None:
        self.job_name = job_name
        self.classes = classes
        """The dataset's class names (what a board's shared own-data class counts are counted in)."""
        self.synthetic = synthetic
        self.ideal_samples_per_s = ideal_samples_per_s
        self._registry = registry
        self._tail = MetricsTail(Path(run_dir) / "metrics.jsonl")
        self._lock = threading.Lock()
        self._steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        self._evals: deque[dict] = deque(maxlen=STEPS_KEPT)
        self._plans: list[dict] = []
        self._beside: set[str] = set()
        """Devices that were handed local work beside the steps (the newest plan's, while it holds)."""
        self._trial: dict | None = None
        """The planner's last measured trial (its plan_trial record)."""
        self._failures: deque[dict] = deque(maxlen=100)
        self._boards_in_steps: set[str] | None = None
        self._ever: set[str] = set()

    def _read(self, names: dict[str, str]) -> None:
        for record in self._tail.new_records():
            kind = record.get("kind")
            if kind == "train":
                self._steps.append(record)
                self._note_membership(record, names)
                self._beside |= set(record.get("beside", {}))
                for failure in record.get("failures", []):
                    self._failures.append({"step": record.get("step"), **failure})
                for attempt in record.get("attempt_log", []):
                    if attempt.get("lost") and not any("failed" in f for f in record.get("failures", [])):
                        self._failures.append({"step": record.get("step"), "attempt": attempt.get("attempt"),
                                               "lost": attempt["lost"], "outcome": attempt.get("outcome")})
            elif kind == "eval":
                self._evals.append(record)
            elif kind == "plan":
                self._plans.append(record)
                if record.get("switched"):  # a new plan: its boards beside the steps show as their work arrives
                    self._beside = set()
            elif kind == "plan_trial":
                self._trial = record

    def _note_membership(self, record: dict, names: dict[str, str]) -> None:
        """A step whose boards differ from the last one's was planned anew (a board left, joined,
        or the split gave it nothing this time): listed with the plans, unless the planner's own
        record for that step already is."""
        boards = {names.get(d, d) for d in set(record.get("shares", {})) | set(record.get("stages", {}))}
        before, self._boards_in_steps = self._boards_in_steps, boards
        planned = any(p.get("kind") == "plan" and p.get("step") == record.get("step") for p in self._plans[-3:])
        if before is None or boards == before or planned:
            self._ever |= boards
            return
        self._plans.append({"kind": "membership", "step": record.get("step"), "switched": True,
                            "boards": sorted(boards), "left": sorted(before - boards),
                            "joined": sorted(boards - before),
                            "reasons": [f"without {d}" for d in sorted(before - boards)]
                            + [f"with {d} again" if d in self._ever else f"with {d}" for d in sorted(boards - before)]})
        self._ever |= boards

    def state(self) -> dict:
        """The run now (JSON-ready)."""
        with self._lock:
            records = self._registry.snapshot()
            names = {r.device_id: r.name for r in records}
            self._read(names)
            steps = list(self._steps)
            last = steps[-1] if steps else {}
            return {
                "job": self.job_name,
                "synthetic_data": self.synthetic,
                "ideal_samples_per_s": self.ideal_samples_per_s or _profiled_sum(records),
                "boards": [_board(r, last, self.classes, self._beside) for r in records],
                "plan": _plan_picture(last, self._plans, steps, names, records, self._trial) if last else None,
                "curves": [{"step": s.get("step"), "time": s.get("time"), "loss": s.get("loss"),
                            "train_accuracy": s.get("train_accuracy"), "samples_per_s": s.get("samples_per_s"),
                            "energy_j": _step_energy(s)} for s in steps],
                "evals": [{"step": e.get("step"), "time": e.get("time"), "accuracy": e.get("test_accuracy"),
                           "loss": e.get("test_loss")} for e in self._evals],
                "timeline": [{"step": s.get("step"), "step_s": s.get("step_s"), "boards": _step_parts(s, names)}
                             for s in steps[-TIMELINE_STEPS:]],
                "plans": list(self._plans),
                "failures": [_named(f, names) for f in self._failures],
                "last_step": {"step": last.get("step"), "step_s": last.get("step_s"),
                              "predicted_step_s": last.get("predicted_step_s"), "shares": last.get("shares", {}),
                              "loss": last.get("loss"), "samples_per_s": last.get("samples_per_s")} if last else None,
            }


def _named(failure: dict, names: dict[str, str]) -> dict:
    """A failure record with board names for device ids (what the page shows)."""
    out = dict(failure)
    for key in ("failed", "no_usable_update"):
        if isinstance(out.get(key), dict):
            out[key] = {names.get(d, d): why for d, why in out[key].items()}
    if isinstance(out.get("lost"), list):
        out["lost"] = [names.get(d, d) for d in out["lost"]]
    return out


def _step_parts(step: dict, names: dict[str, str]) -> dict[str, dict]:
    """Each board's seconds of one step: compute, communication, waiting, idle. A pipeline's
    stage hosts count separately (compute, waiting for their neighbours, the rest idle), not as
    the merged pipeline the aggregation saw."""
    stages = step.get("stages", {})
    parts = {names.get(d, d): {k: v.get(k) for k in ("compute_s", "comm_s", "waiting_s", "idle_s")}
             for d, v in step.get("devices", {}).items()
             if not (stages and d.startswith("pipeline") and d[len("pipeline"):].isdigit())}
    for d, st in stages.items():
        compute, wait = st.get("compute_s") or 0.0, st.get("wait_s") or 0.0
        parts[names.get(d, d)] = {"compute_s": compute, "comm_s": None, "waiting_s": wait,
                                  "idle_s": round(max(0.0, (step.get("step_s") or 0.0) - compute - wait), 4)}
    return parts


def _profiled_sum(records) -> float | None:
    """The fleet's ideal when none was given: the sum of the live boards' own samples/s, each
    at the best batch it profiled (training alone, no communication)."""
    speeds = [max(batch / seconds for batch, seconds in r.profile.timings)
              for r in records if r.state == "ready" and r.profile is not None]
    return round(sum(speeds), 2) if speeds else None


def _plan_picture(last: dict, plans: list[dict], steps: list[dict], names: dict[str, str], records=(),
                  trial: dict | None = None) -> dict:
    """The plan the last step ran, as the page draws it: pipeline stages (blocks, hosts: more
    than one host is a sample-split group, or a channel group with each member's share of the
    channels), DP shards with their samples, the micro-batches and
    schedule and the boards left out (from the planner's last record, when the planner is on),
    and the predicted against the measured step time (median of the last steps). Without the
    planner, a ready board the split gave nothing is listed as left out."""
    name = lambda d: names.get(d, d)  # noqa: E731
    by_stage: dict[int, dict] = {}
    for d, s in sorted(last.get("stages", {}).items(), key=lambda kv: (kv[1].get("stage", 0), name(kv[0]))):
        entry = by_stage.setdefault(s.get("stage", 0), {"stage": s.get("stage", 0), "blocks": s.get("blocks"),
                                                       "boards": []})
        entry["boards"].append({"name": name(d), "samples": last.get("shares", {}).get(d)})
        if s.get("channels"):  # a channel group: each member's share of the channels
            entry["boards"][-1]["channels"] = s["channels"]
            entry["split"] = "channels"
    shards = [{"name": name(d), "samples": n} for d, n in last.get("shares", {}).items()
              if d not in last.get("stages", {})]
    planned = next((p for p in reversed(plans) if p.get("kind") == "plan"), None)
    section = (planned or {}).get("plan", {})
    recent = sorted(s["step_s"] for s in steps[-10:] if s.get("step_s"))
    kind = ("hybrid" if by_stage and shards else "pipeline" if by_stage else "dp")
    return {
        "kind": kind, "source": "planner" if planned else "proportional split",
        "stages": [by_stage[k] for k in sorted(by_stage)], "shards": shards,
        "microbatches": section.get("microbatches") if by_stage else None,
        "schedule": section.get("schedule") if by_stage else None,
        "local": [name(d) for d in (planned or {}).get("local_boards", [])],
        "measured": None if trial is None else {
            "steps": [trial.get("started"), trial.get("step")], "noise_scale": trial.get("noise_scale"),
            "candidates": [{"plan": c.get("plan"), "measured_step_s": c.get("measured_step_s"),
                            "efficiency": c.get("efficiency"), "score": c.get("score"),
                            "kept": i == trial.get("chosen")} for i, c in enumerate(trial.get("candidates", []))]},
        "left_out": (planned or {}).get("left_out") or {
            r.name: "no samples this step" for r in records
            if r.state == "ready" and r.device_id not in last.get("shares", {}) and r.device_id not in last.get("stages", {})},
        "predicted_step_s": last.get("predicted_step_s") or (planned or {}).get("predicted_step_s"),
        "measured_step_s": recent[len(recent) // 2] if recent else None,
        "step": last.get("step"),
    }


def _step_energy(step: dict) -> float | None:
    values = [v.get("energy_j") for v in step.get("devices", {}).values()]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _board(record, last_step: dict, classes: tuple[str, ...] = (), beside: set[str] = frozenset()) -> dict:
    """One board's row: identity, role in the last step, its data, live telemetry, totals."""
    t = record.latest_telemetry
    shares = last_step.get("shares", {})
    stages = last_step.get("stages", {})
    # the registry's state in the page's words; a ready board with work in the last step is training
    state = {"gone": "lost", "registered": "joining"}.get(record.state, record.state)
    if state == "ready" and (record.device_id in shares or record.device_id in stages):
        state = "training"
    beside = (record.device_id in beside or record.device_id in last_step.get("beside", {})) and \
        record.device_id not in shares and record.device_id not in stages
    if state == "ready" and beside:
        state = "training"
    role = ("stage" if record.device_id in stages else "shard" if record.device_id in shares
            else "local" if beside else "")
    stats = record.stats
    return {
        "id": record.device_id, "name": record.name, "state": state, "role": role,
        "left_reason": record.left_reason, "codec": record.codec,
        "share": shares.get(record.device_id),
        "own_data": record.own_data(classes),
        "device": record.profile.device if record.profile else None,
        "emulated_speed": record.info.get("emulated_speed"),
        "samples_per_s": (stats["samples"] / stats["compute_s"]) if stats.get("compute_s") else None,
        "samples": stats.get("samples", 0), "steps": stats.get("steps", 0),
        "download_bytes": stats.get("download_bytes", 0), "upload_bytes": stats.get("upload_bytes", 0),
        "failures": len(record.rejections),
        "cpu_percent": t.cpu_percent if t else None,
        "memory_used_bytes": t.memory_used_bytes if t else None,
        "memory_total_bytes": t.memory_total_bytes if t else None,
        "battery_percent": t.battery_percent if t else None,
        "temperature_c": t.temperature_c if t else None,
        "link_mbit_per_s": t.link_mbit_per_s if t else None,
        "rtt_ms": t.rtt_ms if t else None,
        "energy_j": t.energy_j if t else None,
    }


class JobServerView:
    """A live view of a job server: its jobs (state, boards, planned start, predicted finish,
    progress) and its lobby of boards. The same shape as `RunView.state()`, with `jobs` added and
    no step curves (each job's coordinator serves those of its run)."""

    def __init__(self, server) -> None:
        self._server = server  # coordinator.jobs.server.JobServer (duck-typed: the roles' layering)

    def state(self) -> dict:
        jobs, boards = self._server.snapshot()
        return {
            "job": "job server", "synthetic_data": None, "ideal_samples_per_s": None,
            "jobs": [{"id": j.id, "name": j.name, "model": j.model, "state": j.state, "boards": list(j.boards),
                      "request": j.request, "planned_start": j.planned_start or None,
                      "predicted_finish": j.predicted_finish or None, "steps": j.steps,
                      "steps_done": j.steps_done, "predicted_samples_per_s": j.predicted_samples_per_s or None,
                      "measured_samples_per_s": j.measured_samples_per_s or None, "message": j.message,
                      "dashboard": self._server.dashboard_url(j)}
                     for j in jobs],
            "boards": [{"id": b.name, "name": b.name, "state": "lost" if not b.alive else
                        ("training" if b.job else "ready"), "role": f"job {b.job}" if b.job else "",
                        "share": None, "emulated_speed": None, "samples_per_s": None,
                        "speed": b.speed, "link_mbit_per_s": b.mbit_per_s or None, "rtt_ms": None,
                        "cpu_percent": None, "memory_used_bytes": None, "memory_total_bytes": None,
                        "battery_percent": None, "temperature_c": None, "energy_j": None, "codec": "",
                        "samples": 0, "steps": 0, "download_bytes": 0, "upload_bytes": 0, "failures": 0,
                        "left_reason": "", "flag": b.flag}
                       for b in sorted(boards, key=lambda b: b.name)],
            "curves": [], "evals": [], "timeline": [], "plans": [], "failures": [], "last_step": None,
        }
