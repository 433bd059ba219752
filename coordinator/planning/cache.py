"""This machine's measurements, kept on disk with what they were measured on.

`edgetrain plan` and the job server time a model's blocks, one core's training speed and the CPU
cost of moving a byte (``coordinator.planning.measure``, seconds and torch). Each result is kept
here beside what it was measured on: the measurement and its arguments, the torch version, the
CPU model and architecture, and the number of torch threads. A later request with exactly the
same description gets the same figures without torch; any difference measures again.

The file is JSON: ``$EDGETRAIN_CACHE_DIR/measurements.json``, by default under
``$XDG_CACHE_HOME/edgetrain/`` (``~/.cache/edgetrain/``). Delete it to measure again. A file that
cannot be read as ours is ignored with a one-line warning and rewritten by the next measurement.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import psutil

logger = logging.getLogger(__name__)

CACHE_ENV = "EDGETRAIN_CACHE_DIR"
"""Directory of the measurement cache (overrides the XDG default; tests point it elsewhere)."""
FILE_NAME = "measurements.json"
FORMAT = 3
"""Version of the file layout and of what is measured; a file of another version is replaced
(3: blocks carry what a channel group splits)."""

T = TypeVar("T")

_warned: set[str] = set()


def cache_path() -> Path:
    """Where the measurements are kept."""
    directory = os.environ.get(CACHE_ENV)
    if not directory:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
        directory = str(base / "edgetrain")
    return Path(directory) / FILE_NAME


def torch_threads() -> int:
    """The threads torch computes with in this process: its own count once torch is imported,
    else its usual default (OMP_NUM_THREADS, else the physical cores). A measurement runs with
    exactly the count it is recorded with, so a default guessed wrong never mislabels a figure."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def measured_on(what: Mapping[str, Any], threads: int) -> dict[str, Any]:
    """`what` (the measurement and its arguments) plus this machine: torch, CPU, threads."""
    return {**what, "torch": _torch_version(), "cpu": _cpu_model(), "arch": platform.machine(),
            "threads": threads}


def find(key: Mapping[str, Any], decode: Callable[[Any], T]) -> T | None:
    """The kept value measured on exactly `key`, decoded; None when there is none (or it is damaged)."""
    path = cache_path()
    for entry in _read(path):
        if entry["measured_on"] == key:
            try:
                return decode(entry["value"])
            except (TypeError, ValueError, KeyError) as e:
                _warn_once(path, f"ignoring a damaged entry of the measurement cache {path} ({e}); measuring again")
                return None
    return None


def keep(key: Mapping[str, Any], value: Any) -> None:
    """Keep `value` (plain JSON data) as measured on `key`, replacing an entry with the same key."""
    path = cache_path()
    entries = [e for e in _read(path, quiet=True) if e["measured_on"] != key]
    entries.append({"measured_on": dict(key), "value": value})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{FILE_NAME}.", delete=False) as f:
            json.dump({"format": FORMAT, "entries": entries}, f, indent=1)
        os.replace(f.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        _warn_once(path, f"cannot write the measurement cache {path} ({e.strerror}); measurements are not kept")


def _read(path: Path, quiet: bool = False) -> list[dict[str, Any]]:
    """The entries of the file at `path`; [] (and a warning unless `quiet`) when it is not usable."""
    try:
        return _entries(path.read_text())
    except FileNotFoundError:
        return []
    except OSError as e:
        if not quiet:
            _warn_once(path, f"cannot read the measurement cache {path} ({e.strerror}); measuring again")
    except ValueError as e:  # not UTF-8, not JSON, not our layout
        if not quiet:
            _warn_once(path, f"ignoring the damaged measurement cache {path} ({e}); measuring again and rewriting it")
    return []


def _entries(text: str) -> list[dict[str, Any]]:
    """The entries of a measurement cache file; ValueError saying why `text` is not one."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} measurement cache")
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("measured_on"), dict) and "value" in e for e in entries):
        raise ValueError("its entries are not a list of {measured_on, value}")
    return entries


def _warn_once(path: Path, message: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        logger.warning("[Planning] %s", message)


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def _cpu_model() -> str:
    """The CPU's model name as Linux reports it (x86 `model name`; ARM boards `Model`/`Hardware`)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for name in ("model name", "Model", "Hardware", "CPU part"):
        for line in lines:
            key, _, value = line.partition(":")
            if key.strip() == name and value.strip():
                return value.strip()
    return platform.processor() or "unknown"
