"""Energy accounting on a board: from its emulated battery, from power figures, or unknown."""

from __future__ import annotations

import time

import pytest

from edgetrain.board_hardware import EnergyMeter
from edgetrain.emulator.battery import EmulatedBattery
from edgetrain.emulator.board import BoardEmulation
from edgetrain.fleet_file import BatterySpec
from edgetrain.power import PowerModel


def test_energy_from_power_figures_counts_busy_time_at_busy_power() -> None:
    # Prepare
    meter = EnergyMeter(power=PowerModel(idle_w=1.0, busy_w=11.0))
    start = meter.energy_j()

    # Execute
    with meter.busy():
        time.sleep(0.2)
    used = meter.energy_j() - start

    # Assert: ~0.2 s at 11 W plus a little idle time at 1 W
    assert 0.2 * 11.0 * 0.9 < used < 0.2 * 11.0 * 1.5 + 0.1


def test_energy_from_an_emulated_battery_drains_it() -> None:
    battery = EmulatedBattery(BatterySpec(capacity_wh=0.001, idle_w=1.0, busy_w=20.0))
    meter = EnergyMeter(battery=battery)
    with meter.busy():
        time.sleep(0.1)
    assert meter.energy_j() == pytest.approx(battery.read().energy_j, rel=0.2)
    assert battery.read().percent < 100


def test_a_real_board_without_figures_reports_unknown_energy() -> None:
    assert BoardEmulation(None).energy.energy_j() is None
    assert BoardEmulation(None, power_w=(1.0, 5.0)).energy.energy_j() is not None
