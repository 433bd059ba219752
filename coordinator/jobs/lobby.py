"""The job server's lobby boards: what each claimed at ``Join``, and what its jobs measured.

At ``Join`` a board claims its speed (its time for ``edgetrain.speed_reference``'s workload, as a
fraction of one core of the job server's machine) and its link (from its own ``Probe`` timings).
The job server cannot take either on trust, and measures what it can itself: every job's
coordinator logs each step's wall time (``step_s``, timed by the coordinator, not reported by a
board) in its metrics. From a job that ran on one board alone the server derives the speed at
which the planner's prediction matches those measured steps (``speed.implied_speed``), with the
board's link taken as the faster of its claim and its uploads in that job (also timed by the
coordinator; an unknown link assumed slow would make the steps look like a fast board's).

Claims and measurements are both made against this machine's core, at different times and under
different load (the server's reference time once at start, a model's cost when a job of it is
first submitted), so they may disagree by a common factor. Once ``CALIBRATION_BOARDS`` boards are
measured, the median of measured / claimed over them is that factor (``fleet_ratio``; 1 before),
and a board is judged against the others: it is flagged when its measurement is more than
``FAR_OFF`` times above or below what its claim and the fleet's ratio predict. A flagged board is
logged, shown by ``ListJobs`` / ``edgetrain jobs``, and planned by its measurement (in the claims'
terms: divided by the fleet's ratio) from then on; a consistent claim is planned as claimed. One
board's lie cannot move a median of three.

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
"""Measured steps (after a launch's first, which warms up) a job needs before its median says
anything of its board."""
CALIBRATION_BOARDS = 3
"""Boards measured before their median measured / claimed ratio calibrates the others."""


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
    implied_speed: float = 0.0
    """The speed its latest job alone implies under the planner's model (0: not measured yet)."""
    measured_in: str = ""
    """That job's id."""
    fleet_ratio: float = 1.0
    """The fleet's median implied / claimed speed (1 until CALIBRATION_BOARDS are measured)."""

    @property
    def measured_speed(self) -> float:
        """What its steps measured, in the claims' terms (0: not measured yet)."""
        return self.implied_speed / self.fleet_ratio

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
        calibrated = f" (other boards' steps measured {self.fleet_ratio:.2f}x their claims)" \
            if self.fleet_ratio != 1.0 else ""
        return (f"claims {self.claimed_speed:.2f} of a core; its steps in job {self.measured_in} measured "
                f"{self.measured_speed:.2f}{calibrated}")


def far_off(claimed: float, measured: float) -> bool:
    """Whether a claimed speed is more than FAR_OFF times above or below a measured one (False
    when either is unknown)."""
    if claimed <= 0 or measured <= 0:
        return False
    return not 1 / FAR_OFF <= measured / claimed <= FAR_OFF


def fleet_ratio(boards: list[LobbyBoard]) -> float:
    """The median implied / claimed speed of the measured boards; 1 with fewer than
    CALIBRATION_BOARDS of them."""
    ratios = [b.implied_speed / b.claimed_speed for b in boards if b.implied_speed > 0 and b.claimed_speed > 0]
    return statistics.median(ratios) if len(ratios) >= CALIBRATION_BOARDS else 1.0


def step_rate(records: list[dict], since: float) -> float:
    """Samples per second of a job's steps logged at or after `since` (its current launch): the
    median over steps that trained (samples > 0), after the first, of samples / step_s, from the
    coordinator's own clock; 0 with fewer than MIN_STEPS such steps."""
    rates = [r["samples"] / r["step_s"] for r in records
             if r.get("time", 0.0) >= since and (r.get("samples") or 0) > 0 and (r.get("step_s") or 0) > 0]
    return statistics.median(rates[1:]) if len(rates) > MIN_STEPS else 0.0


def upload_mbit(records: list[dict], since: float) -> float:
    """Median Mbit/s of the uploads in a job's steps logged at or after `since`, each timed by the
    coordinator from its first byte to its last (0 when none was timed). A streamed upload went
    during compute, so its time says nothing of the link: the step's parameter download (about
    as many bytes, on the same link) stands in for it."""
    rates = [8e-6 * d["upload_bytes"] / seconds for r in records if r.get("time", 0.0) >= since
             for d in (r.get("devices") or {}).values()
             for seconds in [d.get("download_s" if d.get("upload_streamed") else "upload_s") or 0]
             if (d.get("upload_bytes") or 0) > 0 and seconds > 0]
    return statistics.median(rates) if rates else 0.0
