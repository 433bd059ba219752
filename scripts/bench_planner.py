"""Benchmark: the hybrid planner — optimality and speed of planning, and plans measured end to end.

(a) Planning. Random fleets drawn from five board kinds (Pi 3, Pi 4, Jetson Nano, Xavier NX,
    a laptop) with Ethernet or Wi-Fi links, ResNet-18's measured block costs, global batch 64,
    objective time. Reported per size: planning seconds of the plan the coordinator would use
    (median of 3 fleets) and its worst optimality gap (predicted step time / reference − 1):
      4 boards   the default search is the exact DP here; reference: the same DP unbounded
                 (the tests check it equals brute force), so this gap is 0 by construction;
      16 boards  two kinds, one link each: the default budget runs the heuristic (about 1e5
                 DP transitions), the reference is the exact DP over board kinds with the budget
                 lifted (4-9 s);
      64 boards  planning time only: no exact reference is tractable (the only cheap bound,
                 every board computing with no communication, is far too loose on slow links).
(b) End to end. Two emulated fleets of four boards (0.5, 0.3, 0.2, 0.1 of a core):
    compute-bound (1000 Mbit/s links; global batch 512 for ResNet-18, 1024 for MobileNetV2) and
    bandwidth-bound (100, 50, 20, 10 Mbit/s, global batch 32), training ResNet-18 and MobileNetV2
    on SYNTHETIC CIFAR-shaped data in five ways. A fleet is compute-bound when a step computes
    far longer than it communicates; these batches make a step compute for about 18 s
    (ResNet-18) and 8 s (MobileNetV2) while each board moves its 45 MB or 9 MB of gradients and
    parameters each way (0.9-1.9 s and 0.2-0.5 s measured at 1000 Mbit/s, much of it the CPU a
    fraction of a core spends on every byte). At batch 32 a ResNet-18 step would compute for 1 s and communicate for as long, and
    every forward/backward pass carries a fixed cost that grows as 1/speed on the small boards:
        ideal          the sum of the boards' own training throughput: all four emulated boards
                       at once, as in the fleet, each training its proportional share of the
                       global batch over and over (in chunks of training.max_forward_batch, as
                       in the runs), one fixed batch shape, no communication
                       (measured in the same run; `ideal_nominal` is the boards' fractions of
                       one unthrottled core, which the boards do not reach: a quota'd process
                       runs slower per CPU second, and four of them share two cores' caches)
        hybrid         planner.enabled: the coordinator plans from the live fleet
        equal          data parallelism, equal shares
        proportional   data parallelism, shares from measured speed and link time
        pipeline       every board one stage (cuts chosen by the cost model), 1F1B
    (hybrid and pipeline runs keep the default `pipeline.replicate`: the coordinator holds a
    replica of each stage a host owns, so its gradients go up every step, and plans are costed so)
    samples/s over the steps after warm-up, and each as a fraction of ideal.
(c) Prediction. The hybrid runs' predicted step time (the plan in force) against the measured
    median step time.

The last line printed is one JSON object.

    python scripts/bench_planner.py [--steps 6] [--warmup 2] [--fleets compute,bandwidth] [--smoke] [--record]
                                    [--models resnet18,mobilenet_v2] [--modes hybrid,equal,...] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coordinator.planning.cost import predict
from coordinator.planning.inputs import (
    boards_from_fleet,
    measure_model_cost,
    one_core_speed,
    train_flops_per_sample,
    transfer_cpu_s_per_byte,
)
from coordinator.planning.planner import plan_optimal
from edgetrain.emulator.launch import plain_demo_job, run_on_emulated_boards
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm
from edgetrain.fleet_file import BoardSpec, LinkSpec
from edgetrain.plan import BoardCost, Plan, StagePlan
from edgetrain.split import SpeedEstimate, split_proportional

SPEEDS = (0.5, 0.3, 0.2, 0.1)
FLEETS = {"compute": (1000, 1000, 1000, 1000), "bandwidth": (100, 50, 20, 10)}
FLEET_BATCH = {("compute", "resnet18"): 512, ("compute", "mobilenet_v2"): 1024,
               ("bandwidth", "resnet18"): 32, ("bandwidth", "mobilenet_v2"): 32}
"""Global batch per fleet and model (see the module docstring)."""
MODES = ("hybrid", "equal", "proportional", "pipeline")
KINDS = (  # name, fraction of this machine's core, idle W, busy W, links (Mbit/s)
    ("pi3", 0.14, 1.9, 5.1, (100, 20)), ("pi4", 0.4, 2.7, 6.4, (1000, 40)), ("nano", 0.32, 1.3, 10.0, (1000, 100)),
    ("xavier", 1.0, 4.0, 15.0, (1000,)), ("laptop", 2.0, 8.0, 30.0, (1000, 200)))


def random_fleet(n: int, rng: random.Random, model, one_core, kinds=KINDS, one_link: bool = False) -> list[BoardCost]:
    specs = []
    for i in range(n):
        name, speed, idle, busy, links = rng.choice(kinds)
        specs.append(BoardSpec(name=f"{name}-{i}", speed=speed, idle_w=idle, busy_w=busy,
                               link=LinkSpec(mbit_per_s=links[0] if one_link else rng.choice(links))))
    return boards_from_fleet(specs, model, one_core)


def planning(model, one_core, fleets: int = 3, sizes: tuple[int, ...] = (4, 16, 64)) -> dict:
    """Planning time and optimality gap at 4, 16 and 64 boards (see the module docstring)."""
    out = {"optimality_gap": {}, "plan_seconds": {}, "reference": {}}
    setups = {4: ("exact DP = brute force (tests)", dict()),
              16: ("exact DP over board kinds (2 kinds, budget lifted)", dict(one_link=True)),
              64: ("none tractable (gap not measured)", dict())}
    for n, (reference, kw) in ((n, setups[n]) for n in sizes):
        gaps, seconds = [], []
        for seed in range(fleets):
            rng = random.Random(1000 * n + seed)
            kinds = rng.sample(KINDS, 2) if n == 16 else KINDS
            fleet = random_fleet(n, rng, model, one_core, kinds, **kw)
            started = time.perf_counter()
            plan = plan_optimal(fleet, model, 64)
            seconds.append(time.perf_counter() - started)
            if n == 4:
                best = plan_optimal(fleet, model, 64, exact_budget=10**9).prediction.step_s
            elif n == 16:
                best = plan_optimal(fleet, model, 64, exact_budget=10**9).prediction.step_s
            else:
                continue
            gaps.append(plan.prediction.step_s / best - 1)
        out["optimality_gap"][n] = round(max(gaps), 4) if gaps else None
        out["plan_seconds"][n] = round(statistics.median(seconds), 3)
        out["reference"][n] = reference
        gap = f"worst gap {max(gaps):.2%} vs {reference}" if gaps else f"optimality gap: {reference}"
        print(f"  {n:3d} boards: plan {statistics.median(seconds):.3f} s (median of {fleets}), {gap}", flush=True)
    return out


def best_pure_pipeline(boards: list[BoardCost], model, batch: int) -> Plan:
    """Every board one stage, in the given order; cuts and micro-batches from the cost model."""
    best = None
    for cuts in itertools.combinations(range(1, len(model.blocks)), len(boards) - 1):
        bounds = (0, *cuts, len(model.blocks))
        for m in (2, 4, 8, 16):
            plan = Plan(stages=tuple(StagePlan(bounds[i], bounds[i + 1], (b.name,)) for i, b in enumerate(boards)),
                        microbatches=m)
            pred = predict(plan, boards, model, batch)
            if best is None or pred.step_s < best[1].step_s:
                best = (plan, pred)
    return best[0]


def _board_standalone(fraction: float, model_name: str, batch: int, seconds: float) -> None:
    """(Child process) train `batch` samples at a time as an emulated board at `fraction` of a
    core, the way a client does, for `seconds` after warm-up; prints samples/s as JSON."""
    import torch

    from edge_client.profiler import set_threads, torch_threads_for
    from edgetrain.config import TrainingConfig
    from edgetrain.data import SyntheticCIFAR10, make_batch
    from edgetrain.emulator.throttle import limit_cpu
    from edgetrain.models import build_model
    from edgetrain.training import compute_shard

    set_threads(torch_threads_for(fraction))
    torch.manual_seed(0)
    dataset = SyntheticCIFAR10(train=True, size=2048, seed=0)
    model = build_model(model_name, seed=0)
    with limit_cpu(fraction, name=f"ideal-{fraction:g}") as limiter:
        began, step = 0.0, 0
        while step < 4 or time.perf_counter() - began < seconds:
            if step == 2:  # after two warm-up steps
                began = time.perf_counter()
            with limiter.working():
                x, y = make_batch(dataset, [(step * batch + i) % len(dataset) for i in range(batch)],
                                  augment=False, seed=0, step=step)
                compute_shard(model, x, y, TrainingConfig().max_forward_batch)
            step += 1
    print(json.dumps({"samples_per_s": (step - 2) * batch / (time.perf_counter() - began)}), flush=True)


def measured_ideal(model_name: str, batch: int, seconds: float = 30.0) -> list[float]:
    """Each board's standalone training throughput (samples/s), all boards running at once."""
    nominal = {f"b{i}": SpeedEstimate(0.0, s) for i, s in enumerate(SPEEDS)}
    shares = split_proportional(batch, nominal)
    children = [subprocess.Popen([sys.executable, __file__, "--standalone-board", f"{s}", model_name,
                                  str(max(1, shares[f"b{i}"])), str(seconds)], stdout=subprocess.PIPE, text=True)
                for i, s in enumerate(SPEEDS)]
    out = []
    try:
        for child in children:
            stdout, _ = child.communicate(timeout=1800)
            if child.returncode != 0:
                raise RuntimeError(f"standalone board measurement failed (exit {child.returncode})")
            out.append(json.loads(stdout.strip().splitlines()[-1])["samples_per_s"])
    finally:  # interrupted: SIGINT, so each leaves its CPU limit (a cgroup as root) the way Ctrl-C does
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return out


def run_mode(mode: str, fleet: str, model_name: str, links, batch: int, args, workdir: Path, model,
             one_core) -> dict:
    name = f"bench-plan-{fleet}-{model_name}-{mode}"  # one run directory each: metrics.jsonl is appended to
    job = plain_demo_job()  # the hybrid arm turns the planner on
    job.update(name=name, model=model_name)
    job["dataset"].update(train_size=128 if args.smoke else 2048, test_size=32 if args.smoke else 256, augment=False)
    job["training"].update(steps=args.steps, min_clients=len(SPEEDS), eval_every=0, global_batch=batch,
                           log_every=1, split="equal" if mode == "equal" else "proportional",
                           heartbeat_timeout_s=120.0)
    if mode == "hybrid":
        job["planner"] = {"enabled": True, "link_wait_s": 30}
        job["pipeline"] = {"stage_timeout_s": 600}
    if mode == "pipeline":
        specs = [BoardSpec(name=f"board{i}", speed=s, link=LinkSpec(mbit_per_s=m)) for i, (s, m) in
                 enumerate(zip(SPEEDS, links))]
        plan = best_pure_pipeline(boards_from_fleet(specs, model, one_core, cpu_s_per_byte=transfer_cpu_s_per_byte()),
                                  model, batch)
        job["pipeline"] = {**plan.to_pipeline_section(), "stage_timeout_s": 600}
    run_dir = run_on_emulated_boards(job, list(zip(SPEEDS, links)), workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= args.warmup]
    out = {"samples_per_s": sum(r["samples"] for r in steps) / sum(r["step_s"] for r in steps)}
    plans = [r for r in records if r["kind"] == "plan" and r["switched"]]
    if plans:
        last = plans[-1]
        measured = statistics.median(r["step_s"] for r in steps if r["step"] > last["step"]) if any(
            r["step"] > last["step"] for r in steps) else None
        out.update(plan=last["plan"], plan_kind=last["plan_kind"], left_out=last["left_out"],
                   predicted_step_s=last["predicted_step_s"], measured_step_s=measured,
                   replans=len(plans) - 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-compute", type=int, help="global batch on the compute-bound fleet "
                        "(default: 512 for ResNet-18, 1024 for MobileNetV2)")
    parser.add_argument("--batch-bandwidth", type=int, help="global batch on the bandwidth-bound fleet (default 32)")
    parser.add_argument("--fleets", default=",".join(FLEETS))
    parser.add_argument("--models", default="resnet18,mobilenet_v2")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--skip-e2e", action="store_true", help="only the planning part (a)")
    parser.add_argument("--standalone-board", nargs=4, metavar=("FRACTION", "MODEL", "BATCH", "SECONDS"),
                        help=argparse.SUPPRESS)
    add_bench_args(parser)
    args = parser.parse_args()
    if args.standalone_board:
        fraction, model_name, batch, seconds = args.standalone_board
        _board_standalone(float(fraction), model_name, int(batch), float(seconds))
        return
    ideal_s = 30.0
    if args.smoke:  # planning at 4 boards on one fleet; a two-step proportional run of a small CNN, compute fleet
        args.steps, args.warmup, args.batch_compute, args.fleets = 2, 1, 16, "compute"
        args.models, args.modes, ideal_s = "small_cnn", "proportional", 0.5
    stop_on_sigterm()
    print("# (a) planning: ResNet-18 block costs measured here; random fleets", flush=True)
    resnet = measure_model_cost("resnet18")
    result = planning(resnet, one_core_speed("resnet18"), *((1, (4,)) if args.smoke else ()))
    result["fleets"], result["prediction_error"] = {}, {}
    errors, batches = [], {}
    if not args.skip_e2e:
        print(f"# (b) end to end: boards {SPEEDS} of a core; data: SYNTHETIC", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_planner_") as tmp:
            for fleet in args.fleets.split(","):
                links = FLEETS[fleet]
                for model_name in args.models.split(","):
                    batch = getattr(args, f"batch_{fleet}") or FLEET_BATCH[fleet, model_name]
                    batches[f"{fleet}/{model_name}"] = batch
                    model, one_core = measure_model_cost(model_name), one_core_speed(model_name, (4, 32))
                    nominal = sum(SPEEDS) * one_core.samples_per_s * (
                        batch / (batch + one_core.overhead_s * one_core.samples_per_s))
                    boards = measured_ideal(model_name, batch, ideal_s)
                    ideal = sum(boards)
                    print(f"  {fleet}/{model_name}: ideal {ideal:.1f} samples/s = boards on their own "
                          f"{' + '.join(f'{b:.1f}' for b in boards)} (nominal {nominal:.1f}: "
                          f"{sum(SPEEDS):g} of one core)", flush=True)
                    row = {"ideal": round(ideal, 3), "ideal_boards": [round(b, 3) for b in boards],
                           "ideal_nominal": round(nominal, 3)}
                    key = f"{fleet}/{model_name}"
                    for mode in args.modes.split(","):
                        r = run_mode(mode, fleet, model_name, links, batch, args, Path(tmp), model, one_core)
                        row[mode] = round(r["samples_per_s"], 3)
                        extra = ""
                        if mode == "hybrid" and r.get("measured_step_s"):
                            err = (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
                            errors.append(abs(err))
                            result["prediction_error"][key] = round(err, 3)
                            row["hybrid_plan"] = {"kind": r["plan_kind"], "plan": r["plan"],
                                                  "left_out": r["left_out"]}
                            extra = (f" plan {r['plan_kind']}, predicted {r['predicted_step_s']:.2f} s/step, "
                                     f"measured {r['measured_step_s']:.2f}")
                        print(f"  {key:>24} {mode:>13}: {r['samples_per_s']:.2f} samples/s "
                              f"({r['samples_per_s'] / ideal:.0%} of ideal {ideal:.1f}){extra}", flush=True)
                    if "equal" in row and "hybrid" in row:
                        row["hybrid_over_equal"] = round(row["hybrid"] / row["equal"], 2)
                    if "hybrid" in row:
                        row["hybrid_over_ideal"] = round(row["hybrid"] / ideal, 3)
                    result["fleets"][key] = row
    if errors:
        result["prediction_error"]["mean_abs"] = round(sum(errors) / len(errors), 3)
    result.update(synthetic_data=True, boards=list(SPEEDS), links=FLEETS,
                  global_batch=batches,
                  steps=args.steps, warmup=args.warmup, train_flops_per_sample_resnet18=train_flops_per_sample(resnet))
    finish(__file__, result, args)


if __name__ == "__main__":
    main()
