"""How much energy a board uses: a power model of compute (idle and busy watts) and radio.

A board's energy over a stretch of time is

    E = busy_w · busy_s + idle_w · idle_s + radio_nj_per_byte · 1e-9 · (bytes sent + received)

Measured energy (a real battery's counter) always wins over this model; the model is what an
emulated board, a board started with ``--power-watts IDLE BUSY``, and the experiment baselines
report, and every output that shows modelled energy calls it "estimated".

Where the default figures come from (none of them measured on this project's machine):

- **Boards.** :func:`default_power` treats an emulated board of any ``speed`` (the fleet files'
  fraction of one gateway core) as a Raspberry-Pi-class board. The Pi Dramble power benchmarks
  (Jeff Geerling, USB meter at 5 V) give the Pi 4 Model B 540 mA idle (≈ 2.7 W) and 1280 mA under
  ``stress --cpu 4`` (≈ 6.4 W); Raspberry Pi's documentation gives 600 mA as its typical
  bare-board active current, and other USB-meter write-ups agree within about a watt. The
  project's lab preset (edgetrain/presets/lab.yaml) emulates a Pi 4 at speed
  :data:`PI4_SPEED` = 0.4. So ``idle_w`` is :data:`BOARD_IDLE_W` = 2.7 W whatever the speed (SoC,
  RAM and PHY are powered anyway), and training adds :data:`BOARD_DYNAMIC_W` = 3.7 W per Pi 4's
  worth of speed (busy = 2.7 + 3.7 · speed / 0.4 W): 6.4 W at 0.4, 3.6 W at 0.1, 12 W at 1.0 (a
  Jetson-class board in its 10-15 W modes). Dynamic power in proportion to the compute done is
  a simplification: a Pi 3B+ (speed 0.14 in the lab preset) measures 5.1 W busy where this
  gives 4.0 W; a fleet file's ``idle_w``/``busy_w`` (or battery) figures replace the default.
- **Radio.** :data:`WIFI_NJ_PER_BYTE` = 100 nJ/byte (12.5 nJ/bit), the contract's default: an
  802.11n NIC draws on the order of 1-2 W while transmitting (Halperin et al., "Demystifying
  802.11n power consumption", HotPower 2010); at the ~100 Mbit/s such a link carries that is
  10-20 nJ/bit. Wired boards should say
  ``radio_nj_per_byte: 10`` (:data:`ETHERNET_NJ_PER_BYTE`): a 100BASE-TX/1000BASE-T PHY pair
  draws a few tenths of a watt more when active (the IEEE 802.3az energy-efficient Ethernet
  motivation figures, Christensen et al., IEEE Communications Magazine 2010), ≈ 1-2 nJ/bit at
  the link rates boards reach. Whole-device Wi-Fi figures (1-17 J per MB, a Macnica application
  note on conventional Wi-Fi equipment) are far higher because
  they include the host's idle power, which this model counts in ``idle_w`` instead.
- **Gateway.** :data:`GATEWAY_IDLE_W` = 6 W and :data:`GATEWAY_BUSY_W` = 15 W: a mini-PC
  (Intel-NUC-class) gateway idles at 5-8 W and draws 15-20 W with a core or two busy (vendor
  and review figures); the centralized baseline trains there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fleet_file imports the core's config; power must stay importable on its own
    from edgetrain.fleet_file import BoardSpec

BOARD_IDLE_W = 2.7
"""Idle draw of a Raspberry-Pi-class board, W (Pi 4 Model B: 540 mA at 5 V)."""
BOARD_DYNAMIC_W = 3.7
"""Draw above idle while training a Pi 4's worth of speed, W (4 cores busy: 6.4 W − 2.7 W)."""
PI4_SPEED = 0.4
"""The speed a Raspberry Pi 4 is emulated at (edgetrain/presets/lab.yaml)."""
WIFI_NJ_PER_BYTE = 100.0
"""Radio energy per byte sent or received over Wi-Fi (802.11n at ~100 Mbit/s, ~1.3 W)."""
ETHERNET_NJ_PER_BYTE = 10.0
"""Radio energy per byte sent or received over wired Ethernet (PHY active power, ~1-2 nJ/bit)."""
GATEWAY_IDLE_W = 6.0
"""Idle draw of a mini-PC gateway, W."""
GATEWAY_BUSY_W = 15.0
"""Draw of a mini-PC gateway training on one core, W."""


def _check_watts(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PowerModel:
    """A board's power draw: idle, training, and energy per byte its radio moves."""

    idle_w: float
    """Draw while not training, W."""
    busy_w: float
    """Draw while training, W (>= idle_w)."""
    radio_nj_per_byte: float = WIFI_NJ_PER_BYTE
    """Radio energy per byte sent plus received, nJ."""

    def __post_init__(self) -> None:
        _check_watts(idle_w=self.idle_w, busy_w=self.busy_w, radio_nj_per_byte=self.radio_nj_per_byte)
        if self.busy_w < self.idle_w:
            raise ValueError(f"busy_w ({self.busy_w}) must be >= idle_w ({self.idle_w})")

    def energy_j(self, *, busy_s: float, idle_s: float, radio_bytes: int = 0) -> float:
        """Joules used over ``busy_s`` seconds training, ``idle_s`` idle, moving ``radio_bytes``
        (sent plus received)."""
        if busy_s < 0 or idle_s < 0 or radio_bytes < 0:
            raise ValueError(f"durations and bytes must be >= 0, got busy_s={busy_s} idle_s={idle_s} "
                             f"radio_bytes={radio_bytes}")
        return busy_s * self.busy_w + idle_s * self.idle_w + radio_bytes * self.radio_nj_per_byte * 1e-9


def default_power(speed: float) -> PowerModel:
    """An emulated board of ``speed`` (fraction of a gateway core) with no power figures: a
    Raspberry-Pi-class board, 2.7 W idle plus 3.7 W per Pi 4's worth of speed (0.4) when
    training, on Wi-Fi."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
    return PowerModel(idle_w=BOARD_IDLE_W, busy_w=BOARD_IDLE_W + BOARD_DYNAMIC_W * speed / PI4_SPEED)


def board_power(board: BoardSpec) -> PowerModel:
    """A fleet board's power model: its battery's idle/busy watts when it has a battery, else its
    own ``idle_w``/``busy_w`` when given, else :func:`default_power` of its speed; its
    ``radio_nj_per_byte`` when given, else Wi-Fi's."""
    default = default_power(board.speed)
    if board.battery is not None:
        idle, busy = board.battery.idle_w, board.battery.busy_w
    else:
        idle = board.idle_w if board.idle_w is not None else default.idle_w
        busy = board.busy_w if board.busy_w is not None else max(idle, default.busy_w)
    radio = board.radio_nj_per_byte if board.radio_nj_per_byte is not None else default.radio_nj_per_byte
    return PowerModel(idle_w=idle, busy_w=busy, radio_nj_per_byte=radio)
