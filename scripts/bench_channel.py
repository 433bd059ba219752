"""Benchmark: the research mechanisms of issue 20, measured side by side.

Codecs (this part runs today), once per uplink codec — none, int8, top-k 1% and PowerSGD rank 4,
every lossy one with error feedback on the boards, parameters down dense:

- accuracy and uplink bytes: MobileNetV2 on the harder SYNTHETIC CIFAR-shaped data
  (`synthetic-hard`, 5000 training and 1000 test samples), global batch 64 split over four
  workers in the emulated boards' proportions (0.5 : 0.3 : 0.2 : 0.1), the same seed, batches and
  steps (`--steps`), computed in this process with the system's own pieces: each worker's
  gradients through its own codec and error feedback (`edgetrain.updates.UpdateFormat`), the
  sample-weighted mean, the job's SGD (with top-k, the boards' momentum correction and the
  coordinator's plain SGD, as the system does). The same arithmetic as a fleet run, at one core's speed,
  so all four arms fit in one sitting; test accuracy after the last step.
- samples/s: the same job on four emulated boards (those fractions of a core, unshaped links)
  for `--fleet-steps` steps per codec, median over the steps after warm-up: what encoding costs
  the boards.

Channel groups (`fleets`), on two fleets fixed in edgetrain/presets/: `lab-capped` (the lab
boards with their real models' memory as a cgroup cap: Jetson Nano 4 GB, Pi 4 2 GB, Pi 3 1 GB)
and `lab-steady` (the same boards, no caps; neither has scripted link changes), each with the
preset's job (MobileNetV2, global batch 64, SYNTHETIC data), `--fleet-steps` steps per arm:

- `with_channel` / `without_channel`: the planner's plan for the fleet file (as `edgetrain plan`
  makes it, from this machine's measured model costs) with channel groups allowed / not allowed,
  each run as the job's fixed plan, one after the other in one run. (The live planner plans
  from the boards' join-time profiles, which differ from run to run, so fixed plans are
  compared: docs/benchmarks.md#comparing-arms.) When both
  plans are the same, the two arms measure the run-to-run spread;
- `channel_forced`: the plan without channel groups, each of its groups of several boards turned
  into a channel group: what a channel group costs here in practice, beside the cost model's
  prediction.

Each is an `edgetrain experiment run` arm (network namespaces and tc links as root, else loopback
with application-level shaping); samples/s is the median over the steps after `--warmup`.

    python scripts/bench_channel.py [--steps 400] [--fleet-steps 40] [--warmup 10] [--codecs none,int8,topk,powersgd]
                                    [--parts fleets,codecs] [--smoke] [--record]

Last line: one JSON object, `fleets` -> capped / lab -> {with_channel_samples_per_s,
without_channel_samples_per_s, plan_with_channel, plan_without_channel,
channel_forced_samples_per_s, plan_channel_forced, predicted_*}, `channel_speedup_capped`
(with over without on the capped fleet: 1.0 when both are the same plan, whose measured ratio is
then `same_plan_spread_capped`); `codecs` -> name -> {samples_per_s, accuracy,
uplink_bytes_per_sample}, plus `powersgd_accuracy_minus_none` and `powersgd_uplink_reduction`
(none's uplink bytes over PowerSGD's).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from edgetrain.catalog import SYNTHETIC_HARD_TEST_SIZE, SYNTHETIC_HARD_TRAIN_SIZE
from edgetrain.config import load_yaml
from edgetrain.emulator.launch import plain_demo_job, run_on_emulated_boards
from edgetrain.experiment.bench_output import add_bench_args, finish, run_child, stop_on_sigterm

SPEEDS = (0.5, 0.3, 0.2, 0.1)
"""Fractions of a core of the emulated boards (and the workers' shares of each batch)."""
CODECS = {"none": "none", "int8": "int8", "topk": "topk:0.01", "powersgd": "powersgd:4"}
BATCH = 64


def _job(name: str, codec: str, steps: int, seed: int, smoke: bool = False) -> dict:
    job = plain_demo_job()
    job.update(name=f"bench-codec-{name}", model="small_cnn" if smoke else "mobilenet_v2", seed=seed)
    job["dataset"] = {"name": "synthetic-hard", "train_size": 256 if smoke else SYNTHETIC_HARD_TRAIN_SIZE,
                      "test_size": 64 if smoke else SYNTHETIC_HARD_TEST_SIZE, "augment": True}
    job["training"].update(steps=steps, min_clients=len(SPEEDS), eval_every=0, global_batch=BATCH, log_every=25,
                           split="proportional", heartbeat_timeout_s=30.0, checkpoint_every_s=0)
    job["compression"] = {"uplink": codec, "downlink": "none"}
    return job


def train_in_process(codec: str, steps: int, seed: int, smoke: bool = False) -> dict:
    """Data-parallel SGD over four workers whose updates go through `codec` with error feedback;
    test accuracy after `steps` and uplink bytes per sample."""
    import torch

    from edgetrain.compression import ErrorFeedback
    from edgetrain.config import job_from_dict
    from edgetrain.data import load_dataset, make_batch
    from edgetrain.models import build_model
    from edgetrain.sampling import batch_indices
    from edgetrain.training import (
        BUFFER_PREFIX,
        GRAD_PREFIX,
        compute_shard,
        evaluate_dataset,
        make_optimizer,
        set_learning_rate,
        shard_tensor_names,
    )
    from edgetrain.updates import UpdateFormat

    torch.set_num_threads(1)
    job = job_from_dict(_job("in-process", codec, steps, seed, smoke))
    model = build_model(job.model, seed=job.seed)
    worker = build_model(job.model, seed=job.seed)
    # momentum correction (top-k): the boards accumulate momentum, the coordinator's SGD has none
    board_momentum = job.optimizer.momentum if job.compression.boards_keep_momentum else 0.0
    optimizer = make_optimizer(model, replace(job.optimizer, momentum=0.0, nesterov=False)
                               if board_momentum else job.optimizer)
    train, test = load_dataset(job.dataset, train=True), load_dataset(job.dataset, train=False)
    formats = [UpdateFormat(shard_tensor_names(worker), codec) for _ in SPEEDS]
    feedbacks = [ErrorFeedback() for _ in SPEEDS]
    velocities: list[dict[str, torch.Tensor]] = [{} for _ in SPEEDS]
    shares = [round(BATCH * s / sum(SPEEDS)) for s in SPEEDS]
    shares[0] += BATCH - sum(shares)
    uplink = 0
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for step in range(steps):
        indices = batch_indices(step, BATCH, len(train), job.seed)
        x, y = make_batch(train, indices, augment=job.dataset.augment, seed=job.seed, step=step)
        total: dict[str, torch.Tensor] = {}
        start = 0
        for w, n in enumerate(shares):
            worker.load_state_dict(model.state_dict())
            tensors = compute_shard(worker, x[start:start + n], y[start:start + n]).tensors
            start += n
            if board_momentum:  # as edge_client/shard.py: u <- m u + g is sent; a sent coordinate restarts
                for name in [k for k in tensors if k.startswith(GRAD_PREFIX)]:
                    u = velocities[w].get(name)
                    velocities[w][name] = u = tensors[name].clone() if u is None else u.mul_(board_momentum).add_(
                        tensors[name])
                    tensors[name] = u.clone()
            wire, commit = formats[w].encode(tensors, feedbacks[w])
            commit()
            for name, u in velocities[w].items():
                if name + ":idx" in wire:
                    u.view(-1)[wire[name + ":idx"].long()] = 0.0
            uplink += sum(t.numel() * t.element_size() for t in wire.values())
            for name, tensor in formats[w].decode(wire).items():
                total[name] = total.get(name, 0) + tensor * (n / BATCH)
        set_learning_rate(optimizer, step, steps, job.optimizer)
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, tensor in total.items():
                if name.startswith(GRAD_PREFIX):
                    params[name[len(GRAD_PREFIX):]].grad = tensor.clone()
                elif name.startswith(BUFFER_PREFIX):
                    buffers[name[len(BUFFER_PREFIX):]].copy_(tensor)
        optimizer.step()
    _, accuracy, _ = evaluate_dataset(model, test)
    return {"accuracy": round(accuracy, 4), "uplink_bytes_per_sample": round(uplink / (steps * BATCH), 1)}


def fleet_speed(name: str, args: argparse.Namespace, workdir: Path) -> float:
    """Samples/s of the job on the emulated boards with this uplink codec (after warm-up)."""
    job = _job(name, CODECS[name], args.fleet_steps, args.seed, args.smoke)
    run_dir = run_on_emulated_boards(job, tuple((s, 1000.0) for s in SPEEDS), workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["kind"] == "train" and r["step"] >= args.warmup]
    return round(sum(r["samples"] for r in steady) / sum(r["step_s"] for r in steady), 2)


PRESETS = Path(__file__).resolve().parent.parent / "edgetrain" / "presets"
FLEETS = {"capped": PRESETS / "lab-capped.yaml", "lab": PRESETS / "lab-steady.yaml"}


def static_plans(preset: Path) -> dict:
    """The planner's plans from the fleet file (this machine's measured model costs, as
    `edgetrain plan`): channel groups allowed, not allowed, and the latter's groups as channel groups."""
    from coordinator.planning.cost import predict
    from coordinator.planning.inputs import boards_from_fleet, machine_costs
    from coordinator.planning.planner import plan_optimal
    from edgetrain.fleet_file import load_fleet
    from edgetrain.plan import Plan, StagePlan

    fleet = load_fleet(preset)
    job = load_yaml(preset)["job"]
    costs = machine_costs(job["model"])
    boards = boards_from_fleet(list(fleet.boards), costs.model, costs.one_core, cpu_s_per_byte=costs.cpu_s_per_byte)
    batch = job["training"]["global_batch"]
    with_ch = plan_optimal(boards, costs.model, batch, channel_groups=True)
    without = plan_optimal(boards, costs.model, batch, channel_groups=False)
    forced = Plan(stages=tuple(StagePlan(s.begin, s.end, s.boards, "channels" if len(s.boards) > 1 else "rows")
                               for s in without.stages), microbatches=without.microbatches,
                  schedule=without.schedule, dp_boards=without.dp_boards, dp_share=without.dp_share)
    forced = forced if any(s.channels for s in forced.stages) else None
    return {"with": with_ch, "without": without, "forced": forced,
            "predicted_forced": predict(forced, boards, costs.model, batch) if forced else None}


def steady_rate(run_dir: Path, warmup: int) -> float | None:
    """Median samples/s of the steps from `warmup` on (None without such steps)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    rates = sorted(r["samples"] / r["step_s"] for r in records
                   if r.get("kind") == "train" and r["step"] >= warmup and r.get("step_s"))
    return round(rates[len(rates) // 2], 2) if rates else None


def fleet_arms(key: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One fleet's arms as one experiment run: planner with and without channel groups, and the
    fleet file's plan with its groups as channel groups."""
    preset = FLEETS[key]
    plans = static_plans(preset)
    job = load_yaml(preset)["job"]
    job["training"].update(steps=args.fleet_steps, eval_every=0, checkpoint_every_s=0)
    def fixed(plan) -> dict:
        return {"planner.enabled": False, **{f"pipeline.{k}": v for k, v in plan.to_pipeline_section().items()}}

    arms = [{"name": "with-channel", "set": fixed(plans["with"])},
            {"name": "without-channel", "set": fixed(plans["without"])}]
    if plans["forced"] is not None:
        arms.append({"name": "channel-forced", "set": fixed(plans["forced"])})
    experiment = {"name": f"bench-channel-{key}", "job": job, "fleet": str(preset), "repeats": 1,
                  "stop": {"steps": args.fleet_steps}, "arms": arms}
    exp_file = workdir / f"bench-channel-{key}.yaml"
    exp_file.write_text(yaml.safe_dump(experiment))
    out = workdir / f"results-{key}"
    code = run_child([sys.executable, "-m", "edgetrain", "experiment", "run", str(exp_file), "--out", str(out)])
    if code != 0:
        print(f"# {key}: the experiment ended with exit code {code}; arms without steps are reported as null",
              flush=True)

    result = {
        "with_channel_samples_per_s": steady_rate(out / "with-channel-r0", args.warmup),
        "without_channel_samples_per_s": steady_rate(out / "without-channel-r0", args.warmup),
        "plan_with_channel": plans["with"].describe(),
        "plan_without_channel": plans["without"].describe(),
        "same_plan": plans["with"] == plans["without"],
        "predicted_with_channel_samples_per_s": round(plans["with"].prediction.samples_per_s, 2),
        "predicted_without_channel_samples_per_s": round(plans["without"].prediction.samples_per_s, 2),
    }
    if plans["forced"] is not None:
        result.update(channel_forced_samples_per_s=steady_rate(out / "channel-forced-r0", args.warmup),
                      plan_channel_forced=plans["forced"].describe(),
                      predicted_channel_forced_samples_per_s=round(plans["predicted_forced"].samples_per_s, 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps of the accuracy comparison")
    parser.add_argument("--fleet-steps", type=int, default=40, help="steps on the emulated boards per codec")
    parser.add_argument("--warmup", type=int, default=10, help="fleet steps left out of the throughput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated subset of " + ",".join(CODECS))
    parser.add_argument("--parts", help="fleets, codecs or both (comma-separated; default both, with --smoke codecs)")
    add_bench_args(parser)
    args = parser.parse_args()
    if args.smoke:  # two steps of PowerSGD on a small CNN in process and on the boards; fleets only when named
        args.steps, args.fleet_steps, args.warmup, args.codecs = 2, 2, 0, "powersgd"
        args.parts = args.parts or "codecs"
    args.parts = args.parts or "fleets,codecs"
    stop_on_sigterm()
    parts = set(args.parts.split(","))
    if not parts <= {"fleets", "codecs"}:
        parser.error(f"--parts: choose from fleets, codecs, got {args.parts!r}")
    out: dict = {"synthetic_data": True, "fleet_steps": args.fleet_steps, "warmup": args.warmup}
    if "fleets" in parts:
        fleets = {}
        with tempfile.TemporaryDirectory(prefix="bench_channel_fleets_") as tmp:
            for key in FLEETS:
                fleets[key] = fleet_arms(key, args, Path(tmp))
                print(f"{key}: {json.dumps(fleets[key])}", flush=True)
        out["fleets"] = fleets
        capped = fleets["capped"]
        if capped["same_plan"]:  # the two arms ran one plan: their ratio is the run-to-run spread
            out["channel_speedup_capped"] = 1.0
        if capped["with_channel_samples_per_s"] and capped["without_channel_samples_per_s"]:
            ratio = round(capped["with_channel_samples_per_s"] / capped["without_channel_samples_per_s"], 3)
            out["same_plan_spread_capped" if capped["same_plan"] else "channel_speedup_capped"] = ratio
    if "codecs" not in parts:
        finish(__file__, out, args)
        return
    names = args.codecs.split(",")
    unknown = [n for n in names if n not in CODECS]
    if unknown:
        parser.error(f"unknown codec(s) {unknown}; choose from {list(CODECS)}")
    print(f"# {'small_cnn' if args.smoke else 'mobilenet_v2'} on synthetic-hard (SYNTHETIC data), batch {BATCH} over workers {SPEEDS}, "
          f"{args.steps} steps in process, {args.fleet_steps} on the emulated boards, seed {args.seed}", flush=True)
    codecs: dict[str, dict] = {n: {} for n in names}
    # samples/s first, on a quiet machine; then the accuracy arms, two at a time (one core each)
    with tempfile.TemporaryDirectory(prefix="bench_channel_") as tmp:
        for n in names:
            codecs[n]["samples_per_s"] = fleet_speed(n, args, Path(tmp))
            print(f"{n}: {codecs[n]['samples_per_s']} samples/s on the emulated boards", flush=True)
    pool = multiprocessing.get_context("spawn").Pool(2)
    try:
        futures = {n: pool.apply_async(train_in_process, (CODECS[n], args.steps, args.seed, args.smoke))
                   for n in names}
        for n, f in futures.items():
            codecs[n].update(f.get())
            print(f"{n} ({CODECS[n]}): {codecs[n]}", flush=True)
    finally:  # interrupted or not: no worker outlives the benchmark
        pool.terminate()
        pool.join()
    out.update(steps=args.steps, seed=args.seed, codecs=codecs)
    if "none" in codecs and "powersgd" in codecs:
        out["powersgd_accuracy_minus_none"] = round(codecs["powersgd"]["accuracy"] - codecs["none"]["accuracy"], 4)
        out["powersgd_uplink_reduction"] = round(codecs["none"]["uplink_bytes_per_sample"]
                                                 / codecs["powersgd"]["uplink_bytes_per_sample"], 2)
    finish(__file__, out, args)


if __name__ == "__main__":
    main()
