"""One board's telemetry sample as plain data; None means the board cannot report the value."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TelemetrySample:
    """What a board reports about itself at one moment (see protos Telemetry)."""

    timestamp: float
    """Board wall clock, seconds since the epoch."""
    cpu_percent: float | None = None
    """CPU use in percent of what the board has (of its emulated share when emulated)."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    battery_percent: float | None = None
    battery_charging: bool | None = None
    temperature_c: float | None = None
    cpu_freq_mhz: float | None = None
    link_mbit_per_s: float | None = None
    """Measured bandwidth to the coordinator."""
    rtt_ms: float | None = None
    """Measured round-trip time to the coordinator."""
    energy_j: float | None = None
    """Energy used since the board started."""
    step_compute_s: float | None = None
    step_comm_s: float | None = None
    plugged: bool | None = None
    """On mains power (True) or running from its battery (False)."""
    idle_w: float | None = None
    busy_w: float | None = None
    """The board's power model (watts idle, and training), when it knows one."""
    energy_measured: bool | None = None
    """energy_j is read from a sensor (True) rather than estimated from a power model."""

    def known(self) -> dict:
        """The fields the board could report."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
