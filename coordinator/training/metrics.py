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
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class MetricsLog:
    """Appends metrics records to a JSONL file and keeps the latest evaluation."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.last_eval: dict = {}
        self._file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        """Append one record (adds the wall-clock time)."""
        self._file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def train_step(self, record, *, lr: float, epoch: float, total_steps: int, log_every: int) -> None:
        """Record one completed step (`record` is a trainer.StepRecord)."""
        used = [w.contribution for w in record.used]
        samples = sum(c.samples for c in used)
        loss = sum(c.loss * c.samples for c in used) / samples if samples else None
        correct = sum(c.correct for c in used)
        devices = {}
        for item in record.used:
            c = item.contribution
            devices[c.device_id] = {
                "samples": c.samples, "compute_s": round(c.compute_s, 4), "download_s": round(c.download_s, 4),
                "encode_s": round(c.encode_s, 4), "upload_s": round(c.upload_s, 4), "comm_s": round(c.comm_s, 4),
                "energy_j": None if c.energy_j is None else round(c.energy_j, 4), "codec": c.codec,
                "upload_bytes": c.wire_bytes, "staleness": item.staleness, "weight": round(item.factor, 4)}
        self.write({
            "kind": "train", "step": record.step, "epoch": round(epoch, 4), "loss": loss,
            "train_accuracy": correct / samples if samples else None, "lr": lr, "samples": samples,
            "step_s": round(record.seconds, 4), "samples_per_s": samples / record.seconds,
            "attempts": record.attempts, "shares": record.shares, "codecs": record.codecs, "devices": devices,
            "rejected": record.rejected, "clipped": {d: round(n, 4) for d, n in record.clipped.items()},
            "failed": record.lost, "late": record.outcome.late, "quarantined": record.quarantined,
            "attempt_log": record.attempt_log,
            **({"stages": record.stages} if record.stages else {}),
            **({"failures": record.failures} if record.failures else {})})
        if samples and (record.step % log_every == 0 or record.step == total_steps - 1):
            shares = "/".join(str(n) for n in record.shares.values())
            codecs = sorted(set(record.codecs.values()))
            logger.info("step %4d/%d  loss %.4f  acc %.3f  %.1f samples/s  shares %s%s", record.step + 1,
                        total_steps, loss, correct / max(samples, 1), samples / record.seconds, shares,
                        "" if codecs == ["none"] else f"  codecs {'/'.join(record.codecs.values())}")

    def evaluation(self, step: int, loss: float, accuracy: float, samples: int, seconds: float) -> None:
        """Record a test-set evaluation after `step`."""
        self.last_eval = {"kind": "eval", "step": step, "test_loss": loss, "test_accuracy": accuracy,
                          "test_samples": samples, "eval_s": round(seconds, 3)}
        self.write(self.last_eval)
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
        """Close the file."""
        self._file.close()
