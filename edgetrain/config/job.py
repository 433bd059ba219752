"""A whole job: its sections put together (``JobConfig``), read from a mapping or a job file,
with command-line overrides (``key.sub=value``) applied before the check."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgetrain.catalog import FULL_TRAIN_SIZE, MODEL_NAMES, DatasetSpec
from edgetrain.config.files import ConfigError, from_mapping, load_yaml, require
from edgetrain.config.placement import PipelineConfig, PlannerConfig, ScheduleConfig
from edgetrain.config.training import (
    AggregationConfig,
    CompressionConfig,
    FederatedConfig,
    OptimizerConfig,
    TrainingConfig,
)

DEVICES = ("cpu", "auto", "cuda")


@dataclass(kw_only=True, frozen=True)
class PrivacyConfig:
    """What a board that trains on its own images (`edgetrain client --local-data`) tells the
    gateway besides its model updates (docs/design.md, "Data that stays on the board")."""

    class_counts: bool = True
    """Report how many of its images it holds per class (shown in the dashboard and report, and
    logged); false: only its sample count leaves the board."""


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """One training job: model, data, training loop and optimizer."""

    name: str = "demo"
    """Job name; results go to runs/<name>/."""
    model: str = "mobilenet_v2"
    """Model name (see edgetrain.catalog.MODEL_NAMES)."""
    seed: int = 0
    """Seed for the model's initial parameters and the sample order."""
    device: str = "cpu"
    """Where boards train: cpu; auto (CUDA when the board has it, e.g. a Jetson, else CPU); cuda
    (a board without CUDA cannot work for the job: it stops with one line before it trains).
    Boards profile on that device (speed, host<->device copies, free memory), so the split and
    the planner's stage placement follow; data-parallel shards, federated rounds and pipeline
    stages all run there."""
    dataset: DatasetSpec = field(default_factory=lambda: DatasetSpec(name="synthetic"))
    """Training and test data: the coordinator evaluates on its test split and serves boards the
    training samples they need; a board with its own images (--local-data) trains on those."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Training loop settings."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings (the boards' local optimizer in federated rounds)."""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    """How updates are combined and which are refused."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Codecs on the links."""
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    """Local training settings for federated rules."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline model parallelism (empty: data parallelism only)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Hybrid mode: stages and DP shards planned from the live fleet, re-planned as it changes."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """What the job asks of a fleet shared with other jobs (edgetrain submit)."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """What boards training on their own images report about them."""

    def __post_init__(self) -> None:
        require(self.model in MODEL_NAMES, "model", self.model, f"must be one of {MODEL_NAMES}")
        if self.training.epochs:
            samples = self.dataset.train_size or FULL_TRAIN_SIZE
            steps = max(1, math.ceil(self.training.epochs * samples / self.training.global_batch))
            object.__setattr__(self, "training", dataclasses.replace(self.training, steps=steps))
        require(not (self.planner.enabled and self.pipeline.enabled), "planner.enabled", True,
                "the planner makes the plan: leave pipeline.stages and pipeline.plan_file empty")
        require(not (self.planner.enabled and self.aggregation.federated), "planner.enabled", True,
                "hybrid plans are for data-parallel and pipeline training, not federated rounds")
        require(not (self.pipeline.enabled and self.aggregation.federated), "aggregation.rule", self.aggregation.rule,
                "federated rounds train the whole model on each board: leave the pipeline section out")
        agg = self.aggregation
        if (self.pipeline.enabled or self.planner.enabled) and self.pipeline.stage_state == "hosts":
            require(agg.rule == "mean" and agg.deadline == "none" and not agg.clip_norm, "pipeline.stage_state",
                    "hosts", "stage hosts apply their own gradients, so every step must be all or nothing and "
                    "unclipped: use aggregation rule mean without deadline or clip_norm, or "
                    "pipeline.stage_state: coordinator")
        require(self.device in DEVICES, "device", self.device, f"must be one of {DEVICES}")
        require(bool(self.name) and "/" not in self.name, "name", self.name,
                "must be a non-empty name without '/'")


def job_from_dict(data: Any, *, source: str = "job") -> JobConfig:
    """A JobConfig from a parsed mapping; errors are prefixed with `source`."""
    return from_mapping(JobConfig, data if data is not None else {}, source)


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Load a job YAML file, apply dotted overrides (e.g. {"training.steps": 20}), validate."""
    path = Path(path)
    data = load_yaml(path)
    try:
        data = apply_overrides(data, overrides or {})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return job_from_dict(data, source=str(path))


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with dotted keys set, e.g. {"training.steps": 20}."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}")
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = out
        for depth, key in enumerate(parents):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                where = ".".join(parents[: depth + 1])
                raise ConfigError(f"override {dotted}: {where} is {node!r}, not a section")
        node[leaf] = value
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` from the command line; the value is parsed as YAML (20 -> int)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. training.steps=20")
    value = yaml.safe_load(raw)
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string; users mean a number
        try:
            value = float(value)
        except ValueError:
            pass
    return key.strip(), value


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """Plain-data form of a job (for run directories and logs)."""
    return dataclasses.asdict(job)
