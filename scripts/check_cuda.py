"""Check: a board training on a device beside CPU boards computes what single-process SGD computes.

Two runs of a real coordinator and three boards (separate processes, mutual TLS, loopback), each
ending with the coordinator's parameters compared against single-process SGD on the CPU on the
same global batches (edgetrain.training.single_process_sgd):

- `dp`: data parallelism (equal split) over the device board and two CPU boards;
- `pipeline`: two stages, the first block on a CPU board, the three heavier ones (ResNet-free
  small CNN: conv2, conv3, head) on the device board, beside a CPU board as a data-parallel shard.

The job says `device: auto`; the CPU boards are started with CUDA hidden (CUDA_VISIBLE_DEVICES
empty), so only the device board can train on a GPU. With `--device cpu` it is hidden from every
board: the same code path, on the CPU (what CI runs). With `--device cuda` the device board must
train on CUDA (it says so in its log, which is checked) and runs with `--deterministic` (TF32 off,
deterministic kernels). The model is the BatchNorm-free small CNN, so data parallelism and
pipelines are exact up to float32 rounding: the tolerance is 2e-5 on the CPU (as
tests/test_dp_integration.py) and 1e-4 with a GPU (its kernels sum in another order).

    python scripts/check_cuda.py [--device cpu|cuda] [--steps 4] [--keep DIR]

Prints one line per run, then one JSON object (`device`, `runs` -> max abs difference, tolerance,
whether it passed); exit code 0 when every run passed, 1 when one did not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from coordinator.training.checkpoint import model_state
from edgetrain.config import job_from_dict
from edgetrain.emulator.launch import EmulatedTrust
from edgetrain.supervisor import edgetrain_command, stop, wait_for_address
from edgetrain.training import single_process_sgd

TOLERANCE = {"cpu": 2e-5, "cuda": 1e-4}
DEVICE_BOARD = "device-board"


def job(name: str, steps: int, pipeline: bool) -> dict:
    data = {"name": name, "model": "small_cnn", "seed": 0, "device": "auto",
            "dataset": {"name": "synthetic", "train_size": 512, "test_size": 64, "augment": False},
            "training": {"global_batch": 48, "steps": steps, "min_clients": 3, "eval_every": 0, "log_every": 1,
                         "split": "equal", "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0},
            "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "schedule": "cosine",
                          "warmup_steps": 1}}
    if pipeline:
        data["pipeline"] = {"stages": [{"blocks": 1, "boards": ["cpu-a"]}, {"blocks": 3, "boards": [DEVICE_BOARD]}],
                            "microbatches": 4, "dp_boards": ["cpu-b"], "dp_share": 0.25}
    return data


def run(kind: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One run: coordinator + the device board + two CPU boards; the parameters against the reference."""
    name = f"check-{kind}"
    data = job(name, args.steps, kind == "pipeline")
    job_file = workdir / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(data))
    trust = EmulatedTrust(workdir / name / "trust")
    port_file = workdir / name / "address"
    logs = workdir / name / "logs"
    logs.mkdir(parents=True)
    coordinator = subprocess.Popen(edgetrain_command(
        "coordinator", "--config", str(job_file), "--bind", "127.0.0.1:0", "--port-file", str(port_file),
        "--runs-dir", str(workdir / "runs"), "--data-dir", str(workdir / "data"), "--no-advertise",
        "--dashboard", "none", *trust.gateway_args()), stdout=(logs / "coordinator.log").open("w"),
        stderr=subprocess.STDOUT)
    boards: list[subprocess.Popen] = []
    try:
        address = wait_for_address(port_file, coordinator)
        for board in (DEVICE_BOARD, "cpu-a", "cpu-b"):
            credentials, env = trust.board(board)
            on_device = board == DEVICE_BOARD and args.device == "cuda"
            if not on_device:
                env["CUDA_VISIBLE_DEVICES"] = ""
            extra = ["--deterministic"] if on_device else []
            boards.append(subprocess.Popen(edgetrain_command(
                "client", "--coordinator", address, "--name", board, "--threads", "1", "--data-dir",
                str(workdir / "data"), *credentials, *extra), stdout=(logs / f"{board}.log").open("w"),
                stderr=subprocess.STDOUT, env=env))
        code = coordinator.wait(timeout=args.timeout)
        stop(boards, grace_s=15)
    finally:
        stop([*boards, coordinator], grace_s=0)
    if code != 0:
        raise RuntimeError(f"{name}: the coordinator exited with code {code} (logs in {logs})")
    device_log = (logs / f"{DEVICE_BOARD}.log").read_text()
    trained_on = "cuda" if "trains job" in device_log and "device cuda" in device_log else "cpu"
    if trained_on != args.device:
        raise RuntimeError(f"{name}: the device board trained on {trained_on}, not {args.device} (its log: "
                           f"{logs / DEVICE_BOARD}.log)")
    reference = single_process_sgd(job_from_dict(data))
    state = model_state(workdir / "runs" / name)
    diff = max(float((state[k].double() - reference[k].double()).abs().max()) for k in reference)
    return {"max_abs_difference": diff, "tolerance": TOLERANCE[args.device], "passed": diff < TOLERANCE[args.device],
            "device_board": trained_on}


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_cuda.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                        help="where the device board trains (default cuda; cpu: the same path on the CPU, as CI runs it)")
    parser.add_argument("--steps", type=int, default=4, help="training steps of each run (default 4)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take (default 300)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep the runs' files in DIR")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); "
                         "run --device cpu for the same path on the CPU")
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="check-cuda-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        runs = {}
        for kind in ("dp", "pipeline"):
            runs[kind] = run(kind, args, workdir)
            r = runs[kind]
            print(f"{kind}: device board on {r['device_board']}; parameters differ from single-process SGD by at most "
                  f"{r['max_abs_difference']:.2e} (tolerance {r['tolerance']:.0e}): "
                  f"{'passed' if r['passed'] else 'FAILED'}", flush=True)
    except RuntimeError as e:
        print(f"check_cuda.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"device": args.device, "steps": args.steps, "cuda_visible_devices":
                      os.environ.get("CUDA_VISIBLE_DEVICES"), "runs": runs}))
    return 0 if all(r["passed"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
