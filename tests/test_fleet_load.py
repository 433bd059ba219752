"""Load on one coordinator (edgetrain.emulator.fleet_load): light boards in several processes, each
with its own certificate, register with a real coordinator process over mutual TLS, profile, and
are answered heartbeat after heartbeat while it lists every one of them alive. No latency is
asserted here (scripts/bench_fleet_load.py measures it)."""

from __future__ import annotations

import pytest

from edgetrain.emulator.fleet_load import percentile, run_fleet_load

pytestmark = pytest.mark.timeout(180)


def test_light_boards_register_stay_alive_and_get_replies(tmp_path) -> None:
    # Execute: 16 boards in 2 processes, 3 heartbeats each at 0.5 s (presence streams and work polls held open)
    result = run_fleet_load(boards=16, processes=2, seconds=1.5, heartbeat_interval_s=0.5, workdir=tmp_path)

    # Assert: every board registered, the coordinator lists each alive, and every board was answered
    assert result["registered"] == 16
    assert result["alive"] == 16, result
    assert result["boards_answered"] == 16, result
    assert result["heartbeat_errors"] == 0 and result["errors"] == [], result["errors"]
    assert result["heartbeats"] >= 16 * 2
    assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["cores"] >= 1
    certificates = {(d / "cert.pem").read_bytes() for d in (tmp_path / "boards").iterdir()}
    assert len(certificates) == 16  # each board its own; the coordinator admits a name only with its own


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile([7.0], 0.99) == 7.0


def test_bad_sizes_are_refused_before_anything_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match="processes <= boards"):
        run_fleet_load(boards=2, processes=3, seconds=1, workdir=tmp_path)
    assert not any(tmp_path.iterdir())
