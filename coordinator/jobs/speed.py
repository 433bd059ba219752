"""How fast a job would train on a set of boards: the job scheduler's oracle in the job server.

The answer is the hybrid planner's prediction (``coordinator.planning.planner``) for that job on those
boards, exactly as the job would run: with ``planner.enabled`` the plan the planner would choose,
with a hand-written pipeline that plan, else data parallelism over all of them. Boards are
described as in fleet files: their speed as a fraction of one core of this machine (measured by
timing ``edgetrain.speed_reference`` on both) and their link rate (measured by a probe).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping

from coordinator.jobs.scheduler import Board, Job
from coordinator.planning.cost import predict
from coordinator.planning.inputs import (
    boards_from_fleet,
    measure_model_cost,
    one_core_speed,
    transfer_cpu_s_per_byte,
)
from coordinator.planning.planner import plan_optimal
from edgetrain.config import JobConfig
from edgetrain.fleet_file import BoardSpec, LinkSpec
from edgetrain.plan import Plan

UNKNOWN_LINK_MBIT = 100.0
"""Link rate assumed for a board whose probe gave no estimate."""

_measure_lock = threading.Lock()


@functools.cache
def _model(model_name: str):
    with _measure_lock:
        return measure_model_cost(model_name), one_core_speed(model_name)


@functools.cache
def _cpu_s_per_byte() -> float:
    with _measure_lock:
        return transfer_cpu_s_per_byte()


def warm(model_name: str) -> None:
    """Measure a model's block costs now (a few seconds for ResNet-18), not inside a decision."""
    _model(model_name)
    _cpu_s_per_byte()


def board_spec(name: str, speed: float, mbit_per_s: float) -> BoardSpec:
    """A lobby board as a fleet-file board."""
    return BoardSpec(name=name, speed=speed, link=LinkSpec(mbit_per_s=mbit_per_s or UNKNOWN_LINK_MBIT))


class PlannerSpeed:
    """``SpeedOracle`` over a snapshot of jobs and boards; answers are cached per request."""

    def __init__(self, configs: Mapping[str, JobConfig], boards: Mapping[str, BoardSpec]) -> None:
        self.configs = dict(configs)
        self.boards = dict(boards)
        self._cache: dict[tuple[str, tuple[str, ...]], float] = {}

    def __call__(self, job: Job, boards: tuple[Board, ...]) -> float:
        names = tuple(sorted(b.name for b in boards))
        key = (job.id, names)
        if key not in self._cache:
            self._cache[key] = self._predict(self.configs[job.id], names)
        return self._cache[key]

    def _predict(self, config: JobConfig, names: tuple[str, ...]) -> float:
        known = tuple(n for n in names if n in self.boards)  # a board that left adds nothing
        if not known:
            return 1e-9
        model, one_core = _model(config.model)
        fleet = boards_from_fleet([self.boards[n] for n in known], model, one_core, cpu_s_per_byte=_cpu_s_per_byte())
        names = known
        batch = config.training.global_batch
        kw = dict(stage_state=config.pipeline.stage_state, sync_every=config.pipeline.sync_every,
                  replicate=config.pipeline.replicate)
        try:
            if config.planner.enabled:
                return plan_optimal(fleet, model, batch, config.planner.weight, channel_groups=config.planner.channel_groups,
                                    **kw).prediction.samples_per_s
            if config.pipeline.stages:
                return predict(config.pipeline.plan(), fleet, model, batch, **kw).samples_per_s
            return predict(Plan(dp_boards=names, dp_share=1.0), fleet, model, batch, **kw).samples_per_s
        except ValueError:  # nothing fits these boards' memory, or the plan names other boards
            return 1e-9


def implied_speed(config: JobConfig, name: str, mbit_per_s: float, samples_per_s: float, *,
                  lo: float = 1 / 64, hi: float = 64.0) -> float:
    """The speed (fraction of one core here) at which the planner predicts `samples_per_s` for
    the job on board `name` alone, with its link: what the job's measured steps say of the board.
    Clamped to [lo, hi]; 0 when the planner has no prediction for the job on one board."""

    def predicted(speed: float) -> float:
        spec = board_spec(name, speed, mbit_per_s)
        return PlannerSpeed({"job": config}, {name: spec})._predict(config, (name,))

    if predicted(hi) <= 1e-9:
        return 0.0
    if predicted(hi) <= samples_per_s:
        return hi
    if predicted(lo) >= samples_per_s:
        return lo
    low, high = math.log(lo), math.log(hi)
    for _ in range(24):  # the prediction grows with the speed
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(math.exp(mid)) < samples_per_s else (low, mid)
    return math.exp((low + high) / 2)
