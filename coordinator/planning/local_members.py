"""Boards that train beside the steps: asynchronous local updates from boards too slow to be waited for.

A board the planner leaves out for "no gain" (a share of every step would lengthen the step by
more than it adds) can still add samples without being waited for: it takes the parameters of
step v, trains locally for a time budget at its own speed, and sends its change, which the
coordinator applies under the job's staleness rule — weight (1 + tau)^-p, refused when computed
more than `aggregation.staleness_bound` steps ago — at the first step after it arrives. The
budget is what fits, with the board's transfers, before the last step that may still apply it:
about `staleness_bound` + 1 steps, less half a step kept for jitter. With local SGD (no momentum,
no weight decay: the coordinator's optimizer applies those once) its change is the learning rate
times the sum of its local gradients, so the coordinator divides it by lr x steps: a gradient over
all its samples, weighted by their count like every shard's (normalised by the work done, as
FedNova does).

Pure functions of plain data: the live planner adds these boards to its plans
(``add_local_members``) and the round sizes each board's work from its measured speed
(``local_work_size``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from coordinator.planning.trials import efficiency
from edgetrain.plan import NO_GAIN, BoardCost, ModelCost, Plan

MIN_LOCAL_SAMPLES = 4
"""Fewer samples than this per update are not worth a board's two transfers of the model."""

WINDOW_MARGIN_STEPS = 0.5
"""Steps of the window kept free for jitter: the budget ends this long before the last step that
may apply the update aggregates."""

@dataclass(frozen=True)
class LocalWorkSize:
    """The local training one update of a board beside the steps holds."""

    steps: int
    batch: int
    seconds: float
    """Predicted time from taking the work to the update being uploaded."""

    @property
    def samples(self) -> int:
        return self.steps * self.batch

    def staleness(self, step_s: float) -> int:
        """Steps applied between the one it starts on and the one that applies it (predicted)."""
        return max(0, math.ceil(self.seconds / step_s) - 1) if step_s > 0 else 0


def local_work_size(*, overhead_s: float, samples_per_s: float, transfer_s: float, step_s: float,
                    staleness_bound: int, staleness_exponent: float, local_batch: int,
                    max_batch: float = math.inf) -> LocalWorkSize | None:
    """The update size that adds the most staleness-weighted samples per second (`weighted_rate`)
    among those that land within the bound: for each window of w = 1 .. staleness_bound + 1
    steps, as many local steps of `local_batch` samples (at most `max_batch`: what its memory
    holds) as fit with the board's transfers in w - WINDOW_MARGIN_STEPS steps of `step_s` (one
    step of fewer samples when not even one fits). None when no window fits MIN_LOCAL_SAMPLES
    (or the speed is unknown)."""
    if samples_per_s <= 0 or step_s <= 0 or not math.isfinite(samples_per_s):
        return None
    best = None
    for window in range(1, staleness_bound + 2):
        size = _fitting(overhead_s, samples_per_s, (window - WINDOW_MARGIN_STEPS) * step_s - transfer_s,
                        local_batch, max_batch, transfer_s)
        if size is not None and size.staleness(step_s) <= staleness_bound and (
                best is None or weighted_rate(size, step_s, staleness_exponent)
                > weighted_rate(best, step_s, staleness_exponent)):
            best = size
    return best


def _fitting(overhead_s: float, samples_per_s: float, compute_s: float, local_batch: int, max_batch: float,
             transfer_s: float) -> LocalWorkSize | None:
    """The most local steps of `local_batch` (or one smaller step) that fit in `compute_s`."""
    batch = int(min(local_batch, max_batch))
    per_step = overhead_s + batch / samples_per_s
    steps = int(compute_s // per_step) if batch >= 1 else 0
    if steps < 1:
        steps, batch = 1, int(min(batch, (compute_s - overhead_s) * samples_per_s))
    if batch < MIN_LOCAL_SAMPLES:
        return None
    return LocalWorkSize(steps, batch, transfer_s + steps * (overhead_s + batch / samples_per_s))


def weighted_rate(size: LocalWorkSize, step_s: float, exponent: float) -> float:
    """Samples per second a board beside the steps adds, weighted by the staleness factor its
    updates are predicted to be applied with: one update per (staleness + 1) steps (it gets new
    work at the first step after its update arrived)."""
    tau = size.staleness(step_s)
    return size.samples * (1.0 + tau) ** -exponent / ((tau + 1) * step_s)


def add_local_members(plan: Plan, fleet: Sequence[BoardCost], model: ModelCost, *, global_batch: int,
                      staleness_bound: int, staleness_exponent: float, local_batch: int,
                      stage_state: str = "hosts") -> Plan:
    """`plan` with every board it leaves out for no gain, or gives a DP share of less than one
    sample, training beside its steps where a local update fits the staleness bound (the others
    left out, saying why); its prediction then counts their staleness-weighted samples per second,
    their memory, and their energy and samples in the energy per sample."""
    if plan.prediction is None or owns_stages(plan, stage_state):
        return plan
    plan = without_empty_shards(plan, global_batch)
    by_name = {b.name: b for b in fleet}
    params = sum(b.param_bytes for b in model.blocks)
    flops = sum(b.train_flops for b in model.blocks)
    activations = sum(b.activation_bytes for b in model.blocks)
    step_s = plan.prediction.step_s
    members, rates, memory, left = [], {}, {}, []
    joules, samples = 0.0, 0.0  # what the boards beside the steps use and train per step
    for name, why in plan.left_out:
        board = by_name.get(name)
        if not why.startswith(NO_GAIN) or board is None:
            left.append((name, why))
            continue
        room = (board.memory_bytes - 2 * params) / activations if activations else math.inf
        size = local_work_size(overhead_s=board.overhead_s, samples_per_s=board.flops_per_s / flops,
                               transfer_s=2 * params * board.seconds_per_byte + board.rtt_s, step_s=step_s,
                               staleness_bound=staleness_bound, staleness_exponent=staleness_exponent,
                               local_batch=local_batch, max_batch=room)
        if size is None:
            left.append((name, f"no gain; a local update does not fit {staleness_bound} step(s) of staleness"))
            continue
        members.append(name)
        rates[name] = weighted_rate(size, step_s, staleness_exponent)
        memory[name] = 2 * params + size.batch * activations
        cycle_s = (size.staleness(step_s) + 1) * step_s
        busy = min(1.0, (size.seconds - 2 * params * board.seconds_per_byte) / cycle_s)
        joules += (board.idle_w + (board.busy_w - board.idle_w) * busy) * step_s
        samples += size.samples * step_s / cycle_s
    if not members:
        return replace(plan, left_out=tuple(left))
    p = plan.prediction
    trained = p.samples_per_s * step_s  # the samples of a step
    prediction = replace(p, local_samples_per_s=rates, memory_bytes={**p.memory_bytes, **memory},
                         energy_per_sample_j=(p.energy_per_sample_j * trained + joules) / (trained + samples))
    return replace(plan, local_boards=tuple(members), left_out=tuple(left), prediction=prediction)


def owns_stages(plan: Plan, stage_state: str) -> bool:
    """Whether hosts keep some stage's state (`stage_state: hosts`, a one-board stage, no DP
    shards): a whole-model local update would then change blocks whose state lives on their
    owners, so such a plan has no boards beside its steps."""
    return stage_state == "hosts" and not plan.dp_boards and any(len(s.boards) == 1 for s in plan.stages)


def without_empty_shards(plan: Plan, global_batch: int) -> Plan:
    """`plan` with its DP shards predicted to take less than one sample a step left out for no
    gain (a pure DP plan keeps at least its busiest shard): the plan as its steps run, so that it
    is compared, measured and remembered by the boards that work in them."""
    if plan.prediction is None:
        return plan
    share = plan.prediction.share
    empty = [b for b in plan.dp_boards if share.get(b, 0.0) * global_batch < 1]
    kept = tuple(b for b in plan.dp_boards if b not in empty)
    if not empty or (not kept and not plan.stages):
        return plan
    prediction = replace(plan.prediction, share={b: v for b, v in share.items() if b not in empty})
    return replace(plan, dp_boards=kept, dp_share=plan.dp_share if kept or not plan.stages else 0.0,
                   left_out=plan.left_out + tuple((b, NO_GAIN) for b in empty), prediction=prediction)


def without_local_members(plan: Plan) -> Plan:
    """`plan` with the boards beside its steps left out again (for no gain), as the planner made it
    (its energy per sample still counts them until it is predicted again)."""
    if not plan.local_boards and not any(why.startswith(NO_GAIN + ";") for _, why in plan.left_out):
        return plan
    prediction = plan.prediction
    if prediction is not None:
        prediction = replace(prediction, local_samples_per_s={},
                             memory_bytes={b: m for b, m in prediction.memory_bytes.items()
                                           if b not in plan.local_boards})
    left = tuple((b, NO_GAIN if why.startswith(NO_GAIN) else why) for b, why in plan.left_out)
    return replace(plan, local_boards=(), left_out=left + tuple((b, NO_GAIN) for b in plan.local_boards),
                   prediction=prediction)


LOCAL_JUDGED_AT = (40, 80, 160, 320)
"""Steps of a plan in force after which its local updates are judged by what they measured."""
MIN_JUDGED_STEPS = 10
"""Steps of each kind (with local work, without) a judgement needs."""


@dataclass(frozen=True)
class LocalVerdict:
    """What the local updates of a plan in force measured: seconds per step, both averaged over all
    its steps."""

    cost_s: float
    """What the steps that handed out or applied local work took longer than the others, times
    their share of the steps."""
    gain_s: float
    """What the weighted local samples they applied are worth, in the goodput the trials score
    plans by: the extra step time their samples pay for at equal goodput (their samples x the
    statistical efficiency of the larger batch; see judge_local_updates)."""
    touched: int
    untouched: int
    efficiency: float = 1.0
    """The statistical efficiency of the step's batch with their samples against without (1 when
    the gradient noise scale is unknown)."""

    @property
    def pays(self) -> bool:
        return self.gain_s >= self.cost_s

    def describe(self) -> str:
        return (f"local updates cost {self.cost_s:.3f} s a step and add {self.gain_s:.3f} s worth of samples "
                f"(at efficiency {self.efficiency:.2f}; steps with local work {self.touched}, without "
                f"{self.untouched})")


def judge_local_updates(step_seconds: Sequence[tuple[int, float]], local_work: dict[int, float],
                        global_batch: int, noise_scale: float | None = None) -> LocalVerdict | None:
    """Measure, not assume, what boards beside the steps bring: the plan's steps that handed out or
    applied local work (`local_work`: step -> weighted local samples applied) against those that
    did not, measured in the same minutes (the emulated machine's speed drifts by minutes, not by
    steps). Boards beside the steps share the gateway's CPU and network with the steps (their
    downloads and uploads, their updates applied); the samples they add are weighted by staleness.
    They pay when the steps' goodput with them beats it without, as trials score plans: with m
    weighted samples a step added to a batch of B, the steps carry B + m samples at statistical
    efficiency (phi + B) / (phi + B + m) (Pollux; phi the gradient noise scale, `noise_scale`), so
    they are worth base x ((B + m) / B x (phi + B) / (phi + B + m) - 1) seconds a step: m / B of
    a step when phi is unknown or large, nothing when phi is far below the batch (more samples a
    step then hardly cut the steps). None while either kind has fewer than MIN_JUDGED_STEPS steps."""
    touched = [sec for step, sec in step_seconds if step in local_work]
    plain = [sec for step, sec in step_seconds if step not in local_work]
    if len(touched) < MIN_JUDGED_STEPS or len(plain) < MIN_JUDGED_STEPS:
        return None
    steps = len(touched) + len(plain)
    base = sum(plain) / len(plain)
    cost = (sum(touched) / len(touched) - base) * len(touched) / steps
    samples = sum(local_work.get(step, 0.0) for step, _ in step_seconds) / steps
    eff = efficiency(noise_scale, global_batch, global_batch + samples)
    return LocalVerdict(cost_s=cost, gain_s=base * ((global_batch + samples) / global_batch * eff - 1),
                        touched=len(touched), untouched=len(plain), efficiency=eff)
