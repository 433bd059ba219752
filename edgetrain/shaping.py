"""Application-level link emulation: rate (token buckets), one-way delay and chunk loss.

Used for a board's link when network namespaces are unavailable (not root), and for delay and
loss always (this kernel has no netem). The client calls `before_send` per upload chunk,
`after_receive` per download chunk and `rpc_delay` per call; a lost chunk breaks the transfer,
which then resumes from the last acknowledged byte.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class LinkSpec:
    """An emulated link between a board and the LAN."""

    mbit_per_s: float
    """Link rate, Mbit/s (each direction)."""
    delay_ms: float = 0.0
    """One-way delay added to every call, milliseconds."""
    loss: float = 0.0
    """Probability that a transfer chunk is lost (the transfer then resumes), in [0, 1)."""

    def __post_init__(self) -> None:
        if not self.mbit_per_s > 0:
            raise ValueError(f"mbit_per_s must be > 0, got {self.mbit_per_s}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")


class TokenBucket:
    """Lets bytes through at `rate` per second with bursts up to `burst_bytes` (thread-safe)."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int) -> None:
        self._lock = threading.Lock()
        self._rate = rate_bytes_per_s
        self._burst = burst_bytes
        self._tokens = float(burst_bytes)
        self._last = time.monotonic()

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Change the rate from now on."""
        with self._lock:
            self._refill()
            self._rate = rate_bytes_per_s

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def consume(self, nbytes: int) -> None:
        """Block until `nbytes` may pass (debt is allowed, so large chunks pass at the rate)."""
        with self._lock:
            self._refill()
            self._tokens -= nbytes
            wait = -self._tokens / self._rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def _bucket(spec: LinkSpec) -> TokenBucket:
    rate = spec.mbit_per_s * 1e6 / 8
    return TokenBucket(rate, burst_bytes=max(64 * 1024, int(rate * 0.01)))


class LinkShaper:
    """Rate, delay and loss of one board's link, changeable while the board runs."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._up = _bucket(spec)
        self._down = _bucket(spec)

    def set_link(self, spec: LinkSpec) -> None:
        """Apply a new link (a scripted change)."""
        self.spec = spec
        rate = spec.mbit_per_s * 1e6 / 8
        self._up.set_rate(rate)
        self._down.set_rate(rate)

    def before_send(self, nbytes: int) -> None:
        """Pace an upload of `nbytes`."""
        self._up.consume(nbytes)

    def after_receive(self, nbytes: int) -> None:
        """Pace a download of `nbytes`."""
        self._down.consume(nbytes)

    def rpc_delay(self) -> None:
        """The round trip's added delay."""
        if self.spec.delay_ms:
            time.sleep(2 * self.spec.delay_ms / 1000)

    def lost(self, rng: random.Random) -> bool:
        """Whether the next chunk is lost."""
        return self.spec.loss > 0 and rng.random() < self.spec.loss
