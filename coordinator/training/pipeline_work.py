"""A plan turned into one step's pipeline work, and a pipeline's results merged back.

The plan (edgetrain.plan.Plan: the job's pipeline section, a plan file, or the planner's) names,
for each stage, its consecutive blocks and the boards hosting it. Every step the pipeline takes its samples (the global
batch, less the DP shards' share), cuts them into micro-batches, and splits every micro-batch
among a stage's hosts by rows in proportion to the hosts' measured speed (a channel group's
members each take every row and a share of the channels, edgetrain.channels; its leader alone
reports the rows, loss and accuracy, the others zero samples). A stage with a single
host and no DP shards beside the pipeline is *owned* by its host (`owns_state`): it keeps the
stage's parameters and optimizer state and uploads nothing (coordinator.training.stage_owners). Every
other host uploads the gradients of its stage's parameters — partial sums whose total over hosts
and micro-batches is the gradient of the mean loss over the pipeline's samples — so
`merge_pipelines` adds them up and the pipeline enters the step's aggregation as one
contribution, next to DP shards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.training.steps import Contribution
from edgetrain.config import PipelineConfig
from edgetrain.pipeline import (
    channel_shares,
    split_microbatches,
    split_rows,
)
from edgetrain.plan import Plan, StagePlan
from edgetrain.split import SHARE_CHANGE_GAIN, SpeedEstimate, split_sticky
from edgetrain.training import GRAD_PREFIX
from edgetrain.work import Assignment, StageHost, StageWork


@dataclass(frozen=True)
class Host:
    """A plan board as the registry knows it."""

    device_id: str
    address: str
    speed: SpeedEstimate


def missing_boards(plan: Plan, hosts: Mapping[str, Host]) -> list[str]:
    """Plan boards (by name) that are not ready, or serve no stage endpoint."""
    names = [b for s in plan.stages for b in s.boards] + list(plan.dp_boards)
    return [n for n in names if n not in hosts or (n not in plan.dp_boards and not hosts[n].address)]


def owns_state(plan: Plan, stage: StagePlan, stage_state: str) -> bool:
    """Whether a stage's host keeps its parameters and optimizer state (`stage_state: hosts`, one
    host, and no DP shards: theirs are the whole model's gradients, combined centrally)."""
    return stage_state == "hosts" and len(stage.boards) == 1 and not plan.dp_boards


def check_covers(plan: Plan, block_names: Sequence[str]) -> None:
    """ValueError unless the plan's stages cover the model's blocks exactly."""
    if plan.stages and plan.stages[-1].end != len(block_names):
        raise ValueError(f"the stages' blocks sum to {plan.stages[-1].end}, but the model has {len(block_names)} "
                         f"blocks ({', '.join(block_names)})")


def assign(plan: Plan, settings: PipelineConfig, *, step: int, attempt: int, indices: Sequence[int],
           block_names: Sequence[str], hosts: Mapping[str, Host], augment: bool, data_seed: int, lr: float = 0.0,
           commit: tuple[int, int] = (-1, 0),
           previous_shares: Mapping[str, int] | None = None,
           share_gain: float = SHARE_CHANGE_GAIN) -> dict[str, Assignment]:
    """Every plan board's work for one attempt of `step` (pipeline 0, plus DP shards); `settings`
    says how stages run (timeout, where their state lives); `lr` and `commit` (the last committed
    step and attempt) are for hosts that own their stage; the DP shards keep `previous_shares`
    (device id -> samples) while the best split predicts less than `share_gain` over them."""
    check_covers(plan, block_names)
    total = len(indices)
    dp_samples = min(round(plan.dp_share * total), total - 1) if plan.dp_boards else 0
    pipe = list(indices[: total - dp_samples])
    sizes = split_microbatches(len(pipe), min(plan.microbatches, len(pipe)))
    starts = [sum(sizes[:m]) for m in range(len(sizes))]
    ranges = [(s.begin, s.end) for s in plan.stages]
    groups: list[tuple[StageHost, ...]] = []
    for stage in plan.stages:
        weights = [hosts[b].speed.samples_per_s for b in stage.boards]
        if stage.channels:  # every member computes every row, a share of each split layer's channels
            every = tuple((0, size) for size in sizes)
            groups.append(tuple(StageHost(hosts[b].device_id, hosts[b].address, every, name=b, channels=share)
                                for b, share in zip(stage.boards, channel_shares(weights))))
            continue
        rows = [split_rows(size, weights) for size in sizes]
        groups.append(tuple(StageHost(hosts[b].device_id, hosts[b].address, tuple(r[j] for r in rows), name=b)
                            for j, b in enumerate(stage.boards)))
    out: dict[str, Assignment] = {}
    for i, (begin, end) in enumerate(ranges):
        for host in groups[i]:
            stage = StageWork(
                pipeline=0, stage=i, stages=len(ranges), first_block=begin, end_block=end,
                schedule=plan.schedule,
                indices=tuple(pipe), microbatch_sizes=tuple(sizes), hosts=groups[i],
                prev_hosts=groups[i - 1] if i else (), next_hosts=groups[i + 1] if i + 1 < len(groups) else (),
                pipeline_samples=len(pipe), timeout_s=settings.stage_timeout_s,
                owned=owns_state(plan, plan.stages[i], settings.stage_state), lr=lr, commit_step=commit[0],
                commit_attempt=commit[1])
            # the samples it reports: a channel group's leader reports the group's rows, once
            mine = tuple(pipe[starts[m] + r] for m, (b, e) in enumerate(host.rows) for r in range(b, e)
                         ) if host.sends else ()
            out[host.device_id] = Assignment(step, attempt, step, mine, augment, data_seed, stage=stage)
    if dp_samples:
        shares = split_sticky(dp_samples, {hosts[b].device_id: hosts[b].speed for b in plan.dp_boards},
                              previous_shares, min_gain=share_gain)
        at = total - dp_samples
        for device_id, count in shares.items():
            if count:
                out[device_id] = Assignment(step, attempt, step, tuple(indices[at: at + count]), augment, data_seed)
                at += count
    return out


def merge_pipelines(contributions: Sequence[Contribution]) -> list[Contribution]:
    """One contribution per pipeline (its hosts' stage gradients summed), DP shards unchanged."""
    out = [c for c in contributions if c.stage is None]
    by_pipeline: dict[int, list[Contribution]] = defaultdict(list)
    for c in contributions:
        if c.stage is not None:
            by_pipeline[c.stage.pipeline].append(c)
    for pipeline, parts in sorted(by_pipeline.items()):
        tensors: dict[str, torch.Tensor] = {}
        buffer_rows: dict[str, int] = defaultdict(int)
        for c in parts:
            for name in c.tensors:
                if not name.startswith(GRAD_PREFIX):
                    buffer_rows[name] += c.samples
        for c in parts:
            for name, tensor in c.tensors.items():
                weight = 1.0 if name.startswith(GRAD_PREFIX) else c.samples / buffer_rows[name]
                if name in tensors:
                    tensors[name].add_(tensor, alpha=weight)
                else:
                    tensors[name] = tensor.mul(weight) if weight != 1.0 else tensor.clone()
        last = [c for c in parts if c.stage.stage == c.stage.stages - 1]
        rows = sum(c.samples for c in last) or 1
        energies = [c.energy_j for c in parts]
        first = parts[0]
        out.append(Contribution(
            device_id=f"pipeline{pipeline}", samples=first.stage.pipeline_samples,
            loss=sum(c.loss * c.samples for c in last) / rows, correct=sum(c.correct for c in last),
            compute_s=max(c.compute_s for c in parts), download_s=max(c.download_s for c in parts),
            encode_s=max(c.encode_s for c in parts), upload_s=max(c.upload_s for c in parts), tensors=tensors,
            energy_j=None if None in energies else sum(energies), step=first.step,
            param_version=min(c.param_version for c in parts), codec=first.codec,
            wire_bytes=sum(c.wire_bytes for c in parts), wait_s=max(c.wait_s for c in parts),
            peak_activation_bytes=max(c.peak_activation_bytes for c in parts),
            decode_s=max(c.decode_s for c in parts),
            accepted_at=max((c.accepted_at for c in parts if c.accepted_at is not None), default=None)))
    return out

