"""Application-level link emulation: token bucket rate, live changes, delay, loss, validation."""

from __future__ import annotations

import random
import threading
import time

import pytest

from edgetrain.emulator.shaping import LinkShaper, TokenBucket
from edgetrain.fleet_file import LinkSpec

MB = 1_000_000


class FakeTime:
    """A clock that only moves when someone sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def test_bucket_moves_2_mb_at_4_mb_per_s_no_faster_than_the_rate() -> None:
    # Prepare
    bucket = TokenBucket(4 * MB, burst_bytes=16 * 1024)
    # Execute
    elapsed = _timed(lambda: [bucket.consume(64 * 1024) for _ in range(2 * MB // (64 * 1024))])
    # Assert: never faster than the rate on the real clock (a busy machine only adds to each sleep;
    # the exact pacing is checked with a fake clock below)
    assert elapsed >= 0.8 * 0.5, elapsed


def test_bucket_shares_the_rate_between_threads() -> None:
    bucket = TokenBucket(4 * MB, burst_bytes=16 * 1024)
    threads = [threading.Thread(target=lambda: [bucket.consume(100_000) for _ in range(5)])
               for _ in range(4)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.perf_counter() - started >= 0.8 * 0.5  # not faster than the shared rate


def test_chunks_larger_than_the_burst_pass_at_the_rate() -> None:
    fake = FakeTime()
    bucket = TokenBucket(1 * MB, burst_bytes=1000, clock=fake.clock, sleep=fake.sleep)
    bucket.consume(1000)  # the burst passes at once
    assert fake.now == 0.0
    bucket.consume(3 * MB)
    assert fake.now == pytest.approx(3.0)


def test_live_rate_change_applies_to_a_waiting_caller() -> None:
    # Prepare: 1 MB/s, a 1 MB chunk that would take 1 s; the rate goes to 10 MB/s while the
    # caller waits, 0.2 s (0.2 MB paid) into its wait
    fake = FakeTime()

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        if fake.now >= 0.2 - 1e-9 and bucket.rate == 1 * MB:
            bucket.set_rate(10 * MB)

    bucket = TokenBucket(1 * MB, burst_bytes=1000, clock=fake.clock, sleep=sleep)
    bucket.consume(1000)
    # Execute
    bucket.consume(1 * MB)
    # Assert: the remaining 0.8 MB went at the new rate: 0.2 + 0.08 s, not 1 s
    assert bucket.rate == 10 * MB
    assert fake.now == pytest.approx(0.28)


def test_rate_change_with_a_fake_clock_is_exact() -> None:
    fake = FakeTime()
    bucket = TokenBucket(1 * MB, burst_bytes=1, clock=fake.clock, sleep=fake.sleep)
    bucket.consume(1)
    bucket.consume(2 * MB)
    assert fake.now == pytest.approx(2.0)
    bucket.set_rate(4 * MB)
    bucket.consume(2 * MB)
    assert fake.now == pytest.approx(2.5)


def test_unshaped_is_instant() -> None:
    fake = FakeTime()
    shaper = LinkShaper(None, clock=fake.clock, sleep=fake.sleep)
    rng = random.Random(0)
    for _ in range(1000):
        shaper.before_send(MB), shaper.after_receive(MB), shaper.rpc_delay()
    assert fake.now == 0.0  # 1 GB each way without a single wait
    assert not any(shaper.lost(rng) for _ in range(1000))


def test_shaper_directions_have_separate_buckets() -> None:
    # Prepare: 16 Mbit/s = 2 MB/s each way, on a fake clock
    fake = FakeTime()
    shaper = LinkShaper(LinkSpec(mbit_per_s=16), clock=fake.clock, sleep=fake.sleep)
    shaper.before_send(500_000)  # the upload waits until its debt is paid
    sent_by = fake.now
    # Execute: a download of one small chunk right after
    shaper.after_receive(16 * 1024)
    # Assert: the download's bucket was untouched by the upload: no wait (one shared bucket, just
    # emptied by the upload, would make it wait 16 KiB / 2 MB/s)
    assert sent_by > 0.2
    assert fake.now == sent_by


def test_rpc_delay_is_the_round_trip() -> None:
    fake = FakeTime()
    LinkShaper(LinkSpec(mbit_per_s=10, delay_ms=40), sleep=fake.sleep).rpc_delay()
    assert fake.now == pytest.approx(0.08)
    assert _timed(LinkShaper(LinkSpec(mbit_per_s=10, delay_ms=40)).rpc_delay) >= 0.07


def test_loss_draws_match_the_probability() -> None:
    shaper = LinkShaper(LinkSpec(mbit_per_s=10, loss=0.1))
    rng = random.Random(1234)
    lost = sum(shaper.lost(rng) for _ in range(20_000))
    assert 0.09 <= lost / 20_000 <= 0.11
    assert not any(LinkShaper(LinkSpec(mbit_per_s=10)).lost(rng) for _ in range(1000))


def test_set_link_changes_rate_delay_loss_and_can_unshape() -> None:
    fake = FakeTime()
    shaper = LinkShaper(LinkSpec(mbit_per_s=8), clock=fake.clock, sleep=fake.sleep)
    shaper.set_link(LinkSpec(mbit_per_s=80, delay_ms=5, loss=0.5))
    assert shaper.spec == LinkSpec(mbit_per_s=80, delay_ms=5, loss=0.5)
    # 1.1 MB at the new 80 Mbit/s: 0.11 s less the burst (at the old 8 Mbit/s it would be 1.1 s)
    for _ in range(11):
        shaper.before_send(100_000)
    assert 0.09 <= fake.now <= 0.11
    sent_by = fake.now
    shaper.rpc_delay()
    assert fake.now == pytest.approx(sent_by + 0.01)
    shaper.set_link(None)
    shaper.before_send(100 * MB)  # 10 s if still shaped
    assert fake.now == pytest.approx(sent_by + 0.01) and not shaper.lost(random.Random(0))
    shaper.set_link(LinkSpec(mbit_per_s=8))
    assert shaper.spec.mbit_per_s == 8


@pytest.mark.parametrize("bad, match", [
    ({"mbit_per_s": 0}, "mbit_per_s"),
    ({"mbit_per_s": float("nan")}, "mbit_per_s"),
    ({"mbit_per_s": 1, "delay_ms": -1}, "delay_ms"),
    ({"mbit_per_s": 1, "loss": 1.0}, "loss"),
    ({"mbit_per_s": 1, "loss": -0.1}, "loss"),
])
def test_link_spec_is_validated(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LinkSpec(**bad)


def test_bucket_is_validated() -> None:
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0, 100)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(100, 0)
    with pytest.raises(ValueError, match="negative"):
        TokenBucket(100, 100).consume(-1)
