"""Checkpoints: model state and optimizer momentum as safetensors, progress as JSON (no pickle)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_FILE = "checkpoint.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "checkpoint.json"


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Write every file to a temporary name first, then swap them in, the JSON naming the step last.

    A crash mid-save leaves the previous checkpoint's files in place (or, between two swaps, a
    newer model with the older JSON, which a resume then redoes the steps of — never the reverse).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    momentum = {}
    for name, param in model.named_parameters():
        buf = optimizer.state.get(param, {}).get("momentum_buffer")
        if buf is not None:
            momentum[name] = buf.contiguous()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, run_dir / (MODEL_FILE + ".tmp"))
    save_file(momentum, run_dir / (OPTIMIZER_FILE + ".tmp"))
    (run_dir / (STATE_FILE + ".tmp")).write_text(json.dumps(state, indent=2))
    for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
        os.replace(run_dir / (name + ".tmp"), run_dir / name)


def load_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model and optimizer momentum; returns the saved progress state."""
    state = json.loads((run_dir / STATE_FILE).read_text())
    model.load_state_dict(load_file(run_dir / MODEL_FILE))
    momentum = load_file(run_dir / OPTIMIZER_FILE)
    for name, param in model.named_parameters():
        if name in momentum:
            optimizer.state[param]["momentum_buffer"] = momentum[name]
    return state


def has_checkpoint(run_dir: Path) -> bool:
    """True if `run_dir` holds a complete checkpoint."""
    return (run_dir / STATE_FILE).exists()
