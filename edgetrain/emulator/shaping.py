"""Application-level link emulation: rate, delay and loss applied by the client itself.

Used for the rate when the fleet cannot use network namespaces (not root), and for delay and
loss always, since the kernel here has no netem. The client calls
:meth:`LinkShaper.before_send` per upload chunk, :meth:`LinkShaper.after_receive` per download
chunk and :meth:`LinkShaper.rpc_delay` per unary call, and draws :meth:`LinkShaper.lost` per
chunk, resuming a lost transfer from the last acknowledged byte.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from edgetrain.fleet_file import LinkSpec

_MAX_SLEEP_S = 0.05
"""A waiting consumer re-checks the rate this often, so a live rate change applies within it."""

_MIN_BURST_S = 0.01
"""A shaper's bucket holds this much time at the link rate (and at least 16 KiB): the little
that may pass at once after an idle spell, like the queue of a real link."""


class TokenBucket:
    """Lets bytes through at ``rate_bytes_per_s`` with bursts up to ``burst_bytes``; thread-safe.

    A request larger than the bucket is allowed and paid for afterwards: the caller waits until
    the bucket is back at zero, so chunks of any size average out to the rate. Callers are
    served in the order they asked.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        _check_rate(rate_bytes_per_s)
        if burst_bytes <= 0:
            raise ValueError(f"burst_bytes must be > 0, got {burst_bytes}")
        self._rate = float(rate_bytes_per_s)
        self._burst = burst_bytes
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = float(burst_bytes)
        self._credited = 0.0
        """Bytes the rate has paid in since construction, uncapped: a waiter's finish line."""
        self._last = clock()

    @property
    def rate(self) -> float:
        """Current rate in bytes per second."""
        return self._rate

    def consume(self, n: int) -> None:
        """Block until ``n`` more bytes may pass."""
        if n < 0:
            raise ValueError(f"cannot consume a negative byte count ({n})")
        with self._lock:
            self._refill()
            self._tokens -= n
            finish = self._credited + max(0.0, -self._tokens)
        while True:
            with self._lock:
                self._refill()
                owed, rate = finish - self._credited, self._rate
            if owed <= 0:
                return
            self._sleep(min(owed / rate, _MAX_SLEEP_S))

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Change the rate from now on, also for callers already waiting."""
        _check_rate(rate_bytes_per_s)
        with self._lock:
            self._refill()
            self._rate = float(rate_bytes_per_s)

    def _refill(self) -> None:
        now = self._clock()
        earned = (now - self._last) * self._rate
        self._last = now
        self._credited += earned
        self._tokens = min(float(self._burst), self._tokens + earned)


class _Random(Protocol):
    def random(self) -> float: ...


class LinkShaper:
    """Holds a client's traffic to a :class:`LinkSpec`; ``None`` leaves it unshaped (and free).

    Each direction has its own bucket, so an upload does not slow a concurrent download.
    """

    def __init__(self, spec: LinkSpec | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._spec: LinkSpec | None = None
        self._up: TokenBucket | None = None
        self._down: TokenBucket | None = None
        self.set_link(spec)

    @property
    def spec(self) -> LinkSpec | None:
        """The link being emulated, or None."""
        return self._spec

    def before_send(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may go out on the link (call before sending each chunk)."""
        bucket = self._up
        if bucket is not None:
            bucket.consume(nbytes)

    def after_receive(self, nbytes: int) -> None:
        """Wait as long as ``nbytes`` would take to arrive (call after receiving each chunk)."""
        bucket = self._down
        if bucket is not None:
            bucket.consume(nbytes)

    def rpc_delay(self) -> None:
        """Wait one round trip, 2 x delay_ms (call once per unary RPC)."""
        spec = self._spec
        if spec is not None and spec.delay_ms > 0:
            self._sleep(2 * spec.delay_ms / 1000)

    def lost(self, rng: _Random) -> bool:
        """Draw whether a chunk is lost, with the link's loss probability."""
        spec = self._spec
        return spec is not None and spec.loss > 0 and rng.random() < spec.loss

    def set_link(self, spec: LinkSpec | None) -> None:
        """Switch to another link (or to unshaped) from now on, e.g. for scripted link changes."""
        with self._lock:
            if spec is None:
                self._up = self._down = None
            elif self._up is not None and self._down is not None:
                self._up.set_rate(spec.bytes_per_s)
                self._down.set_rate(spec.bytes_per_s)
            else:
                burst = max(16 * 1024, int(spec.bytes_per_s * _MIN_BURST_S))
                self._up = TokenBucket(spec.bytes_per_s, burst, clock=self._clock, sleep=self._sleep)
                self._down = TokenBucket(spec.bytes_per_s, burst, clock=self._clock, sleep=self._sleep)
            self._spec = spec


def _check_rate(rate_bytes_per_s: float) -> None:
    if not (math.isfinite(rate_bytes_per_s) and rate_bytes_per_s > 0):
        raise ValueError(f"rate_bytes_per_s must be a finite number > 0, got {rate_bytes_per_s}")
