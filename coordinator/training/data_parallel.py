"""Data-parallel rounds: every board computes an update on its shard of the step's samples.

`DataParallelRound` splits the global batch over the boards that may work now (ready, not
quarantined, not still busy with a late update): in proportion to measured speed, kept while the
current split stays near the best one (`split: proportional`, see edgetrain.split.split_sticky),
or equally (`split: equal`). Each board's link codecs come from the codec policy. Without a
`Deadline` the attempt waits for every board (3 x the predicted step time + 10 s at most, or
`training.step_timeout_s`) and counts only if nobody was missing — a board that died makes the
step redo on the same samples with the others, so no sample is lost and no update applied
twice. With a `Deadline` (aggregation `deadline: predicted`, and always under `staleness`) the
attempt closes at `deadline_factor` x the typical board's predicted time and counts when
`min_fraction` of its samples arrived; under `staleness` the late boards' tickets stay open.

`FederatedRound` gives each board a round of local training on its own data partition
(FedAvg / FedProx): the partitions (iid, Dirichlet non-IID or a few classes each:
edgetrain.partition) are fixed per board name, in order of arrival, and a newcomer takes over the
partition of a board that left; with `clients_per_round` each round draws that many of the
partition holders (partial participation).

A board that trains on its own images (`edgetrain client --local-data`) is given indices into
those (`OwnSamples`): in data parallelism its share of the step, drawn from its own seeded epoch
permutations instead of the global batch; in federated rounds its own data is its partition. Its
update is weighted by the samples it used, like every other; with such boards a step is no longer
the single-process SGD step on the global batch.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import replace

import torch

from coordinator.training.aggregator import normalized_factors
from coordinator.training.codec_policy import CodecPolicy, LinkChoice
from coordinator.training.rounds import Collected, Fleet, Round, RoundContext, RoundPolicy
from coordinator.training.steps import AttemptOutcome
from edgetrain.config import AggregationConfig, ConfigError
from edgetrain.data import dataset_labels, load_dataset
from edgetrain.partition import class_counts, partition_members, round_indices
from edgetrain.sampling import board_seed, indices_from
from edgetrain.split import (
    SpeedEstimate,
    predicted_step_seconds,
    share_change_gain,
    split_equal,
    split_sticky,
)
from edgetrain.training import shard_tensor_names, state_tensors
from edgetrain.updates import DeltaFormat, UpdateFormats
from edgetrain.work import Assignment, LocalWork

logger = logging.getLogger(__name__)

MIN_MEASURED_STEPS = 3
"""A board the split leaves out before it has this many measured data-parallel steps gets one
sample a step until it has them: its first steps in a role carry its warm-up (new shapes, first
transfers several times slower), and a board left out is never measured again, so a warm-up
taken for its speed would leave it out for the rest of the run."""

UNMEASURED_LINK_S = 30.0
"""Transfer time assumed per step for a device whose link was never measured."""


def with_unmeasured(shares: dict[str, int], measured_steps: dict[str, int]) -> dict[str, int]:
    """`shares` with one sample, taken from the largest share, for each board it leaves out that
    has fewer than MIN_MEASURED_STEPS measured steps (`measured_steps`), while the largest share
    has samples to spare (the split in use is not changed: the next step's starts from it)."""
    out = dict(shares)
    for device in sorted(d for d, n in shares.items() if n == 0 and measured_steps.get(d, 0) < MIN_MEASURED_STEPS):
        donor = max(sorted(out), key=lambda d: out[d])
        if out[donor] < 2:
            break
        out[donor] -= 1
        out[device] = 1
    return out


class Deadline:
    """When an attempt closes without waiting for every board, and when it still counts."""

    def __init__(self, cfg: AggregationConfig, *, keep_late: bool) -> None:
        self.cfg = cfg
        self.keep_late = keep_late
        """Late tickets stay open (staleness rule): their updates count in a later step."""

    def seconds(self, typical_s: float, attempt: int) -> float:
        """The attempt's deadline: a multiple of the typical board's predicted time, longer on redos."""
        return (self.cfg.deadline_factor * typical_s + self.cfg.deadline_slack_s) * (attempt + 1)

    def enough(self, arrived: int, wanted: int) -> bool:
        """Whether the samples that arrived make the attempt count."""
        return arrived >= self.cfg.min_fraction * wanted


class OwnSamples:
    """Where each board with its own data is in its own sample order: its samples are taken in
    consecutive runs of its own seeded epoch permutations (edgetrain.sampling), and the run moves
    on only when a step that used it was applied, so a redone attempt trains on the same ones."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cursors: dict[str, int] = {}
        """Board name -> samples of its own order used by applied steps."""
        self._pending: dict[str, int] = {}

    def take(self, name: str, count: int, size: int) -> tuple[int, ...]:
        """The next `count` indices into a board's `size` own samples (used by the attempt being built)."""
        self._pending[name] = count
        return tuple(indices_from(self.cursors.get(name, 0), count, size, board_seed(self.seed, name)))

    def forget_pending(self) -> None:
        """A new attempt is being built: only its takes count."""
        self._pending = {}

    def committed(self) -> None:
        """The attempt built last was applied: its boards move on."""
        for name, count in self._pending.items():
            self.cursors[name] = self.cursors.get(name, 0) + count
        self._pending = {}


class DataParallelRound(RoundPolicy):
    """Shards of the global batch over the available boards (see the module docstring)."""

    def __init__(self, ctx: RoundContext, deadline: Deadline | None = None) -> None:
        super().__init__(ctx)
        self.deadline = deadline
        self.own = OwnSamples(ctx.job.seed)
        """Boards with their own data: where each is in its own samples."""
        self._shares: dict[str, int] | None = None
        """The shares last assigned (kept while near the best split: see split_sticky)."""
        formats = UpdateFormats(shard_tensor_names(ctx.model))
        state = state_tensors(ctx.model)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        self.codecs = CodecPolicy(ctx.job.compression, lambda c: formats(c).wire_bytes(), full_bytes,
                                  _delta_bytes(state, ctx.job.compression.downlink))

    def configure(self, step: int, attempt: int, indices: list[int]) -> Round:
        return self.configure_on(step, attempt, indices)

    def configure_on(self, step: int, attempt: int, indices: list[int], names: tuple[str, ...] = (),
                     exclude: tuple[str, ...] = ()) -> Round:
        """`configure`, on the boards named `names` only (every available board when `names` is empty
        or none of them is available), never on those named in `exclude` (unless nobody else is)."""
        self.own.forget_pending()
        speeds, fleet = self._available(step)
        if exclude:
            speeds = {d: s for d, s in speeds.items() if fleet.name(d) not in exclude} or speeds
        if names:
            speeds = {d: s for d, s in speeds.items() if fleet.name(d) in names} or speeds
        speeds = self._participants(step, speeds, fleet)
        shares = self._split(len(indices), speeds, fleet)
        choices = self._choose_codecs(shares, speeds, fleet)
        assignments = self._assign(step, attempt, indices, shares, choices, fleet)
        timeout, predicted = self._timeout(shares, speeds, attempt, choices, fleet)
        return Round(step, attempt, assignments, timeout, keep_late=bool(self.deadline and self.deadline.keep_late),
                     ends_on_loss=self.deadline is None, predicted_s=predicted)

    def complete(self, round_: Round, outcome: AttemptOutcome, elapsed_s: float) -> bool:
        registry, step, attempt = self.ctx.registry, round_.step, round_.attempt
        if self.deadline is None:
            for device_id in outcome.missing:
                registry.drop(device_id, f"no result for step {step} attempt {attempt}")
            if outcome.missing:
                logger.warning("[Coordinator.Trainer] step %d attempt %d: %s failed; redoing the step with "
                               "the remaining devices", step, attempt, ", ".join(outcome.missing))
            return not outcome.missing
        overdue = [d for d in outcome.missing + outcome.late if registry.is_alive(d)]
        for device_id in overdue:
            registry.observe_late(device_id, len(round_.assignments[device_id].indices), elapsed_s)
        arrived = sum(c.samples for c in outcome.accepted.values())
        wanted = sum(len(a.indices) for a in round_.assignments.values())
        if overdue:
            logger.info("[Coordinator.Trainer] step %d: deadline passed without %s (%d of %d samples arrived)%s",
                        step, ", ".join(overdue), arrived, wanted,
                        "; their updates may still count, down-weighted" if self.deadline.keep_late else "")
        if self.deadline.enough(arrived, wanted):
            return True
        logger.warning("[Coordinator.Trainer] step %d attempt %d: only %d of %d samples by the deadline; "
                       "redoing the step", step, attempt, arrived, wanted)
        return False

    # --- building an attempt ----------------------------------------------------------------------
    def _available(self, step: int) -> tuple[dict[str, SpeedEstimate], Fleet]:
        """Boards that may get work now (ready, not quarantined, not still busy with a late
        ticket), waiting until there is one; and the fleet snapshot they come from."""
        ctx = self.ctx
        while True:
            ctx.wait_for_boards(1)
            fleet = Fleet.snapshot(ctx.registry)
            busy = ctx.board.busy()
            available = {d: s for d, s in fleet.ready().items() if d not in busy and self._eligible(d, fleet)}
            if available:
                return available, fleet
            ready = {d for d, r in fleet.records.items() if r.ready}
            if ready and all(fleet.records[d].quarantined for d in ready):  # nobody left to train
                logger.warning("[Coordinator.Trainer] every ready device is quarantined; releasing them")
                ctx.registry.release_quarantine(10**12)
                continue
            self._waiting(busy)
            ctx.aggregator.collect_late(ctx.board, step)  # everyone is busy with late work: wait for some
            time.sleep(0.05)

    def _eligible(self, device_id: str, fleet: Fleet) -> bool:
        """Whether a ready, idle board may take part (federated rounds: it holds a partition)."""
        return True

    def _waiting(self, busy: set[str]) -> None:
        """Nobody can work now (a subclass may say why)."""

    def _participants(self, step: int, speeds: dict[str, SpeedEstimate], fleet: Fleet) -> dict[str, SpeedEstimate]:
        """The available boards that take part in this step (every one; federated rounds may draw)."""
        return speeds

    def _split(self, total: int, speeds: dict[str, SpeedEstimate], fleet: Fleet) -> dict[str, int]:
        if self.ctx.job.training.split == "equal":
            return split_equal(total, list(speeds))
        noise = self.ctx.registry.rate_noise(speeds)
        self._shares = split_sticky(total, speeds, self._shares, min_gain=share_change_gain(noise, len(speeds)))
        return with_unmeasured(self._shares, {d: len(fleet.records[d].step_times) for d in speeds})

    def _choose_codecs(self, shares: dict[str, int], speeds: dict[str, SpeedEstimate],
                       fleet: Fleet) -> dict[str, LinkChoice]:
        compute_s = max((speeds[d].overhead_s + n / speeds[d].samples_per_s for d, n in shares.items() if n),
                        default=0.0)
        choices = {}
        for device_id in shares:
            choices[device_id] = self.codecs.choose(device_id, fleet.link_mbit(device_id), compute_s)
            self.ctx.registry.set_codec(device_id, choices[device_id].codec)
        self.codecs.retain({d for d, r in fleet.records.items() if r.alive})
        return choices

    def committed(self, round_: Round) -> None:
        self.own.committed()

    def state_dict(self) -> dict:
        return {"own_samples": dict(self.own.cursors)}

    def load_state_dict(self, state: dict) -> None:
        self.own.cursors = {str(k): int(v) for k, v in state.get("own_samples", {}).items()}

    def own_indices(self, record, count: int) -> tuple[int, ...]:
        """`count` indices into the own samples of the board of `record` (its next ones)."""
        return self.own.take(record.name, count, record.local_samples)

    def _assign(self, step: int, attempt: int, indices: list[int], shares: dict[str, int],
                choices: dict[str, LinkChoice], fleet: Fleet) -> dict[str, Assignment]:
        out, start = {}, 0
        job = self.ctx.job
        for device_id, count in shares.items():
            if count:
                if fleet.records[device_id].local_samples:
                    mine = self.own_indices(fleet.records[device_id], count)
                else:
                    mine, start = tuple(indices[start: start + count]), start + count
                out[device_id] = Assignment(step, attempt, step, mine, job.dataset.augment, job.seed,
                                            codec=choices[device_id].codec,
                                            delta_codec=choices[device_id].delta_codec)
        return out

    def _calls(self) -> int:
        """Forward+backward calls a board makes per round (each costs its fixed overhead)."""
        return 1

    def _timeout(self, shares: dict[str, int], speeds: dict[str, SpeedEstimate], attempt: int,
                 choices: dict[str, LinkChoice], fleet: Fleet) -> tuple[float, float]:
        """How long the attempt may take (the configured timeout, the deadline, or 3 x the
        prediction + 10 s) and the predicted step time. Until a board's communication time has
        been observed, its prediction includes its transfers at its measured bandwidth."""
        speeds = {d: self._with_transfers(speeds[d], choices[d], fleet.link_mbit(d)) for d in shares}
        configured = self.ctx.job.training.step_timeout_s
        extra = self._calls() - 1
        predicted = predicted_step_seconds(shares, speeds) + max(speeds[d].overhead_s for d in shares) * extra
        if self.deadline is not None:  # the typical board's time: a straggler does not set the pace
            typical = statistics.median_low([speeds[d].seconds(n) for d, n in shares.items() if n])
            typical += statistics.median_low([speeds[d].overhead_s for d in shares]) * extra
            deadline = self.deadline.seconds(typical, attempt)
            return (min(deadline, configured) if configured > 0 else deadline), predicted
        return (configured if configured > 0 else 3 * predicted + 10.0), predicted

    def _with_transfers(self, speed: SpeedEstimate, choice: LinkChoice, mbit: float | None) -> SpeedEstimate:
        if speed.comm_s > 0:
            return speed
        transfer_s = self.codecs.step_bytes(choice.codec) * 8 / (mbit * 1e6) if mbit else UNMEASURED_LINK_S
        return SpeedEstimate(speed.overhead_s, speed.samples_per_s, transfer_s)


class FederatedRound(DataParallelRound):
    """A round of local training on every board's own data partition (FedAvg / FedProx)."""

    def __init__(self, ctx: RoundContext, deadline: Deadline | None = None) -> None:
        super().__init__(ctx, deadline)
        fed, job = ctx.job.federated, ctx.job
        self._steps: dict[str, int] = {}
        """Device -> its local steps in the round being built."""
        self._data: dict[str, int] = {}
        """Device -> the samples of data it trains on (its partition, or its own data)."""
        self.partition_count = fed.partitions or job.training.min_clients
        self._partitions: dict[str, int] = {}
        """Board name -> its data partition."""
        labels = (range(ctx.train_size) if fed.partitioning == "iid"
                  else dataset_labels(load_dataset(job.dataset, train=True)))
        try:
            self.members = partition_members(labels, self.partition_count, scheme=fed.partitioning,
                                             alpha=fed.dirichlet_alpha,
                                             classes_per_partition=fed.classes_per_partition, seed=job.seed)
        except ValueError as e:
            raise ConfigError(f"federated: {e}") from None
        """Each partition's sample indices."""
        if fed.partitioning != "iid":
            for p, members in enumerate(self.members):
                logger.info("[Coordinator.Trainer] partition %d (%s): %d samples, by class %s", p, fed.partitioning,
                            len(members), class_counts(labels, members))

    def _eligible(self, device_id: str, fleet: Fleet) -> bool:
        if fleet.records[device_id].local_samples:  # its own data is its partition
            return True
        live = {r.name for r in fleet.records.values() if r.alive and not r.local_samples}
        return self._partition(fleet.name(device_id), live) is not None

    def _waiting(self, busy: set[str]) -> None:
        if not busy:
            logger.warning("[Coordinator.Trainer] ready devices hold no data partition; waiting for a "
                           "partition holder (or a board to take over a departed one's partition)")
            self.ctx.stop.wait(1.0)

    def _partition(self, name: str, live_names: set[str]) -> int | None:
        """The data partition of a board (by name, in order of arrival; a newcomer takes over the
        partition of a board that left); None while every partition has a live holder."""
        if name not in self._partitions:
            orphaned = sorted(p for holder, p in self._partitions.items() if holder not in live_names)
            if len(self._partitions) < self.partition_count:
                self._partitions[name] = len(self._partitions)
            elif orphaned:
                holder = next(h for h, p in self._partitions.items() if p == orphaned[0])
                self._partitions[name] = self._partitions.pop(holder)
            else:
                return None
            logger.info("[Coordinator.Trainer] board %s holds data partition %d of %d", name,
                        self._partitions[name], self.partition_count)
        return self._partitions[name]

    def _participants(self, step: int, speeds: dict[str, SpeedEstimate], fleet: Fleet) -> dict[str, SpeedEstimate]:
        """With clients_per_round k: k of the available partition holders, drawn by (seed, round)."""
        k = self.ctx.job.federated.clients_per_round
        if not k or len(speeds) <= k:
            return speeds
        names = sorted(fleet.name(d) for d in speeds)
        chosen = set(random.Random(f"{self.ctx.job.seed}:{step}").sample(names, k))
        return {d: s for d, s in speeds.items() if fleet.name(d) in chosen}

    def _split(self, total: int, speeds: dict[str, SpeedEstimate], fleet: Fleet) -> dict[str, int]:
        fed = self.ctx.job.federated
        self._steps = {d: local_steps(fed, s) for d, s in speeds.items()}
        return {d: steps * fed.local_batch for d, steps in self._steps.items()}

    def _assign(self, step: int, attempt: int, indices: list[int], shares: dict[str, int],
                choices: dict[str, LinkChoice], fleet: Fleet) -> dict[str, Assignment]:
        job, fed, opt = self.ctx.job, self.ctx.job.federated, self.ctx.job.optimizer
        local = LocalWork(steps=fed.local_steps, batch_size=fed.local_batch, lr=self.ctx.aggregator.step_lr(step),
                          momentum=opt.momentum, weight_decay=opt.weight_decay,
                          prox_mu=fed.prox_mu if job.aggregation.rule == "fedprox" else 0.0)
        self._data = {}
        out = {}
        for device_id, count in shares.items():
            record = fleet.records[device_id]
            if record.local_samples:
                mine = self.own_indices(record, count)
                self._data[device_id] = record.local_samples
            else:
                members = self.members[self._partitions[record.name]]
                mine = tuple(round_indices(members, step, count))
                self._data[device_id] = len(members)
            out[device_id] = Assignment(step, attempt, step, mine, job.dataset.augment, job.seed,
                                        codec=choices[device_id].codec, delta_codec=choices[device_id].delta_codec,
                                        local=replace(local, steps=self._steps[device_id]))
        return out

    def collect(self, round_: Round, outcome: AttemptOutcome) -> Collected:
        collected = super().collect(round_, outcome)
        if self.ctx.job.federated.normalize and collected.contributions:
            done = {c.device_id: c for c in collected.contributions}
            collected.factors = normalized_factors(
                {d: round_.assignments[d].local.steps for d in done}, {d: self._data[d] for d in done},
                {d: c.samples for d, c in done.items()})
        return collected

    def _calls(self) -> int:
        return max(self._steps.values(), default=self.ctx.job.federated.local_steps)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "partitions": dict(self._partitions)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._partitions = dict(state.get("partitions", {}))


def local_steps(fed, speed: SpeedEstimate) -> int:
    """A board's local steps in a round: `local_steps`, or with a time budget (`local_time_s`) as
    many steps of `local_batch` as its measured speed fits in it, at least one."""
    if not fed.local_time_s:
        return fed.local_steps
    per_step = speed.overhead_s + fed.local_batch / speed.samples_per_s
    return max(1, int(fed.local_time_s / per_step))


def _delta_bytes(state: dict[str, torch.Tensor], downlink: str) -> int:
    """Bytes of one parameter delta in the downlink codec (full bytes when there is none)."""
    if downlink == "none":
        return sum(t.numel() * t.element_size() for t in state.values())
    return sum(m.nbytes for m in DeltaFormat(state, downlink).chain_metas(0, 1))
