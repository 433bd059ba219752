"""Training metrics as JSONL plus progress lines on the log.

Record kinds: `train` (a step whose update was applied), `eval` (a test-set evaluation),
`checkpoint` (a checkpoint set written: after how many steps, where, its size and save time) and
`resume` (training continues from a checkpoint: `from_step`, the set, and the newer sets skipped
as damaged). Steps after a `resume` record repeat the steps from `from_step` on, which the earlier
records may already hold: those updates were lost with the process, not applied twice.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import defaultdict, deque
from pathlib import Path

logger = logging.getLogger(__name__)


def _waiting_s(contribution, outcome, staleness: int) -> float | None:
    """Seconds from a board's update being accepted to its attempt closing; None when unknown or
    when the update is a late one from an earlier step."""
    if staleness or contribution.accepted_at is None or outcome.closed_at is None:
        return None
    return max(0.0, outcome.closed_at - contribution.accepted_at)


class TimeSplit:
    """Where the steps' time goes: per board, the median seconds per step of compute,
    communication, waiting for the step to close and idle; and the coordinator's part. Medians
    over the last `window` steps a board took part in."""

    BOARD = ("compute_s", "comm_s", "waiting_s", "idle_s")
    COORDINATOR = ("publish_s", "configure_s", "aggregate_s")

    def __init__(self, window: int = 1000) -> None:
        self._boards: dict[str, dict[str, deque]] = defaultdict(lambda: {k: deque(maxlen=window) for k in self.BOARD})
        self._coordinator = {k: deque(maxlen=window) for k in self.COORDINATOR}
        self._steps: deque = deque(maxlen=window)
        self._predicted: deque = deque(maxlen=window)
        """(predicted, measured) step seconds of the steps whose split predicted one."""

    def add(self, record: dict) -> None:
        """Take a `train` record as MetricsLog.train_step wrote it."""
        self._steps.append(record["step_s"])
        if record.get("predicted_step_s"):
            self._predicted.append((record["predicted_step_s"], record["step_s"]))
        for key, value in record.get("coordinator", {}).items():
            self._coordinator[key].append(value)
        for device, entry in record["devices"].items():
            for key in self.BOARD:
                if entry.get(key) is not None:
                    self._boards[device][key].append(entry[key])

    def summary(self) -> dict | None:
        """{"step_s", "coordinator": {...}, "boards": {device: {compute_s, comm_s, waiting_s, idle_s}}}
        as medians; None before the first step."""
        if not self._steps:
            return None

        def median(values: deque) -> float | None:
            return round(statistics.median(values), 4) if values else None

        predicted = median(deque(p for p, _ in self._predicted))
        measured = median(deque(m for _, m in self._predicted))
        return {"step_s": median(self._steps), "predicted_step_s": predicted,
                "prediction_error": round(predicted / measured - 1, 4) if predicted and measured else None,
                "coordinator": {k: median(v) for k, v in self._coordinator.items()},
                "boards": {d: {k: median(v) for k, v in keys.items()} for d, keys in sorted(self._boards.items())}}


class MetricsLog:
    """Appends metrics records to a JSONL file and keeps the latest evaluation; with a
    `tensorboard` directory also writes TensorBoard scalars there (loss, accuracy, samples/s, step
    time, learning rate, each board's share and seconds of compute and communication), headed by
    `note` as text (e.g. that the data is synthetic)."""

    def __init__(self, path: Path, *, tensorboard: Path | None = None, note: str = "") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.last_eval: dict = {}
        self._file = path.open("a", buffering=1)
        self._board = None
        if tensorboard is not None:
            # imports tensorboard: only when asked
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(log_dir=str(tensorboard))
            if note:
                self._board.add_text("run", note)

    def start_over(self) -> Path | None:
        """A run from step 0 in a directory that held an earlier run: that run's records move to
        metrics.previous.jsonl (replacing an older one there), so no report or dashboard mixes
        the two; returns where they went (None: there were none)."""
        self._file.close()
        previous = None
        if self.path.stat().st_size:
            previous = self.path.with_name("metrics.previous.jsonl")
            os.replace(self.path, previous)
        self._file = self.path.open("a", buffering=1)
        return previous

    def _scalars(self, step: int, values: dict) -> None:
        if self._board is None:
            return
        for tag, value in values.items():
            if value is not None:
                self._board.add_scalar(tag, value, step)

    def write(self, record: dict) -> None:
        """Append one record (adds the wall-clock time)."""
        self._file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def train_step(self, record, *, lr: float, epoch: float, total_steps: int, log_every: int) -> dict:
        """Record one completed step (`record` is a trainer.StepRecord); returns the record written.

        Each board's entry splits the step: `compute_s`; communication (`comm_s`: `download_s`,
        `encode_s`, `upload_s` and the coordinator's `decode_s`; with `upload_streamed` the upload
        went during backward and `upload_s` is only its part after compute; with `download_streamed` the
        parameters arrived under compute, `download_overlap_s` the part of that download the compute
        did not wait for, not in `download_s`); `waiting_s`, from its update being
        accepted to the attempt closing (waiting for the slowest board; None for a late update
        from an earlier step); and `idle_s`, the rest of the step (before it had its work, and
        through the coordinator's part: `coordinator` → publish, configure, aggregate)."""
        used = [w.contribution for w in record.used]
        samples = sum(c.samples for c in used)
        loss = sum(c.loss * c.samples for c in used) / samples if samples else None
        correct = sum(c.correct for c in used)
        devices = {}
        for item in record.used:
            c = item.contribution
            waiting = _waiting_s(c, record.outcome, item.staleness)
            idle = max(0.0, record.seconds - c.compute_s - c.comm_s - (waiting or 0.0))
            devices[c.device_id] = {
                "samples": c.samples, "compute_s": round(c.compute_s, 4), "download_s": round(c.download_s, 4),
                "encode_s": round(c.encode_s, 4), "upload_s": round(c.upload_s, 4), "decode_s": round(c.decode_s, 4),
                "comm_s": round(c.comm_s, 4), "waiting_s": None if waiting is None else round(waiting, 4),
                "idle_s": round(idle, 4),
                "energy_j": None if c.energy_j is None else round(c.energy_j, 4), "codec": c.codec,
                "upload_bytes": c.wire_bytes, "upload_streamed": c.streamed,
                "download_streamed": c.download_streamed,
                "download_overlap_s": round(c.download_overlap_s, 4), "staleness": item.staleness,
                "weight": round(item.factor, 4)}
        entry = {
            "kind": "train", "step": record.step, "epoch": round(epoch, 4), "loss": loss,
            "train_accuracy": correct / samples if samples else None, "lr": lr, "samples": samples,
            "step_s": round(record.seconds, 4), "samples_per_s": samples / record.seconds,
            "attempts": record.attempts, "shares": record.shares, "codecs": record.codecs, "devices": devices,
            "rejected": record.rejected, "clipped": {d: round(n, 4) for d, n in record.clipped.items()},
            "failed": record.lost, "late": record.outcome.late, "quarantined": record.quarantined,
            "attempt_log": record.attempt_log,
            "coordinator": {k: round(v, 4) for k, v in record.coordinator.items()},
            "predicted_step_s": None if record.predicted_s is None else round(record.predicted_s, 4),
            "noise_scale": None if record.noise_scale is None else round(record.noise_scale, 2),
            **({"stages": record.stages} if record.stages else {}),
            **({"beside": record.beside} if record.beside else {}),
            **({"failures": record.failures} if record.failures else {})}
        self.write(entry)
        self._scalars(record.step, {
            "train/loss": loss, "train/accuracy": entry["train_accuracy"], "train/samples_per_s": entry["samples_per_s"],
            "train/step_s": entry["step_s"], "train/lr": lr,
            **{f"share/{d}": n for d, n in record.shares.items()},
            **{f"compute_s/{d}": v["compute_s"] for d, v in devices.items()},
            **{f"comm_s/{d}": v["comm_s"] for d, v in devices.items()}})
        if samples and (record.step % log_every == 0 or record.step == total_steps - 1):
            shares = "/".join(str(n) for n in record.shares.values())
            codecs = sorted(set(record.codecs.values()))
            logger.info("step %4d/%d  loss %.4f  acc %.3f  %.1f samples/s  shares %s%s", record.step + 1,
                        total_steps, loss, correct / max(samples, 1), samples / record.seconds, shares,
                        "" if codecs == ["none"] else f"  codecs {'/'.join(record.codecs.values())}")
        return entry

    def evaluation(self, step: int, loss: float, accuracy: float, samples: int, seconds: float) -> None:
        """Record a test-set evaluation after `step`."""
        self.last_eval = {"kind": "eval", "step": step, "test_loss": loss, "test_accuracy": accuracy,
                          "test_samples": samples, "eval_s": round(seconds, 3)}
        self.write(self.last_eval)
        self._scalars(step, {"test/accuracy": accuracy, "test/loss": loss})
        logger.info("eval after step %d: test loss %.4f, test accuracy %.3f (%d samples)", step + 1, loss,
                    accuracy, samples)

    def checkpoint(self, next_step: int, name: str, size: int, seconds: float) -> None:
        """Record a checkpoint set written after `next_step` steps."""
        self.write({"kind": "checkpoint", "next_step": next_step, "checkpoint": name, "bytes": size,
                    "save_s": round(seconds, 4)})

    def resume(self, from_step: int, checkpoint: str, skipped: list[dict]) -> None:
        """Record that training continues at step `from_step` from set `checkpoint`; `skipped`:
        newer sets that failed their checks (`{"checkpoint", "reason"}` each)."""
        self.write({"kind": "resume", "from_step": from_step, "checkpoint": checkpoint, "skipped": skipped})

    def close(self) -> None:
        """Close the file (and the TensorBoard writer)."""
        self._file.close()
        if self._board is not None:
            self._board.close()
