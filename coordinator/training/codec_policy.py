"""Which codec each board's link gets: fixed from the job, or chosen from measured bandwidth.

Adaptive rule (per board): candidates in order of increasing loss — none, fp16, int8,
PowerSGD (rank `powersgd_rank`), top-k — each with its bytes per step (update up, plus full
parameters down for `none` or the downlink deltas for the others). Predicted transfer time =
bytes x 8 / measured bandwidth. The board gets the least lossy codec whose transfer time is
within `adaptive_budget` x the step's predicted compute time; if none is, the dense codec (fp16,
int8) with the fewest bytes as long as it stays within `adaptive_limit` x the compute time, then
PowerSGD within that limit (low-rank, error feedback: it costs less accuracy than top-k,
docs/benchmarks.md#channel); only beyond that the fewest bytes (top-k, usually). Top-k 1% delays
most coordinates' updates by tens of steps and trains far slower per step, so it is kept for links
that nothing else can use. The choice is revisited only when the board's bandwidth moved by more
than `hysteresis` (relative) since it was made, so measurement noise does not make it flip. A board with no bandwidth measurement yet keeps `none`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from edgetrain.config import CompressionConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkChoice:
    """One board's codecs for a step."""

    codec: str
    """Update codec (up)."""
    delta_codec: str
    """Parameter-delta codec (down); empty: full parameters."""
    reason: str = ""


class CodecPolicy:
    """Per-board codec choice (stateful only for hysteresis)."""

    def __init__(self, cfg: CompressionConfig, update_bytes: Callable[[str], int], full_bytes: int,
                 delta_bytes: int) -> None:
        self.cfg = cfg
        self._update_bytes = update_bytes
        self._full_bytes = full_bytes
        self._delta_bytes = delta_bytes
        self._delta_codec = "" if cfg.downlink == "none" else cfg.downlink
        self._chosen: dict[str, tuple[LinkChoice, float]] = {}
        self.candidates = ["none", "fp16", "int8", f"powersgd:{cfg.powersgd_rank}", f"topk:{cfg.topk_ratio:g}"]

    def step_bytes(self, codec: str) -> int:
        """Bytes a board moves per step with `codec` up (and the matching download)."""
        down = self._full_bytes if codec == "none" or not self._delta_codec else self._delta_bytes
        return self._update_bytes(codec) + down

    def choose(self, device_id: str, mbit_per_s: float | None, compute_s: float) -> LinkChoice:
        """The codecs for `device_id` this step."""
        if self.cfg.uplink != "adaptive":
            return LinkChoice(self.cfg.uplink, self._delta_codec)
        previous = self._chosen.get(device_id)
        if mbit_per_s is None or mbit_per_s <= 0:
            return previous[0] if previous else LinkChoice("none", "", "no bandwidth measured yet")
        if previous and abs(mbit_per_s / previous[1] - 1) <= self.cfg.hysteresis:
            return previous[0]
        budget_s = self.cfg.adaptive_budget * compute_s
        seconds = {c: self.step_bytes(c) * 8 / (mbit_per_s * 1e6) for c in self.candidates}
        fitting = [c for c in self.candidates if seconds[c] <= budget_s]
        limit_s = self.cfg.adaptive_limit * compute_s
        dense = [c for c in self.candidates[1:3] if seconds[c] <= limit_s]
        low_rank = self.candidates[3]
        if fitting:
            codec = fitting[0]
        elif dense:
            codec = min(dense, key=lambda c: seconds[c])
        elif seconds[low_rank] <= limit_s:
            codec = low_rank
        else:
            codec = min(self.candidates, key=lambda c: seconds[c])
        choice = LinkChoice(codec, "" if codec == "none" else self._delta_codec,
                            f"{mbit_per_s:.1f} Mbit/s: {seconds[codec] * 1000:.0f} ms per step for "
                            f"{self.step_bytes(codec) / 1e6:.2f} MB against a budget of {budget_s * 1000:.0f} ms")
        if previous is None or previous[0].codec != codec:
            logger.info("[Coordinator.Codec] %s -> %s (%s)", device_id, codec, choice.reason)
        self._chosen[device_id] = (choice, mbit_per_s)
        return choice

    def retain(self, device_ids: set[str]) -> None:
        """Forget the state of boards not in `device_ids` (departed)."""
        for device_id in set(self._chosen) - device_ids:
            del self._chosen[device_id]
