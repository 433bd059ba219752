"""Admitted devices: their description, profile, speed estimate and liveness (in memory).

A board's profile is a claim: the speed it says it trains at. Each step it trains refines the
estimate from what was measured — its compute time, bounded by the coordinator's own clock (from
taking the work to the upload being complete, less the transfers). When, after its first steps,
the measured step times are far off what the claim predicts (CLAIM_TOLERANCE either way), the
board is flagged (`claim_note`, a warning on the log) and its speed estimate is replaced by the
measurement: it is planned by what it does, not by what it says. A pipeline stage host's stage
compute refines the same whole-model estimate, given the stage's share of the model's work
(`observe_stage`).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from edgetrain.split import SpeedEstimate, fit_speed, refine_speed
from edgetrain.telemetry import TelemetrySample
from edgetrain.work import BoardProfile

TELEMETRY_WINDOW = 120
"""Samples kept per device (two minutes at the default 1 s interval)."""
GONE_KEPT = 64
"""Records of departed devices kept for reports; older ones are forgotten (a crash-looping board
must not grow the coordinator's memory without bound)."""

CLAIM_CHECK_STEPS = 3
STEP_TIMES_KEPT = 8
"""Latest steps per board from which rate_noise measures how its step times scatter."""
"""Steps measured before a board's claimed speed is judged (its first step, which carries the
warm-up of a fresh process, is not one of them)."""
CLAIM_TOLERANCE = 3.0
"""A claim is far off when the measured step compute time is more than this factor above or below
what the claimed speed predicts for the same samples..."""
CLAIM_SLACK_S = 0.25
"""...and off by more than this many seconds too (tiny steps are dominated by fixed costs that a
profile of the bare forward and backward pass does not include)."""

LOCAL_PACE_GROWTH = 1.25
"""A landed local update grows a board's local pace by this factor (at most 1)."""
MIN_LOCAL_PACE = 1 / 16
"""The pace never drops below this: a board that keeps missing gets small tickets, not none."""

logger = logging.getLogger(__name__)


class UnknownDevice(KeyError):
    """A device id the registry does not know (never registered, or dropped)."""

    def __str__(self) -> str:
        return f"unknown device id {self.args[0]!r}; register again"


@dataclass
class DeviceRecord:
    """One admitted device."""

    device_id: str
    name: str
    info: dict
    versions: dict
    joined_at: float
    last_seen: float
    profile: BoardProfile | None = None
    speed: SpeedEstimate | None = None
    alive: bool = True
    left_reason: str = ""
    stats: dict = field(default_factory=lambda: {"samples": 0, "compute_s": 0.0, "comm_s": 0.0, "steps": 0,
                                                 "energy_j": 0.0, "energy_samples": 0, "energy_steps": 0, "download_bytes": 0,
                                                 "upload_bytes": 0})
    telemetry: deque = field(default_factory=lambda: deque(maxlen=TELEMETRY_WINDOW))
    """Rolling window of (coordinator receive time, TelemetrySample)."""
    codec: str = ""
    """The update codec the coordinator last chose for this board."""
    stage_address: str = ""
    """host:port of the board's StagePeer endpoint (pipeline traffic), if it serves one."""
    rejections: list = field(default_factory=list)
    """(step, reason) of every update the coordinator refused from this board."""
    quarantined_until: int = -1
    """The board gets no work before this step (a board that kept sending bad updates)."""
    claimed: SpeedEstimate | None = None
    """The speed its profile claims (fitted from its join-time timings)."""
    measured: deque = field(default_factory=lambda: deque(maxlen=2 * CLAIM_CHECK_STEPS))
    """(samples, compute seconds) of its latest measured steps."""
    step_times: deque = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))
    """(step, samples, compute seconds) of its latest measured data-parallel steps (the split's noise)."""
    out_of_memory: bool = False
    """Its device ran out of memory for the stage it was given, and the planner has not yet taken
    it into account (see memory_cap_bytes)."""
    memory_cap_bytes: int | None = None
    """The most memory the planner may count on for it, below what its stage needed when its
    device ran out (None: what its profile says)."""
    claim_note: str = ""
    """Set when its measured speed was far off its claim: what it claimed and what was measured."""
    local_pace: float = 1.0
    """How much of the local work its measured speed predicts fits the staleness bound it is given
    beside the steps (coordinator.planning.local_members): halved each time an update misses the
    bound, grown back as updates land (`pace_local`)."""

    @property
    def local_samples(self) -> int:
        """Samples of the board's own data, which it trains on alone (0: it trains on the job's dataset)."""
        return self.profile.local_samples if self.profile else 0

    def own_data(self, classes: tuple[str, ...]) -> dict | None:
        """What the board told about its own data: its sample count and, if it shared them, its
        samples per class by name (`classes`: the job's); None when it trains on the job's dataset.
        Never images: the coordinator has none of them."""
        if not self.local_samples:
            return None
        counts = self.profile.local_class_counts
        return {"samples": self.local_samples,
                "class_counts": {name: n for name, n in zip(classes, counts) if n} if counts else None}

    @property
    def latest_telemetry(self) -> TelemetrySample | None:
        """The newest sample, if any arrived."""
        return self.telemetry[-1][1] if self.telemetry else None

    quarantined: bool = False
    """Set while the board is excluded for bad updates."""

    @property
    def state(self) -> str:
        """registered (not yet profiled), ready, quarantined, or gone."""
        if not self.alive:
            return "gone"
        if self.quarantined:
            return "quarantined"
        return "ready" if self.speed is not None else "registered"

    @property
    def ready(self) -> bool:
        """Alive and profiled: it can be given work."""
        return self.alive and self.speed is not None


class DeviceRegistry:
    """Thread-safe in-memory registry of devices. Ids are never reused within a run."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._devices: dict[str, DeviceRecord] = {}
        self._ids = itertools.count(1)
        self.changed = threading.Condition(self._lock)
        """Notified whenever membership, readiness or liveness changes."""

    def register(self, name: str, info: dict, versions: dict, stage_address: str = "") -> DeviceRecord:
        """Admit a device; a re-registering name gets a fresh id, its old record is dropped."""
        with self._lock:
            for record in self._devices.values():
                if record.name == name and record.alive:
                    self._drop(record, "re-registered")
            now = self._clock()
            device_id = f"{name}-{next(self._ids)}"
            record = DeviceRecord(device_id, name, info, versions, now, now, stage_address=stage_address)
            self._devices[device_id] = record
            self.changed.notify_all()
            return record

    def get(self, device_id: str) -> DeviceRecord:
        """The live record for `device_id`, or UnknownDevice."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is None or not record.alive:
                raise UnknownDevice(device_id)
            return record

    def set_profile(self, device_id: str, profile: BoardProfile) -> SpeedEstimate:
        """Store the device's profile and derive its speed estimate from it."""
        speed = fit_speed(profile.timings)
        with self._lock:
            record = self._live(device_id)
            record.profile, record.speed, record.claimed = profile, speed, speed
            record.measured.clear()
            record.step_times.clear()
            record.claim_note = ""
            self.changed.notify_all()
        return speed

    def heartbeat(self, device_id: str, telemetry: TelemetrySample | None = None) -> None:
        """Mark the device as seen now and keep its telemetry sample, if any."""
        with self._lock:
            record = self._live(device_id)
            record.last_seen = self._clock()
            if telemetry is not None:
                record.telemetry.append((record.last_seen, telemetry))

    def telemetry_window(self, device_id: str) -> list[tuple[float, TelemetrySample]]:
        """(receive time, sample) pairs of a device, oldest first — what planners read."""
        with self._lock:
            if device_id not in self._devices:
                raise UnknownDevice(device_id)
            return list(self._devices[device_id].telemetry)

    def observe_step(self, device_id: str, samples: int, compute_s: float, comm_s: float,
                     energy_j: float | None = None, *, turnaround_s: float | None = None,
                     step: int | None = None) -> None:
        """Refine the device's speed from one step's timings and accumulate its stats.

        `compute_s` and `comm_s` are what the board reported; `turnaround_s`, the coordinator's
        own clock from the board taking its work to its upload being complete, bounds them: the
        compute time used is at least the turnaround less the reported transfers, and at most
        the turnaround. Then the board's claimed speed is checked against its measured steps.
        `step` (the step the work was for) lets rate_noise compare the boards measured together."""
        if turnaround_s is not None and math.isfinite(turnaround_s) and turnaround_s >= 0:
            compute_s = min(max(compute_s, turnaround_s - comm_s), turnaround_s)
        with self._lock:
            record = self._devices.get(device_id)
            if record is None:  # long gone and forgotten
                return
            if record.speed is not None:
                # a board's first step carries its warm-up (its transfers on the emulated fleet
                # 1.3-2x its later ones), and the split may leave out, for good, a board whose
                # transfers it over-predicts: its communication counts from its second step
                warmed_up = record.stats["steps"] > 0
                record.speed = refine_speed(record.speed, samples, compute_s, comm_s if warmed_up else 0.0)
                if samples > 0 and warmed_up:
                    record.measured.append((samples, compute_s))
                    if step is not None:
                        record.step_times.append((step, samples, compute_s))
                    self._check_claim(record)
            if energy_j is not None:
                record.stats["energy_j"] += energy_j
                record.stats["energy_samples"] += samples
                record.stats["energy_steps"] += 1
            for key, value in (("samples", samples), ("compute_s", compute_s), ("comm_s", comm_s),
                               ("steps", 1)):
                record.stats[key] += value

    def rate_noise(self, device_ids) -> float:
        """How much the devices' compute times scatter against each other from step to step: each
        measured step's time over its speed estimate's prediction, divided by the median of that
        ratio over the devices measured at the same step (a slowdown of the whole machine moves
        every board alike and not the best split); the median over `device_ids` of each one's
        relative standard deviation of that over its latest steps. 0 while fewer than two
        devices have three steps in common."""
        ratios: dict[str, dict[int, float]] = {}
        with self._lock:
            for device_id in device_ids:
                record = self._devices.get(device_id)
                if record is None or record.speed is None:
                    continue
                speed = SpeedEstimate(record.speed.overhead_s, record.speed.samples_per_s)  # compute only
                ratios[device_id] = {k: t / speed.seconds(n) for k, n, t in record.step_times if n > 0}
        by_step: dict[int, list[float]] = {}
        for mine in ratios.values():
            for k, r in mine.items():
                by_step.setdefault(k, []).append(r)
        common = {k: statistics.median(rs) for k, rs in by_step.items() if len(rs) >= 2}
        spreads = []
        for mine in ratios.values():
            relative = [r / common[k] for k, r in mine.items() if k in common]
            if len(relative) >= 3:
                spreads.append(statistics.stdev(relative) / statistics.fmean(relative))
        return statistics.median(spreads) if spreads else 0.0

    def _check_claim(self, record: DeviceRecord) -> None:
        """Flag a board whose measured steps are far off its claimed speed, and plan it by the
        measurement from then on (see the module docstring)."""
        claimed = record.claimed
        if claimed is None or record.claim_note or len(record.measured) < CLAIM_CHECK_STEPS:
            return
        points = list(record.measured)
        took = statistics.median(t for _, t in points)
        predicted = statistics.median(claimed.seconds(n) for n, _ in points)
        if took <= CLAIM_TOLERANCE * predicted + CLAIM_SLACK_S and predicted <= CLAIM_TOLERANCE * took + CLAIM_SLACK_S:
            return
        measured = fit_speed(points)
        record.speed = SpeedEstimate(measured.overhead_s, measured.samples_per_s, record.speed.comm_s)
        median_samples = statistics.median(n for n, _ in points)
        record.claim_note = (f"claimed {median_samples / predicted:.1f} samples/s, measured {median_samples / took:.1f} "
                             f"over {len(points)} steps")
        logger.warning("[Coordinator.Registry] device %s: %s (%.1fx %s than its profile claims); planning it by "
                       "the measurement", record.device_id, record.claim_note, max(took / predicted, predicted / took),
                       "slower" if took > predicted else "faster")

    def note_rejection(self, device_id: str, step: int, reason: str, *, limit: int, window: int,
                       quarantine_steps: int) -> bool:
        """Record a refused update; quarantine the board (returns True) when it had `limit`
        refusals within the last `window` steps."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is None:
                return False
            record.rejections.append((step, reason))
            del record.rejections[:-64]
            recent = [s for s, _ in record.rejections if s > step - window]
            if len(recent) >= limit and quarantine_steps > 0 and not record.quarantined:
                record.quarantined, record.quarantined_until = True, step + 1 + quarantine_steps
                logger.warning("[Coordinator.Registry] device %s quarantined until step %d: %d updates refused "
                               "in %d steps (last: %s)", device_id, record.quarantined_until, len(recent), window,
                               reason)
                return True
            return False

    def release_quarantine(self, step: int) -> None:
        """End the quarantine of boards whose term is over at `step`."""
        with self._lock:
            for record in self._devices.values():
                if record.quarantined and step >= record.quarantined_until:
                    record.quarantined = False
                    record.rejections.clear()
                    logger.info("[Coordinator.Registry] device %s back from quarantine", record.device_id)

    def count_bytes(self, device_id: str, *, down: int = 0, up: int = 0) -> None:
        """Payload bytes moved to (down) and from (up) the device."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is not None:
                record.stats["download_bytes"] += down
                record.stats["upload_bytes"] += up

    def set_codec(self, device_id: str, codec: str) -> None:
        """Remember the codec chosen for the board (shown by `edgetrain devices`)."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is not None:
                record.codec = codec

    def observe_late(self, device_id: str, samples: int, seconds: float) -> None:
        """The device did not answer within `seconds`: count the overrun as communication time
        (the compute estimate comes from its measured compute; what it loses is on the way)."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is not None and record.speed is not None and samples:
                compute = record.speed.seconds(samples) - record.speed.comm_s
                if seconds - compute > record.speed.comm_s:
                    record.speed = refine_speed(record.speed, 0, 0.0, seconds - compute, weight=0.5)

    def pace_local(self, device_id: str, landed: bool) -> None:
        """A local update of a board beside the steps landed within the staleness bound, or missed
        it: its next ones are sized at LOCAL_PACE_GROWTH times (at most 1) or half the pace. A miss
        says the round trip ran long, not by how much (the board abandons it), so it does not
        change the speed estimate the steps are split by."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is not None:
                pace = record.local_pace * LOCAL_PACE_GROWTH if landed else record.local_pace / 2
                record.local_pace = min(1.0, max(MIN_LOCAL_PACE, pace))

    def observe_stage(self, device_id: str, samples: int, compute_s: float, comm_s: float,
                      energy_j: float | None = None, *, work_fraction: float | None = None,
                      calls: int = 1) -> None:
        """Accumulate a pipeline stage host's step, and refine its speed from it when the stage's
        share of the model's work is known.

        The speed estimate is for the whole model; a stage of `work_fraction` of the model's
        training work, run as `calls` forward+backward calls (the micro-batches it had rows of),
        takes `calls · overhead · fraction + samples · fraction / rate` (the planner's cost model,
        coordinator.planning.cost), so `compute_s / fraction − (calls − 1) · overhead` is what the
        whole model would have taken in one call: that refines the rate as a DP step does. A
        board's first step (its warm-up) does not refine it; nor does a channel group member's
        (None: it computes a share of some layers' channels, not of rows)."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is None:
                return
            usable = (work_fraction is not None and 0 < work_fraction <= 1 and samples > 0 and calls >= 1
                      and math.isfinite(compute_s) and compute_s > 0)
            if usable and record.speed is not None and record.stats["steps"] > 0:
                whole_s = compute_s / work_fraction - (calls - 1) * record.speed.overhead_s
                record.speed = refine_speed(record.speed, samples, whole_s, 0.0)
            if energy_j is not None:
                record.stats["energy_j"] += energy_j
                record.stats["energy_samples"] += samples
                record.stats["energy_steps"] += 1
            for key, value in (("samples", samples), ("compute_s", compute_s), ("comm_s", comm_s), ("steps", 1)):
                record.stats[key] += value

    def note_out_of_memory(self, device_id: str) -> None:
        """The board's device ran out of memory for its stage: the planner plans with less for it."""
        with self._lock:
            self._live(device_id).out_of_memory = True
            self.changed.notify_all()

    def cap_memory(self, device_id: str, cap_bytes: int) -> None:
        """The planner counts on at most `cap_bytes` of memory for the board from now on (its
        out-of-memory report is taken into account)."""
        with self._lock:
            record = self._devices[device_id]
            record.memory_cap_bytes, record.out_of_memory = cap_bytes, False

    def drop(self, device_id: str, reason: str) -> None:
        """Consider the device gone (it must register again to get work)."""
        with self._lock:
            record = self._devices.get(device_id)
            if record is not None and record.alive:
                self._drop(record, reason)

    def expire(self, timeout_s: float) -> list[str]:
        """Drop devices silent for longer than `timeout_s`; returns their ids."""
        with self._lock:
            now = self._clock()
            stale = [r for r in self._devices.values() if r.alive and now - r.last_seen > timeout_s]
            for record in stale:
                self._drop(record, f"no heartbeat for {now - record.last_seen:.1f} s")
            return [r.device_id for r in stale]

    def wait_ready(self, count: int, timeout_s: float) -> dict[str, SpeedEstimate]:
        """Like `ready`, but first waits up to `timeout_s` for at least `count` ready devices."""
        with self.changed:
            self.changed.wait_for(lambda: sum(r.ready for r in self._devices.values()) >= count, timeout_s)
            return {r.device_id: r.speed for r in self._devices.values() if r.ready}

    def is_alive(self, device_id: str) -> bool:
        """True while the device is registered and has not been dropped."""
        with self._lock:
            record = self._devices.get(device_id)
            return record is not None and record.alive

    def snapshot(self) -> list[DeviceRecord]:
        """Copies of all records, live and gone."""
        with self._lock:
            return [replace(r, stats=dict(r.stats), telemetry=deque(r.telemetry, maxlen=TELEMETRY_WINDOW),
                            rejections=list(r.rejections), measured=deque(r.measured, maxlen=r.measured.maxlen))
                    for r in self._devices.values()]

    def _live(self, device_id: str) -> DeviceRecord:
        record = self._devices.get(device_id)
        if record is None or not record.alive:
            raise UnknownDevice(device_id)
        return record

    def _drop(self, record: DeviceRecord, reason: str) -> None:
        record.alive, record.left_reason = False, reason
        logger.warning("[Coordinator.Registry] device %s dropped: %s", record.device_id, reason)
        gone = [r.device_id for r in self._devices.values() if not r.alive]
        for device_id in gone[: max(0, len(gone) - GONE_KEPT)]:
            del self._devices[device_id]
        self.changed.notify_all()
