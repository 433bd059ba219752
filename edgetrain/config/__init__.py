"""Job configuration: keyword-only dataclasses checked at construction, loaded from YAML.

- ``files.py``     the one YAML loader (``load_yaml``) and the one mapping -> checked dataclass
                   conversion (``from_mapping``) that job, experiment and fleet files share.
- ``training.py``  how each step is computed and applied: optimizer, training loop, aggregation,
                   compression, federated rounds.
- ``placement.py`` where the model runs: the pipeline plan (by hand or a plan file), the live
                   planner, and what a job asks of a shared fleet.
- ``job.py``       ``JobConfig`` (the sections together), job files and ``key.sub=value``
                   overrides.

A job file has these sections, each optional:

```yaml
name: demo
model: mobilenet_v2            # resnet18 | mobilenet_v2 | small_cnn
dataset: {name: synthetic, train_size: 20000, test_size: 1000, seed: 0, augment: true}
device: cpu                    # cpu | auto (CUDA when the board has it) | cuda
training: {global_batch: 64, steps: 300, split: proportional, min_clients: 4, eval_every: 50,
           time_limit_s: 0, start_grace_s: 0}
optimizer: {lr: 0.05, momentum: 0.9, weight_decay: 5.0e-4, schedule: cosine, warmup_steps: 10}
aggregation: {rule: mean, deadline: none, clip_norm: 0, outlier_factor: 0}
compression: {uplink: none, downlink: none}
federated: {local_steps: 5, local_batch: 16, partitions: 0, partitioning: iid, clients_per_round: 0}   # fedavg / fedprox
```

Errors name the file, the key and the bad value.
"""

from edgetrain.catalog import DatasetSpec
from edgetrain.config.files import ConfigError, from_mapping, load_yaml, parse_yaml, require
from edgetrain.config.job import (
    DEVICES,
    JobConfig,
    PrivacyConfig,
    apply_overrides,
    job_from_dict,
    job_to_dict,
    load_job,
    parse_override,
)
from edgetrain.config.placement import (
    PIPELINE_SCHEDULES,
    PipelineConfig,
    PlannerConfig,
    ScheduleConfig,
    load_plan,
)
from edgetrain.config.training import (
    DEADLINES,
    RULES,
    SCHEDULES,
    SPLITS,
    AggregationConfig,
    CompressionConfig,
    FederatedConfig,
    OptimizerConfig,
    TrainingConfig,
)

__all__ = [
    "DEADLINES", "DEVICES", "PIPELINE_SCHEDULES", "RULES", "SCHEDULES", "SPLITS",
    "AggregationConfig", "CompressionConfig", "ConfigError", "DatasetSpec", "FederatedConfig",
    "JobConfig", "OptimizerConfig", "PipelineConfig", "PlannerConfig", "PrivacyConfig",
    "ScheduleConfig", "TrainingConfig",
    "apply_overrides", "from_mapping", "job_from_dict", "job_to_dict", "load_job", "load_plan",
    "load_yaml", "parse_override", "parse_yaml", "require",
]
