"""The job server's lobby boards: what each claimed at ``Join``, and what its jobs measured.

At ``Join`` a board claims its speed (its time for ``edgetrain.speed_reference``'s workload, as a
fraction of one core of the job server's machine) and its link (from its own ``Probe`` timings).
The job server cannot take either on trust, and measures what it can itself: every job's
coordinator logs each step's wall time (``step_s``, timed by the coordinator, not reported by a
board) in its metrics. From a job that ran on one board alone the server derives the speed at
which the planner's prediction matches those measured steps (``speed.implied_speed``), with the
board's link taken as the faster of its claim and its uploads in that job (also timed by the
coordinator; an unknown link assumed slow would make the steps look like a fast board's). A board
whose claim is more than ``FAR_OFF`` times off that measurement is flagged (logged, and shown by
``ListJobs`` / ``edgetrain jobs``) and planned by the measurement from then on; a consistent
claim is planned as claimed.

What is not judged here: a board's link claim on its own (the lobby ``Probe`` is paced by the
board, which could make it look as fast as it likes; its uploads, timed by the coordinator, only
bound its link from below, and on a slow board they are bound by its CPU; a slow link shows up in
its measured steps instead), and boards that only ran jobs together with others (a step waits
for the slowest board, so a slow step does not say which one).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

FAR_OFF = 3.0
"""A claim this many times above or below the measurement is flagged."""
MIN_STEPS = 3
"""Measured steps a job needs before its median step time says anything of its board."""


@dataclass
class LobbyBoard:
    """A board the job server knows."""

    name: str
    claimed_speed: float
    """Fraction of one core of this machine, from its Join (reference workload timed on both);
    0: adopted after a restart, it has not joined this server yet."""
    mbit_per_s: float
    """The link it claimed at Join (0: unknown)."""
    last_seen: float
    job: str = ""
    """Job id it is assigned to ("" when free)."""
    alive: bool = True
    measured_speed: float = 0.0
    """Speed its latest job alone measured (0: not measured yet)."""
    measured_in: str = ""
    """That job's id."""

    @property
    def far_off(self) -> bool:
        """Its claim is more than FAR_OFF times from what it measured."""
        return far_off(self.claimed_speed, self.measured_speed)

    @property
    def speed(self) -> float:
        """What the scheduler plans with: the claim, or the measurement when the claim is far off."""
        return self.measured_speed if self.far_off else self.claimed_speed

    @property
    def flag(self) -> str:
        """Why its claim is not believed ("" when it is consistent or not measured)."""
        if not self.far_off:
            return ""
        return (f"claims {self.claimed_speed:.2f} of a core; its steps in job {self.measured_in} measured "
                f"{self.measured_speed:.2f}")


def far_off(claimed: float, measured: float) -> bool:
    """Whether a claimed speed is more than FAR_OFF times above or below a measured one (False
    when either is unknown)."""
    if claimed <= 0 or measured <= 0:
        return False
    return not 1 / FAR_OFF <= measured / claimed <= FAR_OFF


def step_rate(records: list[dict], since: float) -> float:
    """Samples per second of a job's steps logged at or after `since` (its current launch): the
    median over steps that trained (samples > 0) of samples / step_s, from the coordinator's own
    clock; 0 with fewer than MIN_STEPS such steps."""
    rates = [r["samples"] / r["step_s"] for r in records
             if r.get("time", 0.0) >= since and (r.get("samples") or 0) > 0 and (r.get("step_s") or 0) > 0]
    return statistics.median(rates) if len(rates) >= MIN_STEPS else 0.0


def upload_mbit(records: list[dict], since: float) -> float:
    """Median Mbit/s of the uploads in a job's steps logged at or after `since`, each timed by the
    coordinator from its first byte to its last (0 when none was timed)."""
    rates = [8e-6 * d["upload_bytes"] / d["upload_s"] for r in records if r.get("time", 0.0) >= since
             for d in (r.get("devices") or {}).values()
             if (d.get("upload_bytes") or 0) > 0 and (d.get("upload_s") or 0) > 0]
    return statistics.median(rates) if rates else 0.0
