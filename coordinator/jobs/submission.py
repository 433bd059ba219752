"""What a job submission must say: the job server's and `edgetrain submit`'s shared check.

A submission is a job YAML (as for `edgetrain coordinator --config`) that itself writes the
``WRITTEN`` keys: the job's ``name``, its ``model``, and how long it trains (``training.steps``
or ``training.epochs``). Everything else may take its default. Without that rule an empty
``Submit`` message (or any YAML that says nothing) was a complete job made of defaults: a
300-step MobileNetV2 job called "demo" that nobody asked for. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from edgetrain.config import ConfigError, JobConfig, job_from_dict, parse_yaml

MAX_JOB_YAML_BYTES = 256 * 1024
WRITTEN = ("name", "model", "length (training.steps or training.epochs)")
"""What a submitted job must write itself (not take from the defaults)."""
RULE = "a submitted job writes its name, model and length (training.steps or training.epochs) itself"


def unwritten(data: Any) -> list[str]:
    """Which of ``WRITTEN`` the parsed job mapping `data` does not write (all of them when it is
    not a mapping)."""
    if not isinstance(data, dict):
        return list(WRITTEN)
    training = data.get("training")
    training = training if isinstance(training, dict) else {}
    missing = [key for key in ("name", "model") if data.get(key) in (None, "")]
    if training.get("steps") is None and training.get("epochs") is None:
        missing.append(WRITTEN[2])
    return missing


def require_written(data: Any, source: str = "job") -> None:
    """ConfigError naming what `data` (a parsed job mapping) leaves to the defaults."""
    missing = unwritten(data)
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{source}: the job is empty; {RULE}")
    if missing:
        raise ConfigError(f"{source}: the job does not say its {' or '.join(missing)}; {RULE} instead of "
                          "taking the defaults")


def parse_job(text: str) -> JobConfig:
    """A job YAML, validated (ConfigError names the bad key). Used for jobs already queued too,
    so it does not apply the submission rule (``submitted_job``)."""
    if len(text.encode()) > MAX_JOB_YAML_BYTES:
        raise ConfigError(f"job YAML is {len(text.encode())} bytes; the limit is {MAX_JOB_YAML_BYTES}")
    config = job_from_dict(parse_yaml(text, "job"), source="job")
    if config.aggregation.federated:
        raise ConfigError("job: federated rounds are not scheduled on a shared fleet yet")
    return config


def submitted_job(text: str) -> JobConfig:
    """A submitted job YAML: valid (``parse_job``) and writing the ``WRITTEN`` keys itself
    (ConfigError otherwise: an empty or defaulted submission is refused, nothing is queued)."""
    if not text.strip():
        raise ConfigError(f"job: the job YAML is empty; {RULE}")
    config = parse_job(text)
    require_written(parse_yaml(text, "job"))
    return config


def request_text(config: JobConfig) -> str:
    """What a job asks of the fleet, in words (``boards a,b``, ``2 boards``, ``1-4 boards``)."""
    s = config.schedule
    if s.kind == "hard":
        return f"boards {','.join(s.boards)}" if s.boards else f"{s.count} boards"
    return f"{s.min_boards}-{s.max_boards or 'all'} boards"
