"""Benchmark: data-parallel throughput on a heterogeneous fleet against its ideal, its ceiling and DDP.

The `compute` fleet (experiments/fleets/compute.yaml: four emulated boards at 0.5, 0.3, 0.2 and
0.1 of a core on loopback; cgroup CPU quota as root, duty-cycle otherwise) trains MobileNetV2 on
SYNTHETIC CIFAR-shaped data at each global batch of `--batches`, in these arms, measured in one
run:
- `ceiling`: the boards training alone, at once, with no communication (each its proportional
  share of the global batch, its own SGD step): what the emulation itself allows;
- `ddp`: PyTorch DistributedDataParallel over gloo with its equal split, on the same throttled
  boards (`edgetrain experiment run`'s `baseline: ddp`; gloo has no authentication: loopback only,
  INSECURE, and said so in its run's outputs);
- `equal`, `proportional`: EdgeTrain synchronous data parallelism with the equal split and with
  shares from measured speed;
- `hybrid`: EdgeTrain with its planner on (pipeline stages and data-parallel groups);
- `proportional` leaves `training.stream_upload` at auto (a board streams its update during
  backward only while its uploads wait on the link; on these loopback links they wait on the
  board's CPU, so it uploads after compute), and `training.stream_download` at auto too (the same
  choice for running the forward pass while the parameters arrive). Four more arms, not run unless
  named: `streamed` (`proportional` with every update streamed during backward) and `unstreamed`
  (never); `download_streamed` (every full download under the compute) and `download_first`
  (never): each overlap's effect, side by side.
With `--sixteen`, the `sixteen` fleet (16 boards at 0.1 of a core) runs the proportional arm (if named) at a
global batch of 512, and the ceiling (when it runs) is also measured for those 16 boards at 32
samples each (batch "512").

"Ideal" is nominal: the sum of the boards' fractions of a core times one unthrottled core's
training throughput on the same model and batch, measured in this run (before the arms and
after them; the faster window counts). The machine's speed drifts by 10-15% over a run, so each
fleet arm also runs on its own between two timings of the core at its batch (the one after an arm
is the one before the next), and its *adjacent ideal* is their mean times the fleet's fraction of
a core: the ideal at the time the arm ran. Every process measured — the boards, the DDP ranks, the
ceiling's and the ideal's — keeps freed memory for reuse (edgetrain.allocator); the one core with
glibc's default malloc is timed once too and reported beside it (`one_core_glibc_default_malloc`).
Throughput is samples per second of training over the steps after `--warmup`. `time_split` gives, per arm, batch and board,
the median seconds per step of compute, communication and waiting (from metrics.jsonl; for DDP
communication is the step time outside forward + backward, all-reduce waits included, so its
waiting is null).

    python scripts/bench_dp.py [--batches 128,64] [--steps 40] [--warmup 8] [--smoke] [--record]
                               [--arms ceiling,ddp,equal,proportional,hybrid[,streamed,unstreamed,
                                        download_streamed,download_first]]
                               [--fleet compute|bandwidth] [--sixteen]
                               [--keep DIR]

Last line: one JSON object: `ideal_samples_per_s` (batch -> value; batch as a string), and maps
arm -> batch -> value for `samples_per_s`, `fraction_of_ideal`, `fraction_of_ceiling`, `over_ddp`,
`adjacent_ideal_samples_per_s` and `fraction_of_adjacent_ideal` (the fleet arms);
`time_split` (arm -> batch -> board -> {compute_s, comm_s, waiting_s}); `streamed_over_unstreamed`
(batch -> streamed / unstreamed samples/s, when both ran) and `download_streamed_over_first` (the same
for downloads); `prediction_error`
(EdgeTrain arm -> batch -> the planner's (hybrid) or the split's predicted step time over the measured one,
minus 1, where the run reports a plan).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from edgetrain.config import load_yaml
from edgetrain.experiment.bench_output import add_bench_args, finish, run_child, stop_on_sigterm

REPO = Path(__file__).resolve().parent.parent
FLEETS = {"compute": REPO / "experiments" / "fleets" / "compute.yaml",
          "bandwidth": REPO / "experiments" / "fleets" / "bandwidth.yaml",
          "sixteen": REPO / "experiments" / "fleets" / "sixteen.yaml"}
EDGETRAIN_ARMS = {"equal": {"set": {"training.split": "equal"}},
                  "proportional": {"set": {"training.split": "proportional"}},
                  "hybrid": {"set": {"planner.enabled": True}},
                  "streamed": {"set": {"training.split": "proportional", "training.stream_upload": True}},
                  "unstreamed": {"set": {"training.split": "proportional", "training.stream_upload": False}},
                  "download_streamed": {"set": {"training.split": "proportional", "training.stream_download": True}},
                  "download_first": {"set": {"training.split": "proportional", "training.stream_download": False}}}
ALL_ARMS = ("ceiling", "ddp", *EDGETRAIN_ARMS)
DEFAULT_ARMS = ("ceiling", "ddp", "equal", "proportional", "hybrid")
SIXTEEN_BATCH = 512
TRAIN_SIZE = 4096


def fleet_boards(fleet: str) -> list[dict]:
    return load_yaml(FLEETS[fleet])["boards"]


def fleet_speeds(fleet: str) -> list[float]:
    return [b["speed"] for b in fleet_boards(fleet)]


def fleet_links(fleet: str) -> str:
    """The fleet's links as the header line says them (its file's, or loopback)."""
    rates = [b["link"]["mbit_per_s"] for b in fleet_boards(fleet) if b.get("link")]
    return f"links of {'/'.join(f'{r:g}' for r in rates)} Mbit/s shaped on loopback" if rates else "loopback"


def _train_alone(model: str, speed: float | None, batch: int, seconds: float, barrier, results,
                 keep_memory: bool) -> None:
    """Child: train `model` at `batch` samples a step (SGD) under `speed` of a core (None: a whole
    unthrottled core) for `seconds` after warm-up and the barrier; put (speed, samples/s). With
    `keep_memory`, glibc keeps freed memory as the boards' processes do (edgetrain.allocator)."""
    import torch

    from edgetrain.allocator import keep_freed_memory
    from edgetrain.config import DatasetSpec
    from edgetrain.data import load_dataset, make_batch
    from edgetrain.emulator.throttle import limit_cpu
    from edgetrain.models import build_model

    if keep_memory:
        keep_freed_memory()
    torch.set_num_threads(1)
    dataset = load_dataset(DatasetSpec(name="synthetic", train_size=max(batch, 256)), train=True)
    net = build_model(model, seed=0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = make_batch(dataset, [i % len(dataset) for i in range(batch)], augment=False, seed=0, step=0)
    net.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    with limit_cpu(speed, name=f"bench-dp-{speed}") as limiter:
        for _ in range(2):
            with limiter.working():
                step()
        barrier.wait()
        started, samples = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            with limiter.working():
                step()
            samples += batch
        results.put((speed, samples / (time.perf_counter() - started), limiter.mode))


def train_alone_at_once(model: str, boards: list[tuple[float | None, int]], seconds: float,
                        keep_memory: bool = True) -> list[tuple]:
    """Run every (speed, batch) in `boards` as its own process, all timed over the same window."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(boards)), ctx.Queue()
    procs = [ctx.Process(target=_train_alone, args=(model, s, b, seconds, barrier, results, keep_memory))
             for s, b in boards]
    try:
        for p in procs:
            p.start()
        return [results.get(timeout=600 + seconds) for _ in procs]
    finally:  # interrupted: stop the ones still training
        for p in procs:
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join()


def ceiling_boards(alone: list[tuple]) -> dict[str, float | list[float]]:
    """Speed -> samples/s of the board at that speed training alone (a list, fastest first, where
    several boards share a speed)."""
    rates: dict[str, list[float]] = {}
    for speed, rate, _ in sorted(alone, key=lambda r: (r[0], r[1]), reverse=True):
        rates.setdefault(f"{speed:g}", []).append(round(rate, 2))
    return {speed: r[0] if len(r) == 1 else r for speed, r in rates.items()}


def proportional_shares(speeds: list[float], batch: int) -> list[int]:
    """`batch` split in proportion to `speeds` (largest remainders), at least 1 each."""
    total = sum(speeds)
    raw = [batch * s / total for s in speeds]
    shares = [max(1, int(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)[: batch - sum(shares)]:
        shares[i] += 1
    return shares


def run_arms(workdir: Path, name: str, fleet: str, arms: list[str], batches: list[int], steps: int,
             model: str) -> dict[tuple[str, int], Path]:
    """Run every arm at every batch with `edgetrain experiment run`; their run directories."""
    entries = []
    for batch in batches:
        for arm in arms:
            entry = {"name": f"{arm}-b{batch}", **(EDGETRAIN_ARMS.get(arm) or {"baseline": "ddp"})}
            entry["set"] = {**entry.get("set", {}), "training.global_batch": batch}
            entries.append(entry)
    spec = {"name": name, "fleet": str(FLEETS[fleet]), "stop": {"steps": steps}, "seeds": [0], "arms": entries,
            "job": {"name": name, "model": model, "seed": 0,
                    "dataset": {"name": "synthetic", "train_size": TRAIN_SIZE, "test_size": 256},
                    "training": {"eval_every": 0, "log_every": 10},
                    "optimizer": {"lr": 0.05, "momentum": 0.9, "schedule": "constant", "warmup_steps": 0}}}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = workdir / name
    code = run_child([sys.executable, "-m", "edgetrain", "experiment", "run", str(path), "--out", str(out)], cwd=REPO)
    if code != 0:
        print(f"experiment {name} exited with code {code}; reading the arms that finished", file=sys.stderr)
    return {(arm, batch): out / f"{arm}-b{batch}-r0" for batch in batches for arm in arms}


def steady_state(run_dir: Path, warmup: int) -> dict | None:
    """Samples/s over the steps after `warmup`, the per-board time split, and the plan's
    prediction error (None when the run did not finish)."""
    metrics = run_dir / "metrics.jsonl"
    if not (run_dir / "summary.json").exists() or not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train" and r["step"] >= warmup]
    if not steps:
        return None
    split: dict[str, dict] = {}
    for board in sorted({d for r in steps for d in r["devices"]}):
        mine = [r["devices"][board] for r in steps if board in r["devices"]]

        def median(key: str, mine=mine) -> float | None:
            values = [d[key] for d in mine if d.get(key) is not None]
            return round(statistics.median(values), 4) if values else None

        split[board] = {"compute_s": median("compute_s"), "comm_s": median("comm_s"), "waiting_s": median("waiting_s")}
    summary = json.loads((run_dir / "summary.json").read_text())
    plan, timing = summary.get("plan"), summary.get("time_split") or {}
    error = plan["error"] if plan else timing.get("prediction_error")  # the planner's, else the split's
    return {"samples_per_s": sum(r["samples"] for r in steps) / sum(r["step_s"] for r in steps),
            "time_split": split, "prediction_error": None if error is None else round(error, 3),
            "step_s": round(statistics.median(r["step_s"] for r in steps), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="128,64")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"from {', '.join(ALL_ARMS)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8, help="steps left out of the throughput")
    parser.add_argument("--seconds", type=float, default=30.0, help="timed window of the ceiling and ideal runs")
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--fleet", choices=("compute", "bandwidth"), default="compute",
                        help="bandwidth: the same boards behind 100/50/20/10 Mbit/s links (the ceiling has no links)")
    parser.add_argument("--sixteen", action="store_true", help="also the 16-board fleet (proportional, batch 512)")
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:  # one arm, one small batch, two steps of a small model, one-second timings
        args.batches, args.arms, args.steps, args.warmup, args.seconds, args.model = "16", "proportional", 2, 1, 0.5, "small_cnn"
    stop_on_sigterm()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes whole numbers separated by commas, got {args.batches!r}")
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ALL_ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ALL_ARMS)}")
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.sixteen and SIXTEEN_BATCH in batches:  # results are keyed by arm and batch: one fleet per batch
        parser.error(f"with --sixteen, batch {SIXTEEN_BATCH} is the 16-board fleet's; leave it out of --batches")
    speeds = fleet_speeds(args.fleet)
    print(f"# {args.model}, batches {batches}, emulated boards {speeds}, {fleet_links(args.fleet)}; data: SYNTHETIC",
          flush=True)

    # the nominal ideal: one unthrottled core at each batch, times the fleet's fraction of a core;
    # the core is timed before the arms and again after them, and the faster window counts (this
    # machine's speed drifts by ~10% over minutes: the ideal is never the slower reading)
    all_batches = sorted(set(batches + ([SIXTEEN_BATCH] if args.sixteen else [])))

    def time_one_core_at(b: int, when: str) -> float:
        value = train_alone_at_once(args.model, [(None, b)], args.seconds)[0][1]
        print(f"one unthrottled core at batch {b} ({when}): {value:.1f} samples/s", flush=True)
        return value

    def time_one_core(when: str) -> dict[int, float]:
        return {b: time_one_core_at(b, when) for b in all_batches}

    one_core_windows = [time_one_core("before the arms")]
    # for comparison only: the same core with glibc's default malloc (memory handed back to the
    # kernel and faulted in again every step); every arm, the ceiling and the ideal keep it
    glibc_default = {b: train_alone_at_once(args.model, [(None, b)], args.seconds, keep_memory=False)[0][1]
                     for b in all_batches}
    for b, v in glibc_default.items():
        print(f"one unthrottled core at batch {b}, glibc's default malloc: {v:.1f} samples/s", flush=True)

    results: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    if "ceiling" in arms:
        ceilings = [(b, speeds) for b in batches]
        if args.sixteen:  # the 16 boards alone at once, 32 samples each: the 16-board fleet's own ceiling
            ceilings.append((SIXTEEN_BATCH, fleet_speeds("sixteen")))
        for b, board_speeds in ceilings:
            alone = train_alone_at_once(args.model, list(zip(board_speeds, proportional_shares(board_speeds, b))),
                                        args.seconds)
            results["ceiling"][b] = {"samples_per_s": sum(r[1] for r in alone), "throttle": alone[0][2],
                                     "boards": ceiling_boards(alone)}
            print(f"ceiling at batch {b} ({len(alone)} boards): {results['ceiling'][b]['samples_per_s']:.1f} "
                  f"samples/s ({results['ceiling'][b]['throttle']} throttle)", flush=True)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="bench-dp-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        fleet_arms = [a for a in arms if a != "ceiling"]
        # each fleet arm runs on its own, between two timings of one core at its batch (the one after
        # an arm is the one before the next): its adjacent ideal is their mean, the machine's speed
        # while the arm ran, which drifts by 10-15% over a run
        runs: dict[tuple[str, int], Path] = {}
        adjacent: dict[str, dict[int, float]] = {}
        plan = [(args.fleet, arm, b) for b in batches for arm in fleet_arms]
        if args.sixteen and "proportional" in arms:
            plan.append(("sixteen", "proportional", SIXTEEN_BATCH))
            results.setdefault("proportional", {})
        before: dict[int, float] = {}
        for fleet, arm, b in plan:
            if b not in before:
                before[b] = time_one_core_at(b, "before its first arm")
            runs.update(run_arms(workdir, f"bench-dp-{arm}-b{b}", fleet, [arm], [b], args.steps, args.model))
            after = time_one_core_at(b, f"after {arm}")
            adjacent.setdefault(arm, {})[b] = (before[b] + after) / 2
            before[b] = after
        for (arm, b), run_dir in runs.items():
            measured = steady_state(run_dir, args.warmup)
            if measured is not None:
                results[arm][b] = measured
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if fleet_arms or "ceiling" in arms:
        one_core_windows.append(time_one_core("after the arms"))
    one_core = {b: max(w[b] for w in one_core_windows) for b in all_batches}

    def fleet_fraction(b: int) -> float:
        """The fleet's fraction of a core at batch `b` (the 16-board fleet's at its batch)."""
        return sum(fleet_speeds("sixteen")) if args.sixteen and b == SIXTEEN_BATCH else sum(speeds)

    ideal = {b: one_core[b] * fleet_fraction(b) for b in all_batches}
    adjacent_ideal = {a: {b: core * fleet_fraction(b) for b, core in per.items()} for a, per in adjacent.items()}

    def over(arm: str, other: str) -> dict[str, float]:
        """Batch -> `arm`'s samples/s over `other`'s, where both ran."""
        return {str(b): round(r["samples_per_s"] / results[other][b]["samples_per_s"], 3)
                for b, r in sorted(results.get(arm, {}).items()) if b in results.get(other, {})}

    def by_arm(key) -> dict:
        return {arm: {str(b): key(arm, b, r) for b, r in sorted(per.items())} for arm, per in results.items() if per}

    out = {
        "model": args.model, "fleet": args.fleet, "speeds": speeds, "synthetic_data": True, "steps": args.steps, "warmup": args.warmup,
        "ddp_insecure": "ddp" in arms,
        "one_core_samples_per_s": {str(b): round(v, 2) for b, v in one_core.items()},
        "one_core_windows": [{str(b): round(v, 2) for b, v in w.items()} for w in one_core_windows],
        "one_core_glibc_default_malloc": {str(b): round(v, 2) for b, v in glibc_default.items()},
        "ideal_samples_per_s": {str(b): round(v, 2) for b, v in ideal.items()},
        "samples_per_s": by_arm(lambda a, b, r: round(r["samples_per_s"], 2)),
        "fraction_of_ideal": by_arm(lambda a, b, r: round(r["samples_per_s"] / ideal[b], 3)),
        "adjacent_ideal_samples_per_s": {a: {str(b): round(v, 2) for b, v in sorted(per.items())}
                                         for a, per in adjacent_ideal.items()},
        "fraction_of_adjacent_ideal": {a: {str(b): round(results[a][b]["samples_per_s"] / v, 3)
                                           for b, v in sorted(per.items()) if b in results[a]}
                                       for a, per in adjacent_ideal.items()},
        "fraction_of_ceiling": by_arm(lambda a, b, r: round(r["samples_per_s"] / results["ceiling"][b]["samples_per_s"], 3)
                                      if b in results.get("ceiling", {}) else None),
        "over_ddp": by_arm(lambda a, b, r: round(r["samples_per_s"] / results["ddp"][b]["samples_per_s"], 2)
                           if b in results.get("ddp", {}) else None),
        "time_split": {a: v for a, v in by_arm(lambda a, b, r: r.get("time_split")).items() if a != "ceiling"},
        "prediction_error": {a: v for a, v in by_arm(lambda a, b, r: r.get("prediction_error")).items()
                             if a in EDGETRAIN_ARMS},
        "ceiling_boards": {str(b): r["boards"] for b, r in results.get("ceiling", {}).items()},
        # the upload during backward against the upload after compute, and the download under the
        # compute against the download before it: same split, same run
        "streamed_over_unstreamed": over("streamed", "unstreamed"),
        "download_streamed_over_first": over("download_streamed", "download_first"),
    }
    for arm, per in results.items():
        for b, r in sorted(per.items()):
            near = adjacent_ideal.get(arm, {}).get(b)
            print(f"{arm:>13} batch {b:>4}: {r['samples_per_s']:6.1f} samples/s = "
                  f"{r['samples_per_s'] / ideal[b]:.2f} of the ideal"
                  + (f", {r['samples_per_s'] / near:.2f} of the adjacent one" if near else "")
                  + (" (INSECURE: gloo)" if arm == "ddp" else ""), flush=True)
    finish(__file__, out, args)


if __name__ == "__main__":
    main()
