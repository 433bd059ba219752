"""Tests for edgetrain.config: YAML job files, validation messages and command-line overrides."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import edgetrain
from edgetrain.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    job_from_dict,
    job_to_dict,
    load_job,
    parse_override,
)

pytestmark = pytest.mark.timeout(30)

PRESET = Path(edgetrain.__file__).parent / "presets" / "demo.yaml"

GOOD = """\
name: unit
model: small_cnn
seed: 3
dataset: {name: synthetic, train_size: 256, test_size: 64, seed: 1, augment: false}
training: {global_batch: 32, steps: 12, split: equal, min_clients: 2, step_timeout_s: 5}
optimizer: {lr: 0.1, momentum: 0.0, weight_decay: 0, schedule: step, warmup_steps: 2}
"""


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_load_good_job(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, GOOD)

    # Execute
    job = load_job(path)

    # Assert
    assert (job.name, job.model, job.seed) == ("unit", "small_cnn", 3)
    assert (job.dataset.name, job.dataset.train_size, job.dataset.test_size) == ("synthetic", 256, 64)
    assert job.dataset.augment is False
    assert (job.training.global_batch, job.training.steps, job.training.split) == (32, 12, "equal")
    assert job.training.step_timeout_s == 5.0 and isinstance(job.training.step_timeout_s, float)
    assert job.optimizer.weight_decay == 0.0 and isinstance(job.optimizer.weight_decay, float)
    assert job.optimizer.schedule == "step"
    assert job.training.chunk_bytes == 512 * 1024  # untouched keys keep their defaults


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_job(_write(tmp_path, "")) == JobConfig()


def test_shipped_demo_preset_loads() -> None:
    # Execute
    job = load_job(PRESET)

    # Assert
    assert job.name == "demo"
    assert job.dataset.name == "synthetic"
    assert job.training.min_clients == 4
    assert job.training.split == "proportional"


def test_job_to_dict_round_trips() -> None:
    job = load_job(PRESET)
    data = job_to_dict(job)
    assert job_from_dict(data) == job


@pytest.mark.parametrize(("text", "fragments"), [
    pytest.param("bogus: 1\n", ["unknown key 'bogus'", "known: name, model"], id="unknown-top-level"),
    pytest.param("training: {stepz: 10}\n", ["training", "unknown key 'stepz'", "steps"],
                 id="unknown-nested"),
    pytest.param("training: {steps: ten}\n", ["training.steps", "expected int", "'ten'"], id="str-for-int"),
    pytest.param("training: {steps: true}\n", ["training.steps", "expected int", "True"], id="bool-for-int"),
    pytest.param("training: {steps: 10.5}\n", ["training.steps", "expected int", "10.5"],
                 id="float-for-int"),
    pytest.param("optimizer: {lr: fast}\n", ["optimizer.lr", "expected float", "'fast'"],
                 id="str-for-float"),
    pytest.param("dataset: {augment: 1}\n", ["dataset.augment", "expected bool", "1"], id="int-for-bool"),
    pytest.param("training: 5\n", ["training", "expected a mapping", "5"], id="section-not-mapping"),
    pytest.param("training: {split: fast}\n", ["training", "split='fast'", "proportional"],
                 id="split-out-of-range"),
    pytest.param("optimizer: {lr: -1}\n", ["optimizer", "lr=-1", "must be > 0"], id="negative-lr"),
    pytest.param("optimizer: {momentum: 1.0}\n", ["optimizer", "momentum=1.0", "[0, 1)"],
                 id="momentum-out-of-range"),
    pytest.param("dataset: {name: ImageNet}\n", ["dataset", "'ImageNet'", "synthetic"],
                 id="unknown-dataset"),
    pytest.param("dataset: {name: synthetic, train_size: 0}\n", ["dataset", "train_size", "got 0"],
                 id="zero-train-size"),
    pytest.param("model: vgg\n", ["model='vgg'", "small_cnn"], id="unknown-model"),
    pytest.param("training: {chunk_bytes: 100}\n", ["training", "chunk_bytes=100"], id="tiny-chunks"),
    pytest.param("training: {stream_upload: sometimes}\n", ["stream_upload='sometimes'", "true, false or auto"],
                 id="stream-upload-word"),
    pytest.param("training: {stream_download: always}\n", ["stream_download='always'", "true, false or auto"],
                 id="stream-download-word"),
    pytest.param("training: {heartbeat_interval_s: 5, heartbeat_timeout_s: 2}\n",
                 ["heartbeat_timeout_s=2.0", "heartbeat_interval_s"], id="timeout-below-interval"),
])
def test_errors_name_file_key_and_value(tmp_path: Path, text: str, fragments: list[str]) -> None:
    # Prepare
    path = _write(tmp_path, text)

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_job(path)

    # Assert
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_not_yaml_names_the_file(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "training: {steps: [1,\n")

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_job(path)

    # Assert
    assert str(caught.value).startswith(f"{path}: not valid YAML")


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "nope.yaml"

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_job(path)

    # Assert
    assert str(caught.value).startswith(f"{path}: cannot read")


@pytest.mark.parametrize("text", ["just some words\n", "- a\n- b\n"], ids=["scalar", "list"])
def test_top_level_not_a_mapping_names_the_file(tmp_path: Path, text: str) -> None:
    # Prepare
    path = _write(tmp_path, text)

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_job(path)

    # Assert
    assert str(caught.value).startswith(f"{path}: ")


def test_dataset_section_without_name_is_a_config_error(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "dataset: {train_size: 100}\n")

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_job(path)

    # Assert
    assert str(caught.value).startswith(f"{path}: ")
    assert "name" in str(caught.value)


# --- overrides ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "want"), [
    ("training.steps=20", ("training.steps", 20)),
    ("optimizer.lr=0.01", ("optimizer.lr", 0.01)),
    ("dataset.augment=false", ("dataset.augment", False)),
    ("name=fast run", ("name", "fast run")),
    (" model =small_cnn", ("model", "small_cnn")),
    ("dataset.train_size=", ("dataset.train_size", None)),
])
def test_parse_override(text: str, want: tuple) -> None:
    assert parse_override(text) == want


@pytest.mark.parametrize("text", ["training.steps", "=20", ""])
def test_parse_override_needs_key_and_value(text: str) -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override(text)


def test_apply_overrides_sets_dotted_keys_without_mutating_input() -> None:
    # Prepare
    data = {"name": "a", "training": {"steps": 5, "global_batch": 8}}

    # Execute
    out = apply_overrides(data, {"training.steps": 20, "optimizer.lr": 0.5, "seed": 4})

    # Assert
    assert out == {"name": "a", "seed": 4, "training": {"steps": 20, "global_batch": 8},
                   "optimizer": {"lr": 0.5}}
    assert data == {"name": "a", "training": {"steps": 5, "global_batch": 8}}


def test_load_job_applies_overrides_then_validates(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, GOOD)
    overrides = dict(map(parse_override, ["training.steps=99", "optimizer.schedule=constant"]))

    # Execute
    job = load_job(path, overrides)

    # Assert
    assert job.training.steps == 99
    assert job.optimizer.schedule == "constant"
    assert job.training.global_batch == 32


def test_bad_override_names_file_key_and_value(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, GOOD)

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_job(path, dict([parse_override("training.steps=many")]))

    # Assert
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert "training.steps" in message and "'many'" in message


def test_override_below_a_scalar_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model"):
        apply_overrides({"model": "small_cnn"}, {"model.depth": 3})


@pytest.mark.parametrize("preset", sorted((Path(edgetrain.__file__).parent / "presets").glob("**/*.yaml")),
                         ids=lambda p: p.name)
def test_every_preset_loads(preset: Path) -> None:
    """The shipped presets are valid: fleet files (with boards) and job files alike."""
    import yaml

    from edgetrain.fleet_file import load_fleet

    data = yaml.safe_load(preset.read_text())
    if "boards" in data:
        fleet = load_fleet(preset)
        assert fleet.boards and fleet.job.name
    else:
        assert load_job(preset).name


def test_epochs_set_the_steps_and_target_accuracy_needs_evaluations() -> None:
    job = job_from_dict({"dataset": {"name": "synthetic", "train_size": 1000},
                         "training": {"global_batch": 64, "epochs": 2.5}})
    assert job.training.steps == 40  # ceil(2.5 * 1000 / 64)
    assert job_from_dict({"training": {"global_batch": 100, "epochs": 1}}).training.steps == 500  # 50,000 samples
    with pytest.raises(ConfigError, match="eval_every"):
        job_from_dict({"training": {"target_accuracy": 0.5, "eval_every": 0}})
    with pytest.raises(ConfigError, match="target_accuracy"):
        job_from_dict({"training": {"target_accuracy": 1.5}})
