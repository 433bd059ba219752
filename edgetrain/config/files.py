"""Config files: the one YAML loader and the one conversion from a mapping to a checked dataclass.

Every YAML config file (job, plan, experiment, trace, fleet) is read with ``load_yaml`` and
becomes keyword-only dataclasses with ``from_mapping``; a file that cannot be used stops with one
line naming the file, the key and the bad value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names file, key and value."""


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """The check of a config dataclass's ``__post_init__``: ConfigError ``key=value: why``
    unless `ok` (``from_mapping`` puts the file and the section in front)."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The top-level mapping of YAML `text` ({} when it is empty); ConfigError naming `source` (a
    file, or what sent the text) when it is not YAML or not a mapping."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        shown = repr(data) if len(repr(data)) <= 60 else repr(data)[:57] + "..."
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__} {shown}")
    return data


def load_yaml(path: str | Path, *, what: str | None = None) -> dict[str, Any]:
    """The top-level mapping of the YAML file at `path` ({} when it is empty); ConfigError in one
    line naming the file when it cannot be read, is not YAML, or is not a mapping. With `what`
    (e.g. "trace file") a missing file is "PATH: trace file not found"."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: {what} not found" if what else f"{path}: cannot read: {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: cannot read: not UTF-8 text") from None
    return parse_yaml(text, str(path))


def from_mapping(cls: type[T], data: Any, where: str = "") -> T:
    """The keyword-only dataclass `cls` built from `data` (a parsed mapping), every key checked.

    Each key must be a field of `cls` (an unknown one is refused, listing the known ones) and its
    value must match the field's type: int, float (an int is taken), str, bool, list, dict,
    ``X | None``, a nested dataclass (a mapping, built the same way), or ``list[X]`` /
    ``tuple[X, ...]`` (each item checked, its path ``key[i]``). Fields without a default are
    required. The dataclass's ``__post_init__`` checks ranges and relations with ``require``
    (a ValueError it raises, as LinkSpec's and BatterySpec's do, is reported the same way).
    Any error is one ConfigError ``WHERE: key.path: message`` with the bad value in it, e.g.
    ``job.yaml: training.steps: expected int, got str 'ten'`` or
    ``job.yaml: training: split='fast': must be one of ('proportional', 'equal')``.

    A fleet file will use it as the job and experiment files do: its shape as dataclasses (a
    ``FleetFile`` with ``boards: list[BoardEntry]`` where ``BoardEntry`` is BoardSpec's fields
    plus ``count: int = 1``, ``events: list[FleetEvent]``, ``gateway: GatewaySpec``,
    ``job: dict``, ``job_file: str | None``, ...), the ranges that ``_boards`` and
    ``load_fleet`` check by hand moved into their ``__post_init__``; then
    ``from_mapping(FleetFile, load_yaml(path), str(path))`` checks the whole file, e.g.
    ``lab.yaml: boards[1].link: mbit_per_s=0.0: must be > 0``, and what stays by hand is only
    what spans entries (expanding ``count``, unique names, events naming known boards) and
    ``job``/``job_file`` through ``job_from_dict``/``load_job``.
    """
    try:
        return _build(cls, data, "")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def _build(cls: type, data: Any, path: str) -> Any:
    """Instantiate dataclass `cls` from a mapping at key path `path`, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path + ': ' if path else ''}expected a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{path + ': ' if path else ''}unknown key {key!r} (known: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, f"{path}.{key}" if path else key)
    missing = [f.name for f in fields.values() if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{path + ': ' if path else ''}missing required key {missing[0]!r}")
    try:
        return cls(**kwargs)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def _coerce(hint: Any, value: Any, path: str) -> Any:
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    allowed = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in allowed:
        return None
    for typ in allowed:
        if dataclasses.is_dataclass(typ) and isinstance(value, dict):
            return _build(typ, value, path)
        origin = typing.get_origin(typ)
        if origin in (list, tuple) and isinstance(value, list):
            item = typing.get_args(typ)[0]
            items = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ in (str, bool, list, dict) and isinstance(value, typ):
            return value
    names = " or ".join(_type_name(t) for t in allowed)
    raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {value!r}")


def _type_name(typ: Any) -> str:
    if dataclasses.is_dataclass(typ):
        return f"a mapping ({typ.__name__})"
    if typing.get_origin(typ) in (list, tuple):
        item = typing.get_args(typ)[0]
        return f"a list of mappings ({item.__name__})" if dataclasses.is_dataclass(item) else f"a list of {_type_name(item)}"
    if typ is dict:
        return "mapping"
    return getattr(typ, "__name__", str(typ))
