"""Prometheus text exposition of a run, from the same snapshot the dashboard shows."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

BOARD_GAUGES = (
    # (metric name, snapshot key, help)
    ("edgetrain_board_samples_per_second", "samples_per_s", "Board's measured training throughput (samples/s of compute)"),
    ("edgetrain_board_cpu_percent", "cpu_percent", "Board CPU use, percent of what it has"),
    ("edgetrain_board_memory_used_bytes", "memory_used_bytes", "Board memory in use"),
    ("edgetrain_board_battery_percent", "battery_percent", "Board battery charge (absent when unknown)"),
    ("edgetrain_board_temperature_celsius", "temperature_c", "Board temperature (absent when unknown)"),
    ("edgetrain_board_link_mbit_per_second", "link_mbit_per_s", "Measured bandwidth to the coordinator"),
    ("edgetrain_board_rtt_milliseconds", "rtt_ms", "Measured round-trip time to the coordinator"),
    ("edgetrain_board_share_samples", "share", "Samples of the global batch in the last step"),
)
BOARD_COUNTERS = (
    ("edgetrain_board_samples", "samples", "Samples the board trained"),
    ("edgetrain_board_download_bytes", "download_bytes", "Bytes the board downloaded"),
    ("edgetrain_board_upload_bytes", "upload_bytes", "Bytes the board uploaded"),
    ("edgetrain_board_failures", "failures", "Updates from the board the coordinator refused"),
)
STEP_GAUGES = (
    ("edgetrain_step_seconds", "step_s", "Wall time of the last applied step"),
    ("edgetrain_predicted_step_seconds", "predicted_step_s", "Predicted time of the last applied step"),
    ("edgetrain_loss", "loss", "Training loss of the last applied step"),
    ("edgetrain_samples_per_second", "samples_per_s", "Fleet throughput in the last applied step"),
)


class _RunCollector:
    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        state = self._snapshot()
        labels = ["board", "job"]
        for name, key, help_ in BOARD_GAUGES:
            family = GaugeMetricFamily(name, help_, labels=labels)
            for b in state["boards"]:
                if b.get(key) is not None:
                    family.add_metric([b["name"], state["job"]], float(b[key]))
            yield family
        for name, key, help_ in BOARD_COUNTERS:
            family = CounterMetricFamily(name, help_, labels=labels)
            for b in state["boards"]:
                family.add_metric([b["name"], state["job"]], float(b.get(key) or 0))
            yield family
        up = GaugeMetricFamily("edgetrain_board_up", "1 while the board is in the fleet, 0 once lost",
                               labels=labels)
        for b in state["boards"]:
            up.add_metric([b["name"], state["job"]], 0.0 if b["state"] == "lost" else 1.0)
        yield up
        last = state.get("last_step") or {}
        for name, key, help_ in STEP_GAUGES:
            family = GaugeMetricFamily(name, help_, labels=["job"])
            if last.get(key) is not None:
                family.add_metric([state["job"]], float(last[key]))
            yield family
        steps = GaugeMetricFamily("edgetrain_steps_applied", "Steps applied so far", labels=["job"])
        if last.get("step") is not None:
            steps.add_metric([state["job"]], float(last["step"] + 1))
        yield steps
        evals = state.get("evals") or []
        accuracy = GaugeMetricFamily("edgetrain_test_accuracy", "Test accuracy at the last evaluation",
                                     labels=["job"])
        if evals and evals[-1].get("accuracy") is not None:
            accuracy.add_metric([state["job"]], float(evals[-1]["accuracy"]))
        yield accuracy


def exposition(snapshot: Callable[[], dict]) -> bytes:
    """The Prometheus text format of the run `snapshot()` returns."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RunCollector(snapshot))
    return generate_latest(registry)
