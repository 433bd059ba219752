"""Emulated battery: draining, plugged, empty, energy accounting; the real battery's reading."""

from __future__ import annotations

import threading

import pytest

from edgetrain.board_hardware import BatteryReading, real_battery
from edgetrain.emulator.battery import EmulatedBattery, energy_j
from edgetrain.fleet_file import BatterySpec


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _battery(**overrides) -> tuple[EmulatedBattery, FakeClock]:
    spec = BatterySpec(**{"capacity_wh": 1.0, "idle_w": 3.6, "busy_w": 36.0, **overrides})
    clock = FakeClock()
    return EmulatedBattery(spec, clock=clock), clock


def test_busy_drains_ten_percent_in_ten_seconds() -> None:
    # Prepare: 1 Wh = 3600 J; 36 W for 10 s = 360 J
    battery, clock = _battery()
    # Execute
    battery.set_busy(True)
    clock.advance(10)
    # Assert
    assert battery.percent() == pytest.approx(90.0)
    assert battery.energy_j() == pytest.approx(360.0)


def test_idle_drains_at_idle_power() -> None:
    battery, clock = _battery()
    battery.set_busy(True)
    clock.advance(10)
    battery.set_busy(False)
    clock.advance(100)
    assert battery.energy_j() == pytest.approx(360.0 + 360.0)
    assert battery.percent() == pytest.approx(80.0)


def test_plugged_does_not_drain_but_counts_energy() -> None:
    battery, clock = _battery(plugged=True, initial_percent=50.0)
    battery.set_busy(True)
    clock.advance(30)
    reading = battery.read()
    assert reading == BatteryReading(percent=50.0, charging=True, energy_j=pytest.approx(1080.0))
    assert battery.charging and not battery.empty


def test_plugged_charges_at_charge_w_up_to_full() -> None:
    battery, clock = _battery(plugged=True, initial_percent=50.0, charge_w=18.0)
    clock.advance(50)  # 900 J = 25 %
    assert battery.percent() == pytest.approx(75.0)
    clock.advance(1000)
    assert battery.percent() == pytest.approx(100.0)


def test_empty_at_zero_and_never_below() -> None:
    battery, clock = _battery(initial_percent=5.0)
    battery.set_busy(True)
    clock.advance(4)
    assert not battery.empty
    clock.advance(10)
    assert battery.empty
    assert battery.read().percent == 0.0 and not battery.read().charging


def test_energy_per_step_is_the_difference_of_readings() -> None:
    # Prepare
    battery, clock = _battery()
    clock.advance(5)
    before = battery.energy_j()
    # Execute: a step of 2 s compute and 1 s communication
    battery.set_busy(True)
    clock.advance(2)
    battery.set_busy(False)
    clock.advance(1)
    # Assert
    assert battery.energy_j() - before == pytest.approx(2 * 36.0 + 1 * 3.6)


def test_account_without_a_clock() -> None:
    battery = EmulatedBattery(BatterySpec(capacity_wh=1.0, idle_w=3.6, busy_w=36.0), clock=None)
    battery.account(10, 100)
    assert battery.energy_j() == pytest.approx(720.0)
    assert battery.percent() == pytest.approx(80.0)


def test_concurrent_accounting_loses_nothing() -> None:
    battery = EmulatedBattery(BatterySpec(capacity_wh=100.0, idle_w=1.0, busy_w=2.0), clock=None)
    threads = [threading.Thread(target=lambda: [battery.account(0.5, 1.0) for _ in range(1000)])
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert battery.energy_j() == pytest.approx(8 * 1000 * 2.0)


@pytest.mark.parametrize("bad, match", [
    ({"capacity_wh": 0}, "capacity_wh"),
    ({"idle_w": -1}, "idle_w"),
    ({"busy_w": 1.0}, "busy_w .* idle_w"),
    ({"busy_w": float("inf")}, "busy_w"),
    ({"initial_percent": 101}, "initial_percent"),
    ({"charge_w": -2}, "charge_w"),
])
def test_spec_is_validated(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatterySpec(**{"capacity_wh": 1.0, "idle_w": 3.6, "busy_w": 36.0, **bad})


def test_energy_from_power_figures() -> None:
    assert energy_j(busy_s=10, idle_s=20, idle_w=1.5, busy_w=7.5) == pytest.approx(105.0)
    with pytest.raises(ValueError, match="durations"):
        energy_j(busy_s=-1, idle_s=0, idle_w=1, busy_w=2)


def test_real_battery_is_none_or_a_reading() -> None:
    reading = real_battery()
    assert reading is None or (0 <= reading.percent <= 100 and reading.energy_j is None)
