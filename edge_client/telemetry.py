"""What a board reports about itself: CPU, memory, battery, temperature, link, energy.

psutil answers for real boards; a value the board cannot report (no battery, no sensors, a
cpu_freq of 0) is sent as unknown, never as 0. An emulated board reports its emulated battery
through exactly the same fields, and its CPU use relative to its emulated share of a core.
Energy says whether it was measured (a battery's energy counter) or estimated (a power model).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

import psutil

from edgetrain.board_hardware import BatteryReading, real_battery
from edgetrain.telemetry import TelemetrySample

logger = logging.getLogger(__name__)

THERMAL_SENSORS = ("cpu_thermal", "cpu-thermal", "CPU-therm", "soc_thermal", "coretemp", "k10temp")
"""Sensor names tried in order: Raspberry Pi, Jetson, then x86."""

MIN_PASSIVE_BYTES = 1 << 20
"""Real transfers at least this large also measure the link (no probe traffic needed)."""


class LinkMeter:
    """Bandwidth and RTT to the coordinator, from probes and from the board's real transfers."""

    def __init__(self, window: int = 5) -> None:
        self._lock = threading.Lock()
        self._mbit: deque[float] = deque(maxlen=window)
        self._rtt_s: deque[float] = deque(maxlen=2 * window)
        self._measured_at = float("-inf")

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A transfer of `nbytes` took `seconds` (ignored when too small to say much)."""
        if nbytes >= MIN_PASSIVE_BYTES and seconds > 0:
            self.observe_bandwidth(nbytes * 8 / seconds / 1e6)

    def observe_bandwidth(self, mbit_per_s: float) -> None:
        """One bandwidth measurement."""
        with self._lock:
            self._mbit.append(mbit_per_s)
            self._measured_at = time.monotonic()

    def age_s(self) -> float:
        """Seconds since the last bandwidth measurement (inf before the first)."""
        with self._lock:
            return time.monotonic() - self._measured_at

    def observe_rtt(self, seconds: float) -> None:
        """One round-trip measurement (a small unary call)."""
        with self._lock:
            self._rtt_s.append(seconds)

    def mbit_per_s(self) -> float | None:
        """Median of recent bandwidth measurements, or None before the first."""
        with self._lock:
            return statistics.median(self._mbit) if self._mbit else None

    def rtt_ms(self) -> float | None:
        """Smallest recent round trip (queueing only ever adds), or None before the first."""
        with self._lock:
            return min(self._rtt_s) * 1000 if self._rtt_s else None


def probe_link(send: Callable[[bytes], None], meter: LinkMeter, *, small: int = 64 << 10,
               large: int = 576 << 10, settle_s: float = 0.05) -> float:
    """Measure bandwidth to the coordinator with two probe sizes; returns Mbit/s.

    Timing the difference between a large and a small payload cancels the per-call latency and
    a shaper's initial burst, which a single probe would count as bandwidth. Where the large
    payload took no longer than the small one (a link fast enough that its transfer is lost in
    the call's jitter, as on loopback), the large payload over its call's whole time is the
    estimate: a lower bound, where no estimate left the board planned at an assumed slow rate
    until a large transfer measured it, which a board left out of the plan for that never makes.
    """
    timings = {}
    for size in (small, large, small, large):
        time.sleep(settle_s)  # let a token-bucket shaper refill between probes
        started = time.perf_counter()
        send(bytes(size))
        elapsed = time.perf_counter() - started
        timings[size] = min(timings.get(size, elapsed), elapsed)
    meter.observe_rtt(timings[small])
    if timings[large] <= 0:  # a clock that did not move: no estimate this time
        return float("nan")
    spent = timings[large] - timings[small]  # <= 0: jitter swamped the difference; at least this fast
    mbit = ((large - small) / spent if spent > 0 else large / timings[large]) * 8 / 1e6
    meter.observe_bandwidth(mbit)
    return mbit


def read_temperature() -> float | None:
    """CPU temperature in °C from the first known sensor, or None when the board has none."""
    try:
        sensors = psutil.sensors_temperatures()
    except (AttributeError, OSError):
        return None
    for name in THERMAL_SENSORS:
        for entry in sensors.get(name, []):
            if entry.current:
                return float(entry.current)
    return None


def read_cpu_freq() -> float | None:
    """Current CPU frequency in MHz, or None when unknown (None or 0 from psutil)."""
    try:
        freq = psutil.cpu_freq()
    except (AttributeError, OSError, NotImplementedError):
        return None
    return float(freq.current) if freq and freq.current else None


def _host_memory() -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return memory.total, memory.available


class TelemetryCollector:
    """Builds telemetry samples for one board (real or emulated)."""

    def __init__(self, *, link: LinkMeter, emulated_speed: float | None = None,
                 battery: Callable[[], BatteryReading | None] = real_battery,
                 energy_j: Callable[[], float | None] = lambda: None,
                 energy_measured: Callable[[], bool] = lambda: False,
                 plugged: bool | None = None, power_w: tuple[float, float] | None = None,
                 memory: Callable[[], tuple[int, int]] | None = None) -> None:
        self.link = link
        self._memory = memory or _host_memory
        self._energy_measured = energy_measured
        self._power_w = power_w
        self._speed = emulated_speed
        self._battery = battery
        self._energy_j = energy_j
        self._plugged = plugged
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)
        self.last_step: tuple[float, float] | None = None
        """(compute seconds, communication seconds) of the last training step."""

    def _cpu_percent(self) -> float:
        if self._speed:  # an emulated board: of the share of a core it emulates
            return min(100.0, self._process.cpu_percent(None) / self._speed)
        return psutil.cpu_percent(None)

    def sample(self) -> TelemetrySample:
        """A sample of the board's state now."""
        memory_total, memory_available = self._memory()
        battery = self._battery()
        compute_s, comm_s = self.last_step or (None, None)
        plugged = self._plugged
        if battery is not None and plugged is None:
            plugged = battery.charging
        energy = self._energy_j()  # read before asking whether it was measured: the answer is about this reading
        return TelemetrySample(
            timestamp=time.time(), cpu_percent=self._cpu_percent(), memory_used_bytes=memory_total - memory_available,
            memory_total_bytes=memory_total, battery_percent=battery.percent if battery else None,
            battery_charging=battery.charging if battery and battery.charging is not None else None, temperature_c=read_temperature(),
            cpu_freq_mhz=read_cpu_freq(), link_mbit_per_s=self.link.mbit_per_s(), rtt_ms=self.link.rtt_ms(),
            energy_j=energy, energy_measured=self._energy_measured() if energy is not None else None,
            step_compute_s=compute_s, step_comm_s=comm_s, plugged=plugged,
            idle_w=self._power_w[0] if self._power_w else None, busy_w=self._power_w[1] if self._power_w else None)
