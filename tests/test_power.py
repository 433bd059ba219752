"""Power models (edgetrain/power.py) and the fleet file's power keys (gateway, radio_nj_per_byte)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, small_job

from coordinator.devices import _row
from coordinator.training.report import summary_table
from edgetrain.board_hardware import BatteryEnergySensor, EnergyMeter, MeteredLink
from edgetrain.config import ConfigError, load_job
from edgetrain.emulator.board import BoardEmulation
from edgetrain.fleet_file import (
    BatterySpec,
    BoardSpec,
    GatewaySpec,
    board_from_dict,
    board_to_dict,
    load_fleet,
)
from edgetrain.power import (
    BOARD_DYNAMIC_W,
    BOARD_IDLE_W,
    PI4_SPEED,
    WIFI_NJ_PER_BYTE,
    PowerModel,
    board_power,
    default_power,
)
from edgetrain.training import resolve_device
from protos import coordinator_pb2 as pb

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
    slow, pi4 = default_power(0.1), default_power(PI4_SPEED)
    assert slow.idle_w == pi4.idle_w == BOARD_IDLE_W
    assert pi4.busy_w == pytest.approx(BOARD_IDLE_W + BOARD_DYNAMIC_W) == pytest.approx(6.4)
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


# --- energy on the board ----------------------------------------------------------------------

def test_radio_energy_is_charged_per_byte_moved() -> None:
    link = MeteredLink()  # unshaped: counts, never waits
    meter = EnergyMeter(power=PowerModel(idle_w=0.0, busy_w=0.0, radio_nj_per_byte=100.0),
                        radio_bytes=link.bytes_moved)
    link.before_send(600_000)
    link.after_receive(400_000)
    assert link.bytes_moved() == 1_000_000
    assert meter.energy_j() == pytest.approx(0.1)  # 1e6 bytes at 100 nJ
    assert not meter.measured


def test_an_emulated_board_without_figures_gets_the_default_model() -> None:
    emulation = BoardEmulation.from_file(None, speed=0.5)
    assert emulation.energy.power == default_power(0.5)
    assert emulation.energy.energy_j() is not None
    # --power-watts replaces the watts, keeps the radio
    assert BoardEmulation.from_file(None, (1.0, 3.0), speed=0.5).energy.power == PowerModel(idle_w=1.0, busy_w=3.0)


def _battery(root: Path, *, energy_uwh: int, status: str) -> Path:
    bat = root / "BAT0"
    bat.mkdir(parents=True, exist_ok=True)
    (bat / "type").write_text("Battery\n")
    (bat / "status").write_text(status + "\n")
    (bat / "energy_now").write_text(f"{energy_uwh}\n")
    return bat


def test_a_real_battery_counter_measures_energy_while_discharging(tmp_path: Path) -> None:
    bat = _battery(tmp_path, energy_uwh=40_000_000, status="Discharging")  # 40 Wh
    sensor = BatteryEnergySensor.find(tmp_path)
    assert sensor is not None
    (bat / "energy_now").write_text("39990000\n")  # 10 mWh used = 36 J
    meter = EnergyMeter(sensor=sensor, power=PowerModel(idle_w=1.0, busy_w=2.0))
    assert meter.energy_j() == pytest.approx(36.0)
    assert meter.measured
    (bat / "status").write_text("Charging\n")  # on mains: the counter no longer says what the board used
    assert sensor.energy_j() is None
    assert meter.energy_j() is not None and not meter.measured  # the power model takes over
    assert BatteryEnergySensor.find(tmp_path) is None  # charging: nothing to measure with
    assert BatteryEnergySensor.find(tmp_path / "absent") is None


def test_summary_and_devices_say_estimated() -> None:
    view = pb.DeviceView(device_id="pi-1", state="ready", energy_per_sample_j=0.25,
                         telemetry=pb.Telemetry(energy_j=3.0))
    assert "0.25~" in _row(view)
    view.telemetry.energy_measured = True
    assert "0.25~" not in _row(view) and "0.25" in _row(view)
    summary = {"job": "j", "model": "small_cnn", "dataset": "synthetic", "synthetic_data": True, "split": "equal",
               "test_accuracy": 0.5, "steps": 3, "global_batch": 8, "steps_applied": 3, "steps_attempted": 3,
               "samples_per_s": 1.0, "train_samples": 24, "train_seconds": 24.0, "aggregation": "mean",
               "uplink": "none", "downlink": "none", "bytes_per_sample": 1.0, "energy_j": 12.5,
               "energy_estimated": True, "stop_reason": "time_limit", "time_limit_s": 20.0,
               "devices": [{"device": "pi-1", "emulated_speed": 0.5, "samples_per_s_estimate": 1.0, "samples": 24,
                            "share": 1.0, "compute_s": 1.0, "comm_s": 1.0, "energy_j": 12.5,
                            "energy_source": "estimated", "download_bytes": 0, "upload_bytes": 0, "codec": "none"}]}
    table = summary_table(summary)
    assert "ESTIMATED" in table and "12.5~" in table and "time limit (20 s" in table


# --- job keys --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, key", [
    ("training: {time_limit_s: -5}", "time_limit_s"),
    ("training: {start_grace_s: 0.5}", "start_grace_s"),
    ("training: {start_grace_s: .inf}", "start_grace_s"),
    ("device: gpu", "device"),
])
def test_bad_job_keys_are_rejected_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: small_cnn\n" + text + "\n")
    with pytest.raises(ConfigError, match=rf"{path}: .*{key}"):
        load_job(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fall-back of a machine without CUDA")
def test_device_auto_falls_back_to_cpu_and_cuda_is_refused() -> None:
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ValueError, match="no CUDA"):
        resolve_device("cuda")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fall-back of a machine without CUDA")
def test_one_board_of_two_starts_after_grace_trains_on_auto_and_stops_at_time_limit(
        coordinator_factory, client_factory) -> None:
    # Prepare: min_clients 2 but only one emulated board (no power figures, no battery) comes;
    # device auto on a machine without CUDA; far more steps than the 1 s time limit allows
    job = small_job(device="auto", training={"steps": 100_000, "min_clients": 2, "start_grace_s": 1,
                                             "time_limit_s": 1.0, "global_batch": 16, "log_every": 1000,
                                             "checkpoint_every_s": 0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "lone", 0.5)

    # Execute
    summary = coordinator.wait(timeout=100)

    # Assert: it started without the second board, and stopped cleanly at the time limit: a final
    # evaluation, a checkpoint, the reason in summary.json
    assert [d["device"].split("-")[0] for d in summary["devices"]] == ["lone"]
    assert summary["stop_reason"] == "time_limit" and summary["stopped"] is None
    assert summary["train_seconds"] >= 1.0 and summary["steps"] < job.training.steps
    written = json.loads((coordinator.run_dir / "summary.json").read_text())
    assert written["stop_reason"] == "time_limit"
    evals = read_metrics(coordinator.run_dir, "eval")
    assert evals and evals[-1]["step"] == summary["steps"] - 1
    assert read_metrics(coordinator.run_dir, "checkpoint")[-1]["next_step"] == summary["steps"]
    # energy: every step of the emulated board has some, estimated from the default model
    steps = read_metrics(coordinator.run_dir)
    assert all(stats["energy_j"] > 0 for s in steps for stats in s["devices"].values())
    (device,) = summary["devices"]
    assert device["energy_j"] > 0 and device["energy_source"] == "estimated" and summary["energy_estimated"]


def test_the_real_boards_preset_is_a_valid_job() -> None:
    job = load_job(Path(__file__).parent.parent / "edgetrain" / "presets" / "real-boards.yaml")
    assert (job.device, job.dataset.name) == ("auto", "cifar10")
    assert job.training.start_grace_s >= 1 and job.training.min_clients > 1


def test_a_gpu_device_is_accepted_with_pipelines_and_the_planner(tmp_path: Path) -> None:
    # stages run on the board's device too (edge_client.stage, scripts/check_cuda.py)
    path = tmp_path / "job.yaml"
    path.write_text("model: small_cnn\ndevice: auto\nplanner: {enabled: true}\n")
    assert load_job(path).device == "auto"
