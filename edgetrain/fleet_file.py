"""What a fleet is: boards (CPU speed, link, battery), the gateway, the job, scripted events.

The description only: the planner (`edgetrain plan FLEET.yaml`) and the job server's speed
estimate read it; the emulated fleet (edgetrain.emulator) enforces it on the boards it runs.

```yaml
name: lab
cluster: lab                     # mDNS cluster name the coordinator advertises
job: {model: mobilenet_v2, training: {steps: 200}}   # a job mapping (see config.py), or
job_file: jobs/demo.yaml         # a job file, relative to this file
network: auto                    # auto: namespaces when root, else loopback + app-level shaping
gateway: {speed: 1.0, idle_w: 6.0, busy_w: 15.0}   # the gateway (centralized baseline); optional
boards:
  - {name: nano, count: 2, speed: 0.5, link: {mbit_per_s: 100},
     battery: {capacity_wh: 37, idle_w: 1.3, busy_w: 7.5, plugged: true}}
  - {name: pi, speed: 0.3, idle_w: 2.7, busy_w: 4.0, radio_nj_per_byte: 10}   # wired, no battery
events:
  - {at_s: 60, board: nano-1, link: {mbit_per_s: 5}}
  - {at_s: 90, board: nano-2, action: leave}
  - {at_s: 120, board: nano-2, action: join}
```

A board's energy comes from :func:`edgetrain.power.board_power`: its battery's watts, else its
own ``idle_w``/``busy_w``, else a Raspberry-Pi-class default for its speed; radio energy per byte
from ``radio_nj_per_byte`` (default Wi-Fi's; see edgetrain/power.py for the figures).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgetrain.config import ConfigError, JobConfig, job_from_dict, load_job
from edgetrain.config.files import from_mapping, load_yaml, require
from edgetrain.power import GATEWAY_BUSY_W, GATEWAY_IDLE_W

NETWORK_MODES = ("auto", "namespaces", "loopback")
EVENT_ACTIONS = ("link", "leave", "join")


@dataclass(kw_only=True, frozen=True)
class LinkSpec:
    """A board's link to the LAN, the same in both directions (emulated by edgetrain.emulator)."""

    mbit_per_s: float
    """Link rate in Mbit/s (10^6 bit/s)."""
    delay_ms: float = 0.0
    """One-way delay; an RPC waits twice this."""
    loss: float = 0.0
    """Probability that a transfer chunk is lost and must be resent, in [0, 1)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mbit_per_s) and self.mbit_per_s > 0):
            raise ValueError(f"mbit_per_s must be a finite number > 0, got {self.mbit_per_s}")
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(f"delay_ms must be a finite number >= 0, got {self.delay_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def bytes_per_s(self) -> float:
        """The rate in bytes per second."""
        return self.mbit_per_s * 1e6 / 8


@dataclass(kw_only=True, frozen=True)
class BatterySpec:
    """A board's battery and its power draw (emulated by edgetrain.emulator.battery)."""

    capacity_wh: float
    """Usable capacity, watt-hours."""
    idle_w: float
    """Power draw while not training, watts."""
    busy_w: float
    """Power draw while training, watts."""
    initial_percent: float = 100.0
    """Charge when the board starts."""
    plugged: bool = False
    """On mains power: the board's draw comes from the mains and the battery does not drain."""
    charge_w: float = 0.0
    """Net charging power into the battery while plugged, watts (0: the charge level stays)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.capacity_wh) and self.capacity_wh > 0):
            raise ValueError(f"capacity_wh must be a finite number > 0, got {self.capacity_wh}")
        for name in ("idle_w", "busy_w", "charge_w"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.busy_w < self.idle_w:
            raise ValueError(f"busy_w ({self.busy_w}) must be >= idle_w ({self.idle_w})")
        if not 0 <= self.initial_percent <= 100:
            raise ValueError(f"initial_percent must be in [0, 100], got {self.initial_percent}")


@dataclass(kw_only=True, frozen=True)
class BoardSpec:
    """One emulated board: what the client process emulates."""

    name: str
    """Board name (unique in the fleet)."""
    speed: float
    """CPU speed as a fraction of one core."""
    link: LinkSpec | None = None
    """Its link to the LAN; None: unshaped."""
    battery: BatterySpec | None = None
    """Its battery; None: mains powered with no battery."""
    idle_w: float | None = None
    """Power draw when idle, W (energy accounting for a board without a battery)."""
    busy_w: float | None = None
    """Power draw when training, W."""
    radio_nj_per_byte: float | None = None
    """Radio energy per byte sent or received, nJ; None: Wi-Fi's (edgetrain.power)."""
    memory_mb: float | None = None
    """Its memory, MiB (a Pi 3: 1024); None: the host's. Enforced with a cgroup v1 memory group
    when the client runs as root, reported in its telemetry and profile either way."""
    local_data: str | None = None
    """An image folder the board trains on alone, as `edgetrain client --local-data` (a path
    relative to the fleet file's directory); None: it trains on the job's dataset."""

    def __post_init__(self) -> None:
        for name in ("idle_w", "busy_w", "radio_nj_per_byte"):
            _check_nonnegative(name, getattr(self, name), optional=True)
        if self.memory_mb is not None and (isinstance(self.memory_mb, bool) or not isinstance(
                self.memory_mb, (int, float)) or not (math.isfinite(self.memory_mb) and self.memory_mb >= 64)):
            raise ValueError(f"memory_mb must be a number >= 64 (MiB), got {self.memory_mb!r}")
        if self.idle_w is not None and self.busy_w is not None and self.busy_w < self.idle_w:
            raise ValueError(f"busy_w ({self.busy_w}) must be >= idle_w ({self.idle_w})")
        if self.local_data is not None and (not isinstance(self.local_data, str) or not self.local_data):
            raise ValueError(f"local_data must be the path of an image folder, got {self.local_data!r}")


@dataclass(kw_only=True, frozen=True)
class GatewaySpec:
    """The gateway machine the coordinator runs on (where the centralized baseline trains)."""

    speed: float = 1.0
    """CPU speed in gateway cores (1.0: the baseline trains on one of its cores)."""
    idle_w: float = GATEWAY_IDLE_W
    """Power draw when idle, W (default: a mini-PC gateway; see edgetrain/power.py)."""
    busy_w: float = GATEWAY_BUSY_W
    """Power draw when training, W."""

    def __post_init__(self) -> None:
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)) or not (
                math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed must be a finite number > 0, got {self.speed!r}")
        _check_nonnegative("idle_w", self.idle_w)
        _check_nonnegative("busy_w", self.busy_w)
        if self.busy_w < self.idle_w:
            raise ValueError(f"busy_w ({self.busy_w}) must be >= idle_w ({self.idle_w})")


def _check_nonnegative(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class FleetEvent:
    """A scripted change at `at_s` seconds after the fleet is up."""

    at_s: float
    board: str
    action: str
    """link (its rate/delay/loss change), leave (its process stops) or join (it starts again)."""
    link: LinkSpec | None = None


@dataclass(kw_only=True, frozen=True)
class FleetSpec:
    """A coordinator, its job and the boards to emulate."""

    name: str
    cluster: str
    job: JobConfig
    network: str = "auto"
    probe_interval_s: float = 30.0
    """How often each board probes its link when no large transfer measured it."""
    jobs: bool = False
    """Run a job server (`edgetrain coordinator --jobs`) instead of the coordinator of `job`:
    jobs come with `edgetrain submit` and share the boards."""
    boards: tuple[BoardSpec, ...] = field(default_factory=tuple)
    events: tuple[FleetEvent, ...] = field(default_factory=tuple)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    """The gateway machine (speed and watts), what the centralized baseline trains on."""


@dataclass(kw_only=True, frozen=True)
class _FleetFileKeys:
    """The top level of a fleet file as written (boards and events are expanded and checked
    against each other by ``load_fleet``)."""

    name: str | None = None
    cluster: str | None = None
    job: dict = field(default_factory=dict)
    job_file: str | None = None
    network: str = "auto"
    probe_interval_s: float = 30.0
    jobs: bool = False
    boards: list = field(default_factory=list)
    events: list = field(default_factory=list)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)

    def __post_init__(self) -> None:
        require(self.network in NETWORK_MODES, "network", self.network, f"must be one of {NETWORK_MODES}")
        require(self.probe_interval_s > 0, "probe_interval_s", self.probe_interval_s, "must be > 0")
        require(bool(self.boards), "boards", self.boards, "expected a non-empty list of boards")


def _boards(entries: list, where: str, base: Path = Path(".")) -> list[BoardSpec]:
    boards = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}[{i}]: expected a mapping, got {type(entry).__name__} {entry!r}")
        entry = dict(entry)
        count = entry.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}[{i}].count: expected an integer >= 1, got {count!r}")
        speed = entry.get("speed")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (math.isfinite(speed) and speed > 0):
            raise ConfigError(f"{where}[{i}].speed: expected a number > 0 (fraction of a core), got {speed!r}")
        if isinstance(entry.get("local_data"), str):
            entry["local_data"] = str((base / entry["local_data"]).resolve())
        stem = entry.get("name", f"board{i}")
        for k in range(count):
            named = {**entry, "name": f"{stem}-{k + 1}" if count > 1 else stem}
            boards.append(from_mapping(BoardSpec, named, f"{where}[{i}]"))
    names = [b.name for b in boards]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: board names must be unique, got {names}")
    return boards


def _events(entries: list, names: set[str], where: str) -> list[FleetEvent]:
    events = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and "link" in entry:
            entry = {"action": "link", **entry}
        event = from_mapping(FleetEvent, entry, f"{where}[{i}]")
        if event.action not in EVENT_ACTIONS:
            raise ConfigError(f"{where}[{i}].action: {event.action!r} is not one of {EVENT_ACTIONS}")
        if event.board not in names:
            raise ConfigError(f"{where}[{i}].board: unknown board {event.board!r} (boards: {sorted(names)})")
        events.append(event)
    return sorted(events, key=lambda e: e.at_s)


def load_fleet(path: str | Path) -> FleetSpec:
    """Load and validate a fleet file (the one YAML loader, every section a checked dataclass);
    errors name the file, the key and the bad value in one line."""
    path = Path(path)
    keys = from_mapping(_FleetFileKeys, load_yaml(path), str(path))
    job = load_job(path.parent / keys.job_file) if keys.job_file else job_from_dict(keys.job, source=f"{path}: job")
    boards = _boards(keys.boards, f"{path}: boards", path.parent)
    events = _events(keys.events, {b.name for b in boards}, f"{path}: events")
    name = keys.name or path.stem
    return FleetSpec(name=name, cluster=keys.cluster or name, job=job, network=keys.network, jobs=keys.jobs,
                     probe_interval_s=keys.probe_interval_s, boards=tuple(boards), events=tuple(events),
                     gateway=keys.gateway)


def board_to_dict(board: BoardSpec) -> dict:
    """Plain data for a board (what the client reads from its --emulate file)."""
    return dataclasses.asdict(board)


def board_from_dict(data: Any, where: str = "board") -> BoardSpec:
    """A board from plain data, every key checked."""
    return from_mapping(BoardSpec, data, where)


def load_board(path: str | Path) -> BoardSpec:
    """The board an emulated client is (its --emulate file, YAML or JSON)."""
    return board_from_dict(load_yaml(path), str(path))
