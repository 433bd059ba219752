"""The end-of-run summary: final accuracy, throughput and each device's share of the work."""

from __future__ import annotations

from edgetrain.config import JobConfig
from edgetrain.data import dataset_is_synthetic


def plan_accuracy(plans: list[dict], step_seconds: list[tuple[int, float]]) -> dict | None:
    """The plan in force at the end: predicted vs measured step time (median over its steps,
    leaving out its first step, which carries the stage handover). None without enough steps."""
    if not plans:
        return None
    last = plans[-1]
    measured = sorted(sec for step, sec in step_seconds if step > last["step"])
    if not measured:
        return None
    median = measured[len(measured) // 2]
    return {**last, "measured_step_s": median, "steps_measured": len(measured),
            "error": (last["predicted_step_s"] - median) / median}


def energy_source(record) -> str:
    """"measured" when the board's last telemetry said its energy came from a sensor (a battery's
    energy counter), else "estimated" (a power model: busy/idle watts plus radio energy)."""
    sample = record.latest_telemetry
    return "measured" if sample is not None and sample.energy_measured else "estimated"


def summarize(job: JobConfig, final_eval: dict, trainer, devices, *, stopped: str | None = None,
              classes: tuple[str, ...] = ()) -> dict:
    """Plain-data summary of a finished run (`trainer` is a Trainer); `stopped`: why the job
    stopped before its last step (JobAborted), None when it completed; `classes`: the dataset's
    class names."""
    total = sum(r.stats["samples"] for r in devices) or 1
    rows = []
    for record in devices:
        stats = record.stats
        if not stats["steps"]:
            continue
        rows.append({
            "device": record.device_id,
            "emulated_speed": record.info.get("emulated_speed") or None,
            "samples_per_s_estimate": round(record.speed.samples_per_s, 2) if record.speed else None,
            "samples": stats["samples"], "share": stats["samples"] / total, "steps": stats["steps"],
            "compute_s": round(stats["compute_s"], 2), "comm_s": round(stats["comm_s"], 2),
            # a channel group member other than the leader reports no samples, but its energy counts
            "energy_j": round(stats["energy_j"], 1) if stats["energy_steps"] else None,
            "energy_per_sample_j": stats["energy_j"] / stats["energy_samples"] if stats["energy_samples"] else None,
            "energy_source": energy_source(record) if stats["energy_steps"] else None,
            "download_bytes": stats["download_bytes"], "upload_bytes": stats["upload_bytes"],
            "codec": record.codec or "none", "rejected_updates": len(record.rejections),
            "alive_at_end": record.alive, "left_reason": record.left_reason or None,
            "speed_claim": record.claim_note or None,
            "own_data": record.own_data(classes),
        })
    return {
        "job": job.name, "model": job.model, "dataset": job.dataset.name, "classes": len(classes) or 10,
        "synthetic_data": dataset_is_synthetic(job.dataset), "split": job.training.split,
        "global_batch": job.training.global_batch,
        "steps": final_eval["step"] + 1 if "step" in final_eval else trainer.steps_applied,
        "steps_applied": trainer.steps_applied, "steps_attempted": trainer.steps_attempted, "stopped": stopped,
        "stop_reason": "aborted" if stopped else getattr(trainer, "stop_reason", None),
        "time_limit_s": job.training.time_limit_s or None,
        "target_accuracy": job.training.target_accuracy or None,
        "test_accuracy": final_eval.get("test_accuracy"), "test_loss": final_eval.get("test_loss"),
        "train_samples": trainer.samples_done, "train_seconds": round(trainer.train_seconds, 2),
        "samples_per_s": trainer.samples_done / trainer.train_seconds if trainer.train_seconds else 0.0,
        "aggregation": job.aggregation.rule, "uplink": job.compression.uplink,
        "downlink": job.compression.downlink,
        "bytes_per_sample": sum(r["download_bytes"] + r["upload_bytes"] for r in rows) / trainer.samples_done
        if trainer.samples_done else None,
        "devices": rows,
        "energy_j": sum(r["energy_j"] for r in rows if r["energy_j"] is not None) or None,
        "energy_estimated": any(r["energy_source"] == "estimated" for r in rows)
        if any(r["energy_source"] for r in rows) else None,
        "plan": plan_accuracy(getattr(trainer, "plans", []), getattr(trainer, "step_seconds", [])),
        "time_split": trainer.time_split.summary() if hasattr(trainer, "time_split") else None,
    }


def summary_table(summary: dict) -> str:
    """Human-readable summary; says so when the data is synthetic."""
    data = f"{summary['dataset']} (SYNTHETIC data, not CIFAR-10)" if summary["synthetic_data"] else summary["dataset"]
    acc = summary["test_accuracy"]
    lines = [
        f"== EdgeTrain run '{summary['job']}': {summary['model']} on {data}, split {summary['split']} ==",
        *([f"STOPPED: {summary['stopped']}"] if summary.get("stopped") else []),
        *([f"stopped at the time limit ({summary['time_limit_s']:g} s of training)"]
          if summary.get("stop_reason") == "time_limit" else []),
        f"test accuracy {acc:.3f} (chance {1 / summary.get('classes', 10):.3f}) after {summary['steps']} steps of "
        f"{summary['global_batch']}"
        if acc is not None else "no evaluation",
        f"steps applied {summary['steps_applied']} of {summary['steps_attempted']} attempted",
        f"throughput {summary['samples_per_s']:.1f} samples/s ({summary['train_samples']} samples in "
        f"{summary['train_seconds']:.1f} s of training)",
        f"aggregation {summary['aggregation']}, uplink {summary['uplink']}, downlink {summary['downlink']}: "
        f"{(summary['bytes_per_sample'] or 0) / 1e3:.1f} kB on the wire per sample",
        *([f"plan ({summary['plan']['kind']}, from step {summary['plan']['step']}): predicted "
           f"{summary['plan']['predicted_step_s']:.3f} s/step, measured {summary['plan']['measured_step_s']:.3f} "
           f"(median of {summary['plan']['steps_measured']} steps): error {summary['plan']['error']:+.0%}"]
          if summary.get("plan") else []),
        *([f"energy {summary['energy_j'] or 0.0:.1f} J, ESTIMATED (~) from power models (busy/idle W + radio "
           "nJ/byte; see edgetrain/power.py), not measured"] if summary.get("energy_estimated") else []),
        "",
        f"{'device':<18}{'speed':>7}{'est. samples/s':>16}{'samples':>9}{'share':>8}{'compute s':>11}{'comm s':>9}"
        f"{'energy J':>10}{'MB down':>9}{'MB up':>8}  codec",
    ]
    for row in summary["devices"]:
        speed = f"{row['emulated_speed']:.2f}" if row["emulated_speed"] else "native"
        est = row["samples_per_s_estimate"]
        lines.append(f"{row['device']:<18}{speed:>7}{est if est is not None else '-':>16}{row['samples']:>9}"
                     f"{row['share']:>8.1%}{row['compute_s']:>11.1f}{row['comm_s']:>9.1f}"
                     f"{_energy_cell(row):>10}"
                     f"{row['download_bytes'] / 1e6:>9.1f}{row['upload_bytes'] / 1e6:>8.1f}  {row['codec']}"
                     + (f"  (speed claim: {row['speed_claim']})" if row.get("speed_claim") else "")
                     + _own_data_note(row.get("own_data")))
    return "\n".join(lines + _time_split_lines(summary.get("time_split")))


def _time_split_lines(split: dict | None) -> list[str]:
    """Where a step's time goes (medians of recent steps), per board and for the coordinator."""
    if not split:
        return []

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    coord = split["coordinator"]
    lines = ["", f"where a step's time goes (median s of {cell(split['step_s'])} s/step): coordinator publish "
             f"{cell(coord['publish_s'])}, configure {cell(coord['configure_s'])}, aggregate {cell(coord['aggregate_s'])}",
             f"{'device':<18}{'compute':>9}{'comm':>9}{'waiting':>9}{'idle':>9}"]
    for device, t in split["boards"].items():
        lines.append(f"{device:<18}{cell(t['compute_s']):>9}{cell(t['comm_s']):>9}{cell(t['waiting_s']):>9}"
                     f"{cell(t['idle_s']):>9}")
    return lines


def _own_data_note(own: dict | None) -> str:
    """A board's own data, as it told it: its sample count and, if shared, its samples per class."""
    if not own:
        return ""
    counts = own.get("class_counts")
    per_class = f": {', '.join(f'{name} {n}' for name, n in counts.items())}" if counts else ""
    return f"  (own data, {own['samples']} samples{per_class})"


def _energy_cell(row: dict) -> str:
    if row["energy_j"] is None:
        return "?"
    return f"{row['energy_j']}" + ("~" if row.get("energy_source") == "estimated" else "")
