"""The processes of a baseline arm: DDP ranks on the emulated boards, or the lone trainer of the
`single` and `centralized` baselines (baselines.py starts them and merges what they write).

Run as ``python -m edgetrain.experiment.ddp_worker --spec RUN/ranks/spec.json``: a launcher that
imports torch once and forks one process per rank (a torch import costs seconds of CPU, which a
small gateway would otherwise pay once per board). Each rank enters its network namespace, if
the arm has them, binds gloo to its interface (loopback otherwise), holds itself to its machine's
speed (edgetrain.emulator.throttle.limit_cpu, one torch thread) and trains
exactly what the coordinator would: the step's global batch from edgetrain.sampling, the same
augmentation, model initialisation, optimizer and LR schedule (edgetrain.training), a shard put
through the model in chunks of at most `training.max_forward_batch` samples. With several ranks
the step is PyTorch's DistributedDataParallel over gloo with its defaults: the framework's equal
split of the global batch (the remainder to the first ranks), gradients averaged over the ranks
by an all-reduce overlapped with the backward pass, BatchNorm statistics per shard (no
SyncBatchNorm) and rank 0's buffers broadcast at each forward. gloo has no authentication: the
parent starts ranks only on loopback or in network namespaces it made.

Each rank appends JSON lines to ``RUN/ranks/rank<R>.jsonl`` (`setup`, `info`, `step`, and on rank 0
`eval` and `done`); the parent merges them into the run directory's metrics.jsonl. Rank 0 decides
when to stop, as the coordinator does (the last step, the first evaluation reaching
`training.target_accuracy`, or `training.time_limit_s` of training), and tells the other ranks
after every step with a one-integer broadcast. A rank that fails prints one line; the launcher
then kills the other ranks, repeats that line on its stderr and exits 1.

A step's `compute_s` runs from its start to the moment DDP's communication hook received the last
gradient bucket (the end of the backward computation; the all-reduce of earlier buckets overlaps
it, as in DDP), plus the optimizer step; the rest of the step is all-reduce and waiting.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import sys
import time
from contextlib import nullcontext, suppress
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from edgetrain.allocator import keep_freed_memory
from edgetrain.config import job_from_dict
from edgetrain.data import load_dataset, make_batch
from edgetrain.emulator.throttle import limit_cpu, remove_stale_cgroups
from edgetrain.models import build_model
from edgetrain.sampling import batch_indices, epoch_of
from edgetrain.training import (
    chunk_bounds,
    compute_shard,
    evaluate_dataset,
    make_optimizer,
    set_learning_rate,
)

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def rank_slice(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[begin, end) of `rank`'s rows of a global batch: equal parts, the remainder to the first
    ranks (what a DistributedSampler-style equal split gives each rank)."""
    base, extra = divmod(global_batch, world)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (rank < extra)


class RankLog:
    """This rank's JSON-lines file, one flushed line per record."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({"time": round(time.time(), 4), **record}) + "\n")


class _ReadyClock:
    """When the last gradient bucket of a step became ready (the end of the backward computation):
    `hook` is a DDP communication hook that notes it and then all-reduces the bucket as DDP's
    default hook does."""

    def __init__(self) -> None:
        self.last_ready = 0.0

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.last_ready = time.perf_counter()
        return allreduce_hook(state, bucket)


def train(spec: dict, rank: int) -> None:
    """Set up, train to the stop rule, and (rank 0) save the final model."""
    job = job_from_dict(spec["job"], source="baseline job")
    cfg = job.training
    world = len(spec["ranks"])
    me = spec["ranks"][rank]
    log = RankLog(Path(spec["run_dir"]) / "ranks" / f"rank{rank}.jsonl")
    torch.set_num_threads(1)
    with limit_cpu(me["speed"], name=f"baseline-{me['name']}") as limiter:
        started = time.perf_counter()
        train_set = load_dataset(job.dataset, train=True)
        test_set = load_dataset(job.dataset, train=False) if rank == 0 else None
        log.write({"kind": "setup", "what": "data_load", "seconds": round(time.perf_counter() - started, 4)})
        started = time.perf_counter()
        model = build_model(job.model, num_classes=len(train_set.classes), seed=job.seed)
        optimizer = make_optimizer(model, job.optimizer)  # its first use imports torch._dynamo: seconds
        log.write({"kind": "setup", "what": "model", "seconds": round(time.perf_counter() - started, 4)})
        net: nn.Module = model
        clock = _ReadyClock()
        if world > 1:
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            started = time.perf_counter()
            store = dist.FileStore(spec["store"], world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=spec["collective_timeout_s"]))
            net = DistributedDataParallel(model)
            net.register_comm_hook(None, clock.hook)
            log.write({"kind": "setup", "what": "process_group",
                       "seconds": round(time.perf_counter() - started, 4)})
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        log.write({"kind": "info", "gradient_bytes": gradient_bytes, "throttle": limiter.mode})
        begin, end = rank_slice(cfg.global_batch, world, rank)
        time_limit_s = float(getattr(cfg, "time_limit_s", 0.0) or 0.0)
        train_seconds, evaluated_at, stop_reason = 0.0, -1, "steps"
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            indices = batch_indices(step, cfg.global_batch, len(train_set), job.seed)[begin:end]
            lr = set_learning_rate(optimizer, step, cfg.steps, job.optimizer)
            with limiter.working():
                x, y = make_batch(train_set, indices, augment=job.dataset.augment, seed=job.seed, step=step)
                if world > 1:
                    loss, correct = _ddp_shard(net, x, y, cfg.max_forward_batch)
                    compute_s = clock.last_ready - t0
                else:
                    result = compute_shard(model, x, y, cfg.max_forward_batch)
                    loss, correct = result.loss, result.correct
                    compute_s = time.perf_counter() - t0
                t_opt = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - t0
            compute_s += time.perf_counter() - t_opt
            train_seconds += step_s
            log.write({"kind": "step", "step": step, "samples": len(indices), "loss": loss, "correct": correct,
                       "lr": lr, "step_s": round(step_s, 5), "compute_s": round(min(compute_s, step_s), 5),
                       "epoch": round(epoch_of(step, cfg.global_batch, len(train_set)), 4)})
            stop = 0
            if rank == 0:
                last = step == cfg.steps - 1
                timed_out = bool(time_limit_s) and train_seconds >= time_limit_s
                if last or timed_out or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                    t_eval = time.perf_counter()
                    test_loss, accuracy, seen = evaluate_dataset(model, test_set)
                    evaluated_at = step
                    log.write({"kind": "eval", "step": step, "test_loss": test_loss, "test_accuracy": accuracy,
                               "test_samples": seen, "eval_s": round(time.perf_counter() - t_eval, 3)})
                    if cfg.target_accuracy and not last and accuracy >= cfg.target_accuracy:
                        stop, stop_reason = 1, "target_accuracy"
                if timed_out and not stop:
                    stop, stop_reason = 1, "time_limit"
                stop = stop or int(last)
            if world > 1:
                flag = torch.tensor([stop], dtype=torch.int64)
                torch.distributed.broadcast(flag, src=0)
                stop = int(flag.item())
            if stop:
                break
    if rank == 0:
        torch.save(model.state_dict(), Path(spec["run_dir"]) / "model.pt")
        log.write({"kind": "done", "stop_reason": stop_reason, "steps": step + 1, "evaluated_at": evaluated_at,
                   "train_seconds": round(train_seconds, 4)})
    if world > 1:
        torch.distributed.destroy_process_group()


def _ddp_shard(net: nn.Module, x: torch.Tensor, y: torch.Tensor, max_batch: int) -> tuple[float, int]:
    """Forward + backward of the shard's mean loss through DDP, in chunks of at most `max_batch`
    (gradients accumulated under no_sync; the last chunk's backward all-reduces). Returns the
    shard's mean loss and correct count."""
    net.train()
    n = int(y.numel())
    bounds = chunk_bounds(0, n, max_batch)
    loss_sum, correct = 0.0, 0
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        final = i == len(bounds) - 2
        with net.no_sync() if not final else nullcontext():
            logits = net(x[lo:hi])
            loss = nn.functional.cross_entropy(logits, y[lo:hi], reduction="sum") / n
            loss.backward()
        loss_sum += float(loss.detach())
        correct += int((logits.detach().argmax(dim=1) == y[lo:hi]).sum())
    return loss_sum, correct


def _enter_namespace(namespace: str) -> None:
    """Move this (single-threaded, just forked) process into network namespace `namespace`, as
    `ip netns exec` does (Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


def _rank_process(spec: dict, rank: int) -> int:
    """The forked rank: dies with the launcher, logs to ranks/rank<R>.log, joins its network
    namespace (if any), trains. Returns its exit code (one line on stderr when it failed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    me = spec["ranks"][rank]
    log = os.open(Path(spec["run_dir"]) / "ranks" / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if me.get("namespace"):
            _enter_namespace(me["namespace"])
        os.environ["GLOO_SOCKET_IFNAME"] = me.get("ifname") or "lo"  # gloo binds only there
        train(spec, rank)
    except BaseException as e:  # one line for the launcher, which ends the arm with it
        print(f"rank {rank} ({me['name']}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _reap_exited(running: dict[int, int]) -> dict[int, int]:
    """Reap the ranks that have already exited (without waiting): {rank: exit code}."""
    exited = {}
    for pid in list(running):
        with suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exited[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    return exited


def _first_cause(failed: dict[int, int]) -> tuple[int, int]:
    """The rank to blame among those that ended together: one killed by a signal caused the
    others' connection errors (the order they are reaped in says nothing), else the lowest failed rank."""
    killed = sorted(r for r, code in failed.items() if code < 0)
    if killed:
        return killed[0], failed[killed[0]]
    errored = sorted(r for r, code in failed.items() if code != 0)
    return errored[0], failed[errored[0]]


def launch(spec: dict) -> int:
    """Import torch once, fork one process per rank, and wait for them: the first rank that
    fails (or a rank still running JOIN_TIMEOUT_S after rank 0 finished) ends them all and the
    launcher with one line on stderr. SIGTERM ends the ranks too, and so does the death of the
    process that started the launcher (it gets SIGTERM then)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    torch.set_num_threads(1)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo once, here
    if len(spec["ranks"]) > 1:
        for module in ("torch.distributed", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
                       "torch.nn.parallel"):
            importlib.import_module(module)
    run_dir = Path(spec["run_dir"])
    pids: dict[int, int] = {}
    for rank in range(len(spec["ranks"])):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank_process(spec, rank)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # everything is written: skip tearing torch down
        pids[pid] = rank
    (run_dir / "ranks.json").write_text(json.dumps(
        [{"rank": r, "name": spec["ranks"][r]["name"], "pid": p} for p, r in sorted(pids.items(), key=lambda i: i[1])]))

    def stop_ranks(*_: object) -> None:
        """SIGKILL every rank still running and reap it, so none outlives the launcher."""
        for pid in running:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in running:
            with suppress(ChildProcessError):
                os.waitpid(pid, 0)
        remove_stale_cgroups()  # a killed rank cannot remove its own cgroup

    running = dict(pids)
    signal.signal(signal.SIGTERM, lambda *_: (stop_ranks(), os._exit(1)))
    rank0_done_at = None
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if rank0_done_at is not None and time.monotonic() - rank0_done_at > spec["join_timeout_s"]:
                stop_ranks()
                late = ", ".join(spec["ranks"][r]["name"] for r in sorted(running.values()))
                print(f"ranks {late} did not exit {spec['join_timeout_s']:g} s after rank 0", file=sys.stderr)
                return 1
            time.sleep(0.05)
            continue
        rank = running.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed = {rank: code, **_reap_exited(running)}
            stop_ranks()
            rank, code = _first_cause(failed)
            why = (f"killed by signal {-code}" if code < 0 else
                   _last_line(run_dir / "ranks" / f"rank{rank}.log") or f"exit code {code}")
            prefix = f"rank {rank} ({spec['ranks'][rank]['name']})"
            print(why if why.startswith(prefix) else f"{prefix}: {why}", file=sys.stderr, flush=True)
            return 1
        if rank == 0:
            rank0_done_at = time.monotonic()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the arm's spec.json (written by baselines.py)")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the EdgeTrain boards do: the arms differ in how they train, not in malloc
    try:
        spec = json.loads(Path(args.spec).read_text())
        return launch(spec)
    except Exception as e:
        print(f"launcher: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written: skip tearing torch down (seconds on a busy machine)
