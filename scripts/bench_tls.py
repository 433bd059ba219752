"""Benchmark: what mutual TLS costs the DP fleet, and how long a board takes to pair.

The DP benchmark's fleet — four emulated boards (0.5, 0.3, 0.2, 0.1 of a core; cgroup quota as
root, duty-cycle otherwise) training MobileNetV2 with a global batch of 64 on SYNTHETIC
CIFAR-shaped data — runs with mutual TLS (each run its own fleet authority; every board pairs with
a one-use join token, as `edgetrain local` does) and with `--insecure`, interleaved A B A B ...
in one run so both arms see the same machine. Throughput is samples/s over the steps after
warm-up (metrics.jsonl). CPU-seconds per sample are the boards' own CPU time (user + system of
each client process, what its cgroup is charged) between the warm-up step and the end, divided
by the samples trained then: the 0.1-core board pays for TLS inside its own quota.

`pairing_seconds` (median over the TLS runs' boards): from a client starting to pair (its key
made, the gateway's CA checked against the token, the certificate signed) to the coordinator
accepting its registration, as the client logs it; torch import and profiling are not in it.

The insecure arm runs on loopback only and says so. The last line printed is one JSON object.

    python scripts/bench_tls.py [--blocks 3] [--steps 30] [--warmup 5] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

from edgetrain.emulator.launch import LocalRun, plain_demo_job, run_local
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm

SPEEDS = (0.5, 0.3, 0.2, 0.1)
PAIRED = re.compile(r"registered with the coordinator ([0-9.]+) s after it started pairing")


def _client_processes() -> list[psutil.Process]:
    me = psutil.Process()
    found = []
    for child in me.children(recursive=True):
        try:
            if "client" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


class CpuWatch:
    """Samples the client processes' CPU time while a run goes on: the value when the warm-up
    step was logged, and the last value seen before each process exited."""

    def __init__(self, metrics: Path, warmup: int) -> None:
        self.metrics, self.warmup = metrics, warmup
        self.at_warmup: dict[int, float] | None = None
        self.last: dict[int, float] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _trained(self) -> int:
        if not self.metrics.exists():
            return 0
        return sum(1 for line in self.metrics.read_text().splitlines() if '"kind": "train"' in line)

    def _run(self) -> None:
        while not self.done.is_set():
            for proc in _client_processes():
                try:
                    times = proc.cpu_times()
                    self.last[proc.pid] = times.user + times.system
                except psutil.Error:
                    continue
            if self.at_warmup is None and self._trained() >= self.warmup:
                self.at_warmup = dict(self.last)
            self.done.wait(0.2)

    def stop(self) -> float:
        """CPU-seconds the boards used after the warm-up step."""
        self.done.set()
        self.thread.join()
        start = self.at_warmup or {}
        return sum(cpu - start.get(pid, 0.0) for pid, cpu in self.last.items())


def run_arm(secure: bool, index: int, args: argparse.Namespace, workdir: Path) -> dict:
    name = f"bench-tls-{'mtls' if secure else 'insecure'}-{index}"
    job = plain_demo_job()  # both arms the same plan: proportional data parallelism
    job.update(name=name, model=args.model)
    job["dataset"].update(train_size=128 if args.smoke else 4096, test_size=32 if args.smoke else 256)
    job["training"].update(steps=args.steps, min_clients=len(SPEEDS), eval_every=0, global_batch=args.batch,
                           log_every=10)
    job_file = workdir / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = workdir / "runs" / name
    watch = CpuWatch(run_dir / "metrics.jsonl", args.warmup)
    code = run_local(LocalRun(job_file=job_file, speeds=SPEEDS, runs_dir=workdir / "runs", insecure=not secure),
                     job_name=name)
    cpu_s = watch.stop()
    if code != 0:
        raise RuntimeError(f"{name} failed with exit code {code}; logs in {run_dir / 'logs'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= args.warmup]
    samples = sum(r["samples"] for r in steps)
    pairing = [float(m.group(1)) for log in (run_dir / "logs").glob("*.log")
               for m in PAIRED.finditer(log.read_text())]
    if secure and len(pairing) != len(SPEEDS):
        raise RuntimeError(f"{name}: {len(pairing)} of {len(SPEEDS)} boards logged their pairing time")
    return {"samples_per_s": samples / sum(r["step_s"] for r in steps),
            "cpu_s_per_sample": cpu_s / samples if samples else None, "pairing_s": pairing}


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=3, help="A B blocks (each: one mTLS run, one insecure run)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model", default="mobilenet_v2")
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:  # one block of two-step runs on a small model
        args.blocks, args.steps, args.warmup, args.batch, args.model = 1, 2, 1, 16, "small_cnn"
    stop_on_sigterm()
    print(f"# {args.model}, global batch {args.batch}, emulated boards {SPEEDS}; data: SYNTHETIC; "
          f"{args.blocks} blocks of (mTLS, --insecure on loopback)", flush=True)
    results: dict[str, list[dict]] = {"mtls": [], "insecure": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_tls_") as tmp:
        for block in range(args.blocks):
            for arm in ("mtls", "insecure"):
                result = run_arm(arm == "mtls", block, args, Path(tmp))
                results[arm].append(result)
                print(f"block {block} {arm:>8}: {result['samples_per_s']:.1f} samples/s, "
                      f"{result['cpu_s_per_sample'] * 1000:.1f} board CPU-ms/sample"
                      + (f", pairing {max(result['pairing_s']):.2f} s (slowest board)" if result["pairing_s"] else ""),
                      flush=True)
    tls = [r["samples_per_s"] for r in results["mtls"]]
    plain = [r["samples_per_s"] for r in results["insecure"]]
    tls_cpu = [r["cpu_s_per_sample"] * 1000 for r in results["mtls"]]
    plain_cpu = [r["cpu_s_per_sample"] * 1000 for r in results["insecure"]]
    pairing = [s for r in results["mtls"] for s in r["pairing_s"]]
    cost = 1 - statistics.median(tls) / statistics.median(plain)
    paired = [t / p for t, p in zip(tls, plain)]  # each block's two runs saw the same machine
    print(f"mTLS      samples/s: {_spread(tls)}; board CPU-ms/sample {_spread(tls_cpu)}")
    print(f"insecure  samples/s: {_spread(plain)}; board CPU-ms/sample {_spread(plain_cpu)}")
    print(f"per block, mTLS / insecure: {', '.join(f'{r:.3f}' for r in paired)} (median {statistics.median(paired):.3f})")
    print(f"mTLS costs {cost * 100:.1f}% of throughput (target <= 5%); pairing {_spread(pairing)} s "
          f"(target < 5 s); {time.monotonic() - started:.0f} s in all")
    finish(__file__, {
        "model": args.model, "global_batch": args.batch, "speeds": SPEEDS, "synthetic_data": True,
        "blocks": args.blocks, "steps": args.steps, "warmup": args.warmup,
        "tls_samples_per_s": round(statistics.median(tls), 2),
        "insecure_samples_per_s": round(statistics.median(plain), 2),
        "tls_runs_samples_per_s": [round(v, 2) for v in tls],
        "insecure_runs_samples_per_s": [round(v, 2) for v in plain],
        "tls_cost_fraction": round(cost, 4),
        "tls_over_insecure_per_block": [round(r, 3) for r in paired],
        "tls_board_cpu_ms_per_sample": round(statistics.median(tls_cpu), 2),
        "insecure_board_cpu_ms_per_sample": round(statistics.median(plain_cpu), 2),
        "pairing_seconds": round(statistics.median(pairing), 3),
        "pairing_seconds_max": round(max(pairing), 3),
    }, args)


if __name__ == "__main__":
    main()
