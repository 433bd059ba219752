"""Which torch a board may train with, and what mixed versions across a fleet mean.

Fleets mix versions as a matter of course: Raspberry Pis take current wheels from PyPI, a Jetson
keeps the torch NVIDIA builds for its JetPack (6.1 and 6.2: 2.5.0a0+...nv24.xx, a pre-release in
PEP 440's order, which is why the floor is written as ``2.5.0a0``). Boards send their versions when
they register; the coordinator refuses only a torch below ``edgetrain.TORCH_FLOOR`` (the oldest
EdgeTrain runs on) and logs a warning for one whose release differs from its own: the wire format
(named float tensors) is the same everywhere, but kernels differ in rounding between releases, so
a mixed fleet's training is not bit-for-bit any one release's.

Plain strings in, plain strings out: no torch import (the coordinator checks registrations here).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

import edgetrain


def torch_refusal(version: str) -> str | None:
    """Why a board with torch `version` cannot train here (None: it can). An unknown or
    unparseable version is not refused: a board decides what it runs."""
    if not version:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed < Version(edgetrain.TORCH_FLOOR):
        return (f"torch {version} is older than EdgeTrain supports (at least {edgetrain.TORCH_FLOOR}, which admits "
                "JetPack 6.1's 2.5.0a0 builds): install a newer torch on the board (docs/boards.md)")
    return None


def release(version: str) -> str:
    """The release a version belongs to, "major.minor" (2.5.0a0+872d972e41.nv24.08 -> 2.5); the
    version itself when it does not parse."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return version
    return f"{parsed.major}.{parsed.minor}"


def mixed_note(board: str, board_version: str, own_version: str) -> str | None:
    """A warning when a board's torch release differs from the coordinator's (None: same release,
    or either unknown)."""
    if not board_version or not own_version or release(board_version) == release(own_version):
        return None
    return (f"{board} trains with torch {board_version}, the coordinator with {own_version}: supported, but "
            "kernels round differently between releases, so training is not bit-for-bit one release's")
