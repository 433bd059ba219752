"""The device registry: liveness, telemetry window, and bounded memory for departed devices."""

from __future__ import annotations

import pytest

from coordinator.registry import GONE_KEPT, TELEMETRY_WINDOW, DeviceRegistry, UnknownDevice
from edgetrain.telemetry import TelemetrySample


def test_departed_devices_are_forgotten_beyond_a_bound() -> None:
    # Prepare
    registry = DeviceRegistry()
    ids = [registry.register(f"b{i}", {}, {}).device_id for i in range(GONE_KEPT + 10)]

    # Execute
    for device_id in ids:
        registry.drop(device_id, "left")

    # Assert: the newest departures are kept for reports, the oldest forgotten
    kept = [r.device_id for r in registry.snapshot()]
    assert kept == ids[-GONE_KEPT:]
    registry.observe_step(ids[0], 4, 0.1, 0.1)  # a late report about a forgotten device is ignored
    with pytest.raises(UnknownDevice):
        registry.telemetry_window(ids[0])


def test_expiry_and_telemetry_window() -> None:
    # Prepare: a controllable clock
    now = [0.0]
    registry = DeviceRegistry(clock=lambda: now[0])
    device_id = registry.register("b", {}, {}).device_id

    # Execute
    for t in range(TELEMETRY_WINDOW + 5):
        now[0] = float(t)
        registry.heartbeat(device_id, TelemetrySample(timestamp=float(t), battery_percent=50.0))
    now[0] += 11
    expired = registry.expire(timeout_s=10)

    # Assert
    window = registry.telemetry_window(device_id)
    assert len(window) == TELEMETRY_WINDOW and window[-1][1].timestamp == TELEMETRY_WINDOW + 4
    assert expired == [device_id] and not registry.is_alive(device_id)
