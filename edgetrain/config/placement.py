"""Where the model runs: a pipeline plan written by hand or in a plan file, the live planner of
hybrid mode, and what a job asks of a fleet shared with other jobs (sections of a job file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgetrain.config.files import ConfigError, load_yaml, require
from edgetrain.plan import SCHEDULES as PIPELINE_SCHEDULES
from edgetrain.plan import Plan, plan_from_dict


@dataclass(kw_only=True, frozen=True)
class PipelineConfig:
    """Pipeline training: the plan written by hand (stages over boards, micro-batches, schedule,
    optional DP shards; or a plan file), and how stages run (timeouts, where their state lives)."""

    stages: list = field(default_factory=list)
    """Stages first to last, each {blocks: N consecutive blocks, boards: [names hosting it]} (a
    group of boards splits every micro-batch by rows); their blocks must add up to the model's."""
    microbatches: int = 4
    """Micro-batches per step (the bubble is (S - 1) / (M + S - 1))."""
    schedule: str = "1f1b"
    """gpipe (all forwards, then all backwards) or 1f1b (bounded activations)."""
    dp_boards: list = field(default_factory=list)
    """Boards that join as data-parallel shards (whole model) next to the pipeline."""
    dp_share: float = 0.0
    """Fraction of the global batch the DP shards get (required with dp_boards)."""
    stage_timeout_s: float = 60.0
    """Longest a stage host waits for a neighbour (each wait) before it gives the step up."""
    plan_file: str = ""
    """A YAML file holding the plan (this section's stages, microbatches, schedule, dp_boards and
    dp_share); re-read when it changes (re-plan by hand)."""
    stage_state: str = "hosts"
    """Where stage parameters and optimizer state live. `hosts`: a stage with one host (and no DP
    shards beside the pipeline) keeps them on its host, which applies SGD itself, so no
    parameters come down its link; the coordinator keeps a replica (`replicate`) or pulls them
    back every `sync_every` steps. `coordinator`: every host downloads its stage's parameters
    and uploads their gradients every step (stages hosted by a group always do)."""
    replicate: bool = True
    """With `stage_state: hosts`, the coordinator's copy of an owned stage is its replica: every
    attempt's gradients (and BatchNorm statistics) go up to it while the pipeline runs, the step
    counts once they arrived, and the coordinator applies them as the host does. A host that dies
    loses no committed step; its link carries its stage's gradient bytes each step. false: only
    the pulls every `sync_every` steps (and to evaluate, checkpoint or re-plan)."""
    sync_every: int = 50
    """With `stage_state: hosts` and `replicate: false`, steps between pulls of host-held state.
    A host lost between pulls takes its blocks' progress since the last pull with it: those
    blocks go on from the last pull (the other blocks keep theirs); 1 loses nothing."""

    def __post_init__(self) -> None:
        require(self.stage_state in ("hosts", "coordinator"), "stage_state", self.stage_state,
                "must be hosts or coordinator")
        require(self.sync_every >= 1, "sync_every", self.sync_every, "must be >= 1")

        require(self.microbatches >= 1, "microbatches", self.microbatches, "must be >= 1")
        require(self.schedule in PIPELINE_SCHEDULES, "schedule", self.schedule,
                f"must be one of {PIPELINE_SCHEDULES}")
        require(0 <= self.dp_share < 1, "dp_share", self.dp_share, "must be in [0, 1)")
        require(not self.dp_boards or self.dp_share > 0, "dp_share", self.dp_share,
                "must be > 0 when dp_boards are given (their share of the global batch)")
        require(self.stage_timeout_s > 0, "stage_timeout_s", self.stage_timeout_s, "must be > 0")
        require(not (self.stages and self.plan_file), "plan_file", self.plan_file,
                "give the plan either as stages here or in a plan file, not both")
        self.plan()  # refuses a plan that does not hold together

    @property
    def enabled(self) -> bool:
        """Whether the job trains as a pipeline."""
        return bool(self.stages) or bool(self.plan_file)

    def plan(self) -> Plan | None:
        """The plan this section writes out (None when it has no stages: a plan file or the
        planner makes it)."""
        if not self.stages:
            return None
        try:
            return plan_from_dict({"stages": self.stages, "microbatches": self.microbatches,
                                   "schedule": self.schedule, "dp_boards": self.dp_boards,
                                   "dp_share": self.dp_share}, where="pipeline")
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("pipeline: ")) from None


def load_plan(path: str | Path) -> Plan:
    """The plan of a plan file (a job's `pipeline` section's stages, microbatches, schedule,
    dp_boards and dp_share); errors name the file, the key and the bad value."""
    data = load_yaml(path)
    try:
        return plan_from_dict(data, where=str(path))
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass(kw_only=True, frozen=True)
class PlannerConfig:
    """Hybrid mode: the coordinator plans stages and DP shards from the live fleet, and re-plans."""

    enabled: bool = False
    """Plan with coordinator.planning.planner (the pipeline section then gives only schedule, timeouts
    and stage_state; its stages and plan_file must be empty)."""
    objective: str | float = "time"
    """time, energy, or a weight of energy in [0, 1] (0.5: half each)."""
    bandwidth_change: float = 0.3
    """Re-plan when a board's measured link rate moved by more than this fraction since the plan."""
    min_gain: float = 0.05
    """Switch to a new plan only if it is predicted at least this much better than the current
    one on the changed fleet (hysteresis; a plan whose boards left is always replaced)."""
    battery_floor: float = 20.0
    """Boards below this battery percent and unplugged get no work."""
    overrun: float = 0.5
    """Re-plan (once per plan) when the plan in force measures a median step more than this
    fraction over its prediction."""
    link_wait_s: float = 15.0
    """Before the first plan, wait up to this long for every board's first link measurement."""
    trial_steps: int = 3
    """Measure, then commit: a new plan on a changed fleet and structurally different alternatives
    each train this many steps (plus a hand-over step), and the best measured goodput stays in
    force (coordinator.planning.trials); 0: the planner's prediction decides alone."""
    local_updates: bool = True
    """Boards a plan leaves out for no gain train beside its steps (not waited for) and send local
    updates, applied under the staleness rule within aggregation.staleness_bound steps
    (coordinator.planning.local_members); false: they stay out."""
    channel_groups: bool = True
    """A group of boards may host a stage as a channel group (each member a share of every split
    layer's output channels, edgetrain.channels) where the cost model finds that cheaper than
    splitting samples; false: sample-split groups only."""

    def __post_init__(self) -> None:
        ok = self.objective in ("time", "energy") or (
            isinstance(self.objective, float) and 0.0 <= self.objective <= 1.0)
        require(ok, "objective", self.objective, "must be time, energy or a weight in [0, 1]")
        require(self.bandwidth_change > 0, "bandwidth_change", self.bandwidth_change, "must be > 0")
        require(0 <= self.min_gain < 1, "min_gain", self.min_gain, "must be in [0, 1)")
        require(0 <= self.battery_floor <= 100, "battery_floor", self.battery_floor, "must be in [0, 100]")
        require(self.overrun > 0, "overrun", self.overrun, "must be > 0")
        require(self.link_wait_s >= 0, "link_wait_s", self.link_wait_s, "must be >= 0")
        require(isinstance(self.trial_steps, int) and self.trial_steps >= 0, "trial_steps", self.trial_steps,
                "must be an integer >= 0")

    @property
    def weight(self) -> str | float:
        """The objective as coordinator.planning.planner takes it."""
        return self.objective


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    """What the job asks of a shared fleet (``edgetrain submit``; a lone coordinator ignores it).

    soft: elastic, any ``min_boards``..``max_boards`` boards (0: as many as the fleet has), the
    scheduler picks how many and which. hard: exactly ``boards`` (by name) or exactly ``count``.
    """

    kind: str = "soft"
    """soft or hard."""
    boards: list = field(default_factory=list)
    """Hard job: exactly these boards."""
    count: int = 0
    """Hard job: exactly this many boards, any of them."""
    min_boards: int = 1
    """Soft job: fewest boards it runs on."""
    max_boards: int = 0
    """Soft job: most boards it can use; 0: no limit."""
    priority: float = 1.0
    """Weight of this job's completion time in the scheduler's objective."""

    def __post_init__(self) -> None:
        require(self.kind in ("soft", "hard"), "kind", self.kind, "must be soft or hard")
        require(self.priority > 0, "priority", self.priority, "must be > 0")
        require(all(isinstance(b, str) and b for b in self.boards), "boards", self.boards,
                "must be a list of board names")
        require(len(set(self.boards)) == len(self.boards), "boards", self.boards, "must not repeat a board")
        if self.kind == "hard":
            require(bool(self.boards) != (self.count > 0), "kind", "hard",
                    "give exactly one of boards (names) or count (> 0)")
        else:
            require(not self.boards and self.count == 0, "kind", "soft",
                    "a soft job takes min_boards..max_boards; boards and count are for hard jobs")
            require(self.min_boards >= 1, "min_boards", self.min_boards, "must be >= 1")
            require(self.max_boards == 0 or self.max_boards >= self.min_boards, "max_boards",
                    self.max_boards, "must be 0 (no limit) or >= min_boards")
