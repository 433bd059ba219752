"""Checkpoints as crash-safe sets, the newest complete one resumed from (no pickle anywhere).

A checkpoint is a directory `runs/<job>/checkpoints/step-000123/` (the model after 123 applied
steps; a resume continues at step 123) holding

- `model.safetensors`      the model's state dict,
- `optimizer.safetensors`  the server optimizer's momentum buffers, by parameter name,
- `state.json`             progress: `next_step`, train seconds, samples, the round policy's
                           state, and `applied_steps` — the ledger of how often each step's
                           update was applied to THIS model state (saved in the same set as the
                           model, so the two never disagree),
- `manifest.json`          written LAST: the step, the time, and each other file's size and
                           sha256. A set without a manifest is a save that did not finish.

Each set is written into a temporary directory, every file and the directory fsynced, then
renamed into place and the parent directory fsynced: a crash at any point leaves the earlier
sets intact and at worst a partial set that a resume recognises and skips. The trainer keeps
the last two complete sets and deletes older ones only once the new one is complete.

Resuming walks the sets newest first and takes the first whose manifest is present, whose files
have the manifest's sizes and hashes, and whose tensors fit the model; every set skipped on the
way is logged with the reason and returned, so the trainer can record it in metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
"""Under the run directory: one subdirectory per checkpoint set."""
PREVIOUS_DIR = "checkpoints.previous"
"""Where a run started from step 0 moves an earlier run's sets (one generation is kept)."""
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
LEGACY_STATE_FILE = "checkpoint.json"
"""The single-file layout of earlier versions (checkpoint.json beside two safetensors files),
which nothing resumes from any more."""
FORMAT = 1
"""manifest.json's `format`: bumped when the set's layout changes."""
KEEP = 2
"""Complete sets kept: the newest and one to fall back to if the newest turns out damaged."""
_SET_NAME = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A resume was asked for and there is no checkpoint it can continue from (the message says
    why, in one line)."""


class DamagedCheckpoint(Exception):
    """A checkpoint set fails its checks (the message says which and how)."""


@dataclass(frozen=True)
class CheckpointSet:
    """One checkpoint set on disk (not yet checked)."""

    path: Path
    next_step: int
    """Steps applied to its model (the name's number): a resume continues at this step."""

    @property
    def name(self) -> str:
        """As metrics.jsonl and the log name it: relative to the run directory."""
        return f"{CHECKPOINTS_DIR}/{self.path.name}"


@dataclass
class Restored:
    """What a resume found: the set it loaded and its state (None and {}: no set is usable), and
    the newer sets it skipped."""

    checkpoint: CheckpointSet | None
    state: dict
    skipped: list[dict] = field(default_factory=list)
    """`{"checkpoint": name, "reason": why}` for every newer set that failed its checks."""


def set_name(next_step: int) -> str:
    """The directory name of the set holding the model after `next_step` steps."""
    return f"step-{next_step:06d}"


def checkpoint_sets(run_dir: Path) -> list[CheckpointSet]:
    """Every set directory of the run, newest (most steps) first; temporary directories of saves
    in progress or interrupted are not sets."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    sets = [CheckpointSet(p, int(m.group(1))) for p in root.iterdir() if p.is_dir() and (m := _SET_NAME.match(p.name))]
    return sorted(sets, key=lambda s: s.next_step, reverse=True)


def has_legacy_checkpoint(run_dir: Path) -> bool:
    """True if the run directory holds a checkpoint in the old single-file layout."""
    return (run_dir / LEGACY_STATE_FILE).exists()


# --- saving ---------------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> CheckpointSet:
    """Write the set for `state["next_step"]` (see the module docstring) and return it.

    Returns only once every byte, the set's directory and its entry in checkpoints/ are on disk.
    A set already there under the same name (a damaged one a resume skipped) is replaced.
    """
    next_step = int(state["next_step"])
    root = run_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{set_name(next_step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    momentum = {}
    for name, param in model.named_parameters():
        buf = optimizer.state.get(param, {}).get("momentum_buffer")
        if buf is not None:
            momentum[name] = buf.detach().contiguous()
    files = {
        MODEL_FILE: save_tensors({k: v.detach().contiguous() for k, v in model.state_dict().items()}),
        OPTIMIZER_FILE: save_tensors(momentum),
        STATE_FILE: json.dumps(state, indent=1).encode(),
    }
    manifest = {"format": FORMAT, "next_step": next_step, "time": round(time.time(), 3), "files": {}}
    for name, data in files.items():
        _write_synced(tmp / name, data)
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)
    final = root / set_name(next_step)
    if final.exists():  # a damaged set of an earlier life under this name: out of the way first
        shutil.rmtree(final.rename(root / f".deleting-{final.name}-{os.getpid()}"))
    os.rename(tmp, final)
    _fsync_dir(root)
    return CheckpointSet(final, next_step)


def prune(run_dir: Path, keep: list[CheckpointSet]) -> list[str]:
    """Delete everything in checkpoints/ but the sets in `keep` (older sets, sets a resume
    skipped, leftovers of interrupted saves); returns the names deleted."""
    root = run_dir / CHECKPOINTS_DIR
    kept = {s.path.name for s in keep}
    deleted = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name in kept:
            continue
        if entry.is_dir():  # renamed first: a crash mid-delete leaves no half a set under a set's name
            doomed = entry if entry.name.startswith(".") else entry.rename(root / f".deleting-{entry.name}")
            shutil.rmtree(doomed)
        else:
            entry.unlink()
        deleted.append(entry.name)
    if deleted:
        _fsync_dir(root)
    return deleted


def set_aside(run_dir: Path) -> Path | None:
    """Move an earlier run's checkpoints/ to checkpoints.previous/ (replacing an older one there),
    so a run that starts from step 0 is never resumed from another run's sets; returns where they
    went (None: there were none)."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir() or not any(root.iterdir()):
        return None
    previous = run_dir / PREVIOUS_DIR
    if previous.exists():
        shutil.rmtree(previous)
    os.rename(root, previous)
    _fsync_dir(run_dir)
    return previous


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- checking and loading -------------------------------------------------------------------------

def verified_files(checkpoint: CheckpointSet) -> dict[str, bytes]:
    """The set's files (manifest excluded) after checking them against its manifest;
    DamagedCheckpoint naming the first problem."""
    manifest_path = checkpoint.path / MANIFEST_FILE
    if not manifest_path.exists():
        raise DamagedCheckpoint("no manifest.json (its save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_bytes())
        form, next_step = manifest["format"], manifest["next_step"]
        listed = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedCheckpoint(f"manifest.json is unreadable ({type(e).__name__}: {e})") from None
    if (form, next_step) != (FORMAT, checkpoint.next_step):
        raise DamagedCheckpoint(f"manifest.json is for format {form}, step {next_step}; "
                                f"expected format {FORMAT}, step {checkpoint.next_step}")
    files = {}
    for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
        if name not in listed:
            raise DamagedCheckpoint(f"manifest.json does not list {name}")
        try:
            data = (checkpoint.path / name).read_bytes()
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{name} is missing") from None
        size, sha256 = listed[name]
        if len(data) != size:
            raise DamagedCheckpoint(f"{name} has {len(data)} bytes, the manifest says {size}")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise DamagedCheckpoint(f"{name} does not match its sha256 in the manifest")
        files[name] = data
    return files


def _parsed_state(files: dict[str, bytes]) -> dict:
    try:
        state = json.loads(files[STATE_FILE])
        if not isinstance(state["next_step"], int) or not all(isinstance(n, int) for n in state["applied_steps"]):
            raise TypeError("next_step and applied_steps must be integers")
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(f"state.json is unusable ({type(e).__name__}: {e})") from None
    return state


def _checked_tensors(files: dict[str, bytes], model: nn.Module) -> tuple[dict, dict]:
    """The model state and momentum buffers, checked to fit `model` (names, shapes, dtypes)
    before anything is loaded into it."""
    try:
        weights, momentum = load_tensors(files[MODEL_FILE]), load_tensors(files[OPTIMIZER_FILE])
    except SafetensorError as e:
        raise DamagedCheckpoint(f"a safetensors file does not load ({e})") from None
    expected = model.state_dict()
    if weights.keys() != expected.keys():
        differ = sorted(weights.keys() ^ expected.keys())
        raise DamagedCheckpoint(f"model.safetensors does not fit the job's model (tensors {differ[:3]} differ)")
    params = dict(model.named_parameters())
    for source, tensors, reference in (("model", weights, expected), ("optimizer", momentum, params)):
        for name, tensor in tensors.items():
            if name not in reference:
                raise DamagedCheckpoint(f"{source}.safetensors has {name}, which the job's model does not")
            if tensor.shape != reference[name].shape or tensor.dtype != reference[name].dtype:
                raise DamagedCheckpoint(f"{source}.safetensors: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                        f"the model's is {tuple(reference[name].shape)} {reference[name].dtype}")
    return weights, momentum


def load_newest(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Restored:
    """Load the newest complete set into `model` and `optimizer` (`checkpoint` None, nothing
    loaded, when no set passes its checks). Each set skipped on the way is logged once, with why."""
    skipped = []
    for checkpoint in checkpoint_sets(run_dir):
        try:
            files = verified_files(checkpoint)
            state = _parsed_state(files)
            weights, momentum = _checked_tensors(files, model)
        except DamagedCheckpoint as e:
            logger.warning("[Coordinator.Checkpoint] skipping %s: %s", checkpoint.name, e)
            skipped.append({"checkpoint": checkpoint.name, "reason": str(e)})
            continue
        model.load_state_dict(weights)
        for name, param in model.named_parameters():
            if name in momentum:
                optimizer.state[param]["momentum_buffer"] = momentum[name]
        return Restored(checkpoint, state, skipped)
    if skipped:
        logger.warning("[Coordinator.Checkpoint] none of the %d checkpoint sets in %s is usable", len(skipped),
                       run_dir / CHECKPOINTS_DIR)
    return Restored(None, {}, skipped)


def newest_complete(run_dir: Path) -> tuple[CheckpointSet, dict[str, bytes]] | None:
    """The newest set that passes its manifest checks, with its files (no model needed)."""
    for checkpoint in checkpoint_sets(run_dir):
        try:
            return checkpoint, verified_files(checkpoint)
        except DamagedCheckpoint:
            continue
    return None


def model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model state of the run's newest complete checkpoint (FileNotFoundError: none)."""
    found = newest_complete(run_dir)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint in {run_dir / CHECKPOINTS_DIR}")
    return load_tensors(found[1][MODEL_FILE])


def read_ledger(run_dir: Path) -> list[int]:
    """How often each step's update was applied to the model of the run's newest complete
    checkpoint (index = step; 0: lost or not reached, 1: applied once, 2+: applied again).
    FileNotFoundError when the run has no complete checkpoint."""
    found = newest_complete(run_dir)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint in {run_dir / CHECKPOINTS_DIR}")
    return list(_parsed_state(found[1])["applied_steps"])


def describe_missing(run_dir: Path, skipped: list[dict]) -> str:
    """Why a run directory has nothing to resume from, in one line (for CheckpointError)."""
    if skipped:
        reasons = "; ".join(f"{s['checkpoint']}: {s['reason']}" for s in skipped)
        return f"no usable checkpoint in {run_dir / CHECKPOINTS_DIR} ({reasons})"
    if has_legacy_checkpoint(run_dir):
        return (f"{run_dir} holds only a checkpoint in the old single-file layout ({LEGACY_STATE_FILE}), "
                "which this version cannot resume from")
    return f"no checkpoint in {run_dir / CHECKPOINTS_DIR}"
