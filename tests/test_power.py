"""Power models (edgetrain/power.py) and the fleet file's power keys (gateway, radio_nj_per_byte)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgetrain.config import ConfigError
from edgetrain.emulator.battery import BatterySpec
from edgetrain.emulator.fleet_config import (
    BoardSpec,
    GatewaySpec,
    board_from_dict,
    board_to_dict,
    load_fleet,
)
from edgetrain.power import (
    BOARD_DYNAMIC_W,
    BOARD_IDLE_W,
    WIFI_NJ_PER_BYTE,
    PowerModel,
    board_power,
    default_power,
)

JOB = "job: {model: small_cnn, dataset: {name: synthetic, train_size: 64, test_size: 16}}\n"


def test_energy_counts_busy_idle_and_radio() -> None:
    model = PowerModel(idle_w=2.0, busy_w=5.0, radio_nj_per_byte=50.0)
    # 3 s busy at 5 W + 4 s idle at 2 W + 1e8 bytes at 50 nJ = 15 + 8 + 5 J
    assert model.energy_j(busy_s=3.0, idle_s=4.0, radio_bytes=100_000_000) == pytest.approx(28.0)
    assert model.energy_j(busy_s=0.0, idle_s=0.0) == 0.0
    assert PowerModel(idle_w=1, busy_w=1).radio_nj_per_byte == WIFI_NJ_PER_BYTE == 100.0


@pytest.mark.parametrize("kwargs", [{"busy_s": -1, "idle_s": 0}, {"busy_s": 0, "idle_s": -1},
                                    {"busy_s": 0, "idle_s": 0, "radio_bytes": -5}])
def test_energy_rejects_negative_durations_and_bytes(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        PowerModel(idle_w=1, busy_w=2).energy_j(**kwargs)


@pytest.mark.parametrize("fields, match", [
    ({"idle_w": -1, "busy_w": 2}, "idle_w"),
    ({"idle_w": 1, "busy_w": float("nan")}, "busy_w"),
    ({"idle_w": 3, "busy_w": 2}, "busy_w .* must be >= idle_w"),
    ({"idle_w": 1, "busy_w": 2, "radio_nj_per_byte": -0.5}, "radio_nj_per_byte"),
])
def test_power_model_is_validated(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PowerModel(**fields)


def test_default_power_is_a_pi_class_board_scaled_by_speed() -> None:
    slow, full = default_power(0.25), default_power(1.0)
    assert slow.idle_w == full.idle_w == BOARD_IDLE_W
    assert full.busy_w == pytest.approx(BOARD_IDLE_W + BOARD_DYNAMIC_W) == pytest.approx(6.4)
    assert slow.busy_w == pytest.approx(BOARD_IDLE_W + BOARD_DYNAMIC_W / 4)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="speed"):
            default_power(bad)


def test_board_power_prefers_battery_then_own_figures_then_default() -> None:
    battery = BatterySpec(capacity_wh=10, idle_w=1.3, busy_w=7.5)
    assert board_power(BoardSpec(name="b", speed=0.5, battery=battery, idle_w=9, busy_w=9)) == PowerModel(
        idle_w=1.3, busy_w=7.5)
    assert board_power(BoardSpec(name="w", speed=0.5, idle_w=2.0, busy_w=4.0, radio_nj_per_byte=10)) == PowerModel(
        idle_w=2.0, busy_w=4.0, radio_nj_per_byte=10.0)
    assert board_power(BoardSpec(name="d", speed=0.5)) == default_power(0.5)
    # only idle given, above the default busy draw: busy is never below idle
    assert board_power(BoardSpec(name="i", speed=0.1, idle_w=8.0)).busy_w == 8.0


def test_fleet_file_reads_gateway_and_radio(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(JOB + """gateway: {speed: 2.0, idle_w: 10, busy_w: 30}
boards:
  - {name: wired, speed: 0.3, radio_nj_per_byte: 10}
  - {name: wifi, speed: 0.3}
""")
    fleet = load_fleet(path)
    assert fleet.gateway == GatewaySpec(speed=2.0, idle_w=10, busy_w=30)
    wired, wifi = fleet.boards
    assert board_power(wired).radio_nj_per_byte == 10.0
    assert board_power(wifi).radio_nj_per_byte == WIFI_NJ_PER_BYTE
    # the board file an emulated client reads keeps the figure
    assert board_from_dict(board_to_dict(wired)) == wired


def test_fleet_without_gateway_gets_a_mini_pc(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text(JOB + "boards: [{name: a, speed: 0.5}]\n")
    gateway = load_fleet(path).gateway
    assert (gateway.speed, gateway.idle_w, gateway.busy_w) == (1.0, 6.0, 15.0)


@pytest.mark.parametrize("text, key", [
    ("gateway: {speed: 0}\nboards: [{name: a, speed: 0.5}]\n", "gateway: speed"),
    ("gateway: {idle_w: 9, busy_w: 3}\nboards: [{name: a, speed: 0.5}]\n", "gateway: busy_w"),
    ("gateway: {watts: 3}\nboards: [{name: a, speed: 0.5}]\n", "gateway: unknown key 'watts'"),
    ("gateway: 5\nboards: [{name: a, speed: 0.5}]\n", "gateway: expected a mapping"),
    ("boards: [{name: a, speed: 0.5, radio_nj_per_byte: -1}]\n", "radio_nj_per_byte"),
    ("boards: [{name: a, speed: 0.5, idle_w: 5, busy_w: 1}]\n", "busy_w"),
    ("boards: [{name: a, speed: 0}]\n", r"boards\[0\].speed"),
])
def test_bad_power_keys_are_rejected_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(JOB + text)
    with pytest.raises(ConfigError, match=key) as info:
        load_fleet(path)
    assert str(path) in str(info.value)
