"""Job configuration: keyword-only dataclasses checked at construction, loaded from YAML.

A job file has four sections, each optional:

```yaml
name: demo
model: mobilenet_v2            # resnet18 | mobilenet_v2 | small_cnn
dataset: {name: synthetic, train_size: 20000, test_size: 1000, seed: 0, augment: true}
device: cpu                    # cpu | auto (CUDA when the board has it) | cuda
training: {global_batch: 64, steps: 300, split: proportional, min_clients: 4, eval_every: 50,
           time_limit_s: 0, start_grace_s: 0}
optimizer: {lr: 0.05, momentum: 0.9, weight_decay: 5.0e-4, schedule: cosine, warmup_steps: 10}
aggregation: {rule: mean, deadline: none, clip_norm: 0, outlier_factor: 0}
compression: {uplink: none, downlink: none}
federated: {local_steps: 5, local_batch: 16, partitions: 0, partitioning: iid, clients_per_round: 0}   # fedavg / fedprox
```

Errors name the file, the key and the bad value.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgetrain.catalog import FULL_TRAIN_SIZE, MODEL_NAMES, DatasetSpec, parse_codec
from edgetrain.plan import SCHEDULES as PIPELINE_SCHEDULES
from edgetrain.plan import Plan, plan_from_dict

SPLITS = ("proportional", "equal")
SCHEDULES = ("cosine", "constant", "step")
RULES = ("mean", "staleness", "fedavg", "fedprox")
DEADLINES = ("none", "predicted")
DEVICES = ("cpu", "auto", "cuda")


class ConfigError(ValueError):
    """A job file or override that cannot be used; the message names file, key and value."""


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """SGD with momentum and weight decay, applied by the coordinator, and its LR schedule."""

    lr: float = 0.05
    """Peak learning rate (for the global batch)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 5e-4
    """L2 weight decay."""
    nesterov: bool = False
    """Nesterov momentum."""
    schedule: str = "cosine"
    """cosine (to 0 at the last step), constant, or step (x0.1 at 50% and 75% of the steps)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", self.lr, "must be > 0")
        _require(0 <= self.momentum < 1, "momentum", self.momentum, "must be in [0, 1)")
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _require(self.schedule in SCHEDULES, "schedule", self.schedule, f"must be one of {SCHEDULES}")
        _require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    """How the coordinator drives synchronous data-parallel training."""

    global_batch: int = 64
    """Samples per step across all devices."""
    steps: int = 300
    """Number of optimizer steps (the most, with target_accuracy)."""
    epochs: float = 0.0
    """Train this many passes over the training set instead: steps = ceil(epochs x training
    samples / global_batch) (0: use steps)."""
    target_accuracy: float = 0.0
    """Stop after an evaluation (eval_every) reaching this test accuracy (0: train all steps)."""
    split: str = "proportional"
    """proportional: batch shares follow measured speed; equal: the framework-default baseline."""
    min_clients: int = 1
    """Training starts once this many clients have registered and profiled (see start_grace_s)."""
    start_grace_s: float = 0.0
    """0: wait for min_clients however long it takes. > 0 (at least 1): once this many seconds
    passed waiting, start with the boards that are there, if at least one has profiled (a board
    that did not come up does not hold a real fleet's job forever); later boards join as usual."""
    time_limit_s: float = 0.0
    """Stop the job cleanly — final evaluation, checkpoint, summary — once this many seconds of
    training passed (the sum of step times, as summary.json's train_seconds counts them: evaluations
    and checkpoints are not training); 0: no limit. summary.json's stop_reason says time_limit."""
    eval_every: int = 50
    """Evaluate on the test set every this many steps (and after the last step); 0: only at the end."""
    checkpoint_every: int = 0
    """Also write a checkpoint every this many steps (0: not by steps). A checkpoint is always
    written after the last step, and when the target accuracy ends the job early."""
    checkpoint_every_s: float = 60.0
    """Write a checkpoint once this many seconds of training passed since the last one (checked
    after each step; 0: not by time). A coordinator that dies loses at most about this much
    training, plus a step; `--resume` continues from the newest complete checkpoint."""
    step_timeout_s: float = 0.0
    """Give up on a device's contribution after this long; 0: 3x the predicted step time + 10 s."""
    heartbeat_interval_s: float = 1.0
    """How often clients send heartbeats."""
    heartbeat_timeout_s: float = 10.0
    """A device silent for this long is considered gone."""
    max_attempts: int = 5
    """How often one step may be redone (after devices failed) before the job gives up."""
    chunk_bytes: int = 512 * 1024
    """Chunk size for parameter and gradient streams (256 KiB - 1 MiB is fastest)."""
    log_every: int = 10
    """Print a progress line every this many steps."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to runs/<name>/tensorboard/ (`tensorboard --logdir runs`)."""
    max_forward_batch: int = 64
    """Most samples a board puts through the model at once: a larger shard is computed in equal
    chunks of at most this size, gradients accumulated, in a fraction of the memory. Each pass
    has a fixed cost, and one too large for the CPU's caches costs more per sample: which size is
    fastest depends on the model and the board (scripts/bench_forward_batch.py times it:
    docs/benchmarks.md#forward_batch). 0: a whole shard at once."""
    stream_upload: bool | str = "auto"
    """Whether a board computing a data-parallel shard with an uncompressed update uploads its
    gradients as backward produces them (last layer first, as DDP's buckets), so the upload runs
    under the backward pass instead of after it. true: always; false: the whole update after
    compute; auto: each board streams while its uploads wait on the link rather than on its CPU
    (a transfer bound by the board's own CPU has nothing to hide and gained nothing; see
    edge_client.streamed.StreamChoice). Either way the coordinator receives the same bytes."""

    stream_download: bool | str = "auto"
    """Whether a board computing a data-parallel shard starts before its parameter download has
    ended: the parameters are served buffers first, then in the order the forward pass meets them,
    and each block runs as soon as its own are in, so the download runs under the batch's making
    and the forward pass instead of before them. Every block computes on exactly the received
    values: the arithmetic is that of downloading first (edge_client.arriving). true: always;
    false: never; auto: each board streams while its downloads wait on the link rather than on its
    CPU (as `stream_upload`). Full downloads only; a board fetching deltas applies them first."""

    @property
    def stream_upload_mode(self) -> str:
        """`stream_upload` as "on", "off" or "auto"."""
        return _stream_mode(self.stream_upload)

    @property
    def stream_download_mode(self) -> str:
        """`stream_download` as "on", "off" or "auto"."""
        return _stream_mode(self.stream_download)

    def __post_init__(self) -> None:
        _require(self.global_batch > 0, "global_batch", self.global_batch, "must be > 0")
        _require(self.steps > 0, "steps", self.steps, "must be > 0")
        _require(self.epochs >= 0, "epochs", self.epochs, "must be >= 0")
        _require(0 <= self.target_accuracy <= 1, "target_accuracy", self.target_accuracy, "must be in [0, 1]")
        _require(not self.target_accuracy or self.eval_every > 0, "target_accuracy", self.target_accuracy,
                 "needs eval_every > 0 (the accuracy is checked at each evaluation)")
        _require(self.split in SPLITS, "split", self.split, f"must be one of {SPLITS}")
        _require(self.min_clients >= 1, "min_clients", self.min_clients, "must be >= 1")
        _require(self.eval_every >= 0, "eval_every", self.eval_every, "must be >= 0")
        _require(self.start_grace_s == 0 or 1 <= self.start_grace_s < math.inf, "start_grace_s", self.start_grace_s,
                 "must be 0 (wait for min_clients) or >= 1 (seconds)")
        _require(math.isfinite(self.time_limit_s) and self.time_limit_s >= 0, "time_limit_s", self.time_limit_s,
                 "must be >= 0 (0: no limit)")
        _require(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, "must be >= 0")
        _require(self.checkpoint_every_s >= 0, "checkpoint_every_s", self.checkpoint_every_s,
                 "must be >= 0 (0: no checkpoints by time)")
        _require(self.step_timeout_s >= 0, "step_timeout_s", self.step_timeout_s, "must be >= 0")
        _require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", self.heartbeat_interval_s,
                 "must be > 0")
        _require(self.heartbeat_timeout_s > self.heartbeat_interval_s, "heartbeat_timeout_s",
                 self.heartbeat_timeout_s, "must exceed heartbeat_interval_s")
        _require(self.max_attempts >= 1, "max_attempts", self.max_attempts, "must be >= 1")
        _require(4096 <= self.chunk_bytes <= 1024 * 1024, "chunk_bytes", self.chunk_bytes,
                 "must be in [4096, 1048576]")
        _require(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        _require(self.max_forward_batch >= 0, "max_forward_batch", self.max_forward_batch, "must be >= 0")
        _require(isinstance(self.stream_upload, bool) or self.stream_upload == "auto", "stream_upload",
                 self.stream_upload, "must be true, false or auto")
        _require(isinstance(self.stream_download, bool) or self.stream_download == "auto", "stream_download",
                 self.stream_download, "must be true, false or auto")


def _stream_mode(value: bool | str) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else value


@dataclass(kw_only=True, frozen=True)
class AggregationConfig:
    """How the coordinator combines what boards send, and which updates it refuses."""

    rule: str = "mean"
    """mean: sample-weighted average of this step's updates (synchronous); staleness: also use
    updates that arrive up to `staleness_bound` steps late, weighted by (1 + tau)^-staleness_exponent
    (FedBuff); fedavg / fedprox: federated rounds of local training (see the federated section)."""
    staleness_bound: int = 8
    """An update computed on parameters more than this many steps old is dropped: a late one under
    the staleness rule, and a local update from a board beside the steps of a planned job (whose
    work is sized to arrive within it)."""
    staleness_exponent: float = 0.5
    """staleness rule: weight s(tau) = (1 + tau)^-p of an update tau steps late."""
    deadline: str = "none"
    """none: wait for every board (a board that dies makes the step redo); predicted: close the
    step at deadline_factor x the predicted time of the typical (median) board, so one slow board
    cannot hold the fleet. The staleness rule always uses the predicted deadline."""
    deadline_factor: float = 1.5
    """predicted deadline: multiple of the step's predicted time (plus deadline_slack_s)."""
    deadline_slack_s: float = 0.5
    """predicted deadline: seconds added to the scaled prediction (absorbs jitter on short steps)."""
    min_fraction: float = 0.5
    """predicted deadline: the step is applied when at least this fraction of its samples arrived
    in time; otherwise it is redone."""
    clip_norm: float = 0.0
    """Scale down any board's update whose L2 norm exceeds this (0: no clipping)."""
    outlier_factor: float = 0.0
    """Reject an update whose norm exceeds this multiple of the median norm of the step's updates
    (needs 3 or more updates in the step; 0: off)."""
    quarantine_after: int = 3
    """A board whose updates were rejected this many times within quarantine_window steps gets no
    work for quarantine_steps steps."""
    quarantine_window: int = 20
    """Steps over which rejections are counted."""
    quarantine_steps: int = 50
    """How long a quarantined board gets no work."""

    def __post_init__(self) -> None:
        _require(self.rule in RULES, "rule", self.rule, f"must be one of {RULES}")
        _require(self.staleness_bound >= 0, "staleness_bound", self.staleness_bound, "must be >= 0")
        _require(self.staleness_exponent >= 0, "staleness_exponent", self.staleness_exponent, "must be >= 0")
        _require(self.deadline in DEADLINES, "deadline", self.deadline, f"must be one of {DEADLINES}")
        _require(self.deadline_factor >= 1, "deadline_factor", self.deadline_factor, "must be >= 1")
        _require(self.deadline_slack_s >= 0, "deadline_slack_s", self.deadline_slack_s, "must be >= 0")
        _require(0 < self.min_fraction <= 1, "min_fraction", self.min_fraction, "must be in (0, 1]")
        _require(self.clip_norm >= 0, "clip_norm", self.clip_norm, "must be >= 0 (0 disables)")
        _require(self.outlier_factor == 0 or self.outlier_factor > 1, "outlier_factor", self.outlier_factor,
                 "must be > 1 (0 disables)")
        _require(self.quarantine_after >= 1, "quarantine_after", self.quarantine_after, "must be >= 1")
        _require(self.quarantine_window >= 1, "quarantine_window", self.quarantine_window, "must be >= 1")
        _require(self.quarantine_steps >= 0, "quarantine_steps", self.quarantine_steps, "must be >= 0")

    @property
    def federated(self) -> bool:
        """Whether boards train locally for several steps per round (FedAvg / FedProx)."""
        return self.rule in ("fedavg", "fedprox")


@dataclass(kw_only=True, frozen=True)
class CompressionConfig:
    """What travels over each board's link: gradient codec up, parameter encoding down."""

    uplink: str = "none"
    """Codec for updates: none, fp16, bf16, int8, powersgd[:rank], topk[:ratio] (error feedback on
    the board), or adaptive: per board, from its measured bandwidth (see adaptive_budget)."""
    downlink: str = "none"
    """none: boards download full float32 parameters; fp16, bf16, int8 or topk[:ratio]: boards that
    hold a recent version download the compressed deltas since (error feedback at the coordinator)."""
    error_feedback: bool = True
    """Keep what a lossy uplink codec did not send on the board and add it to the next update."""
    momentum_correction: str = "auto"
    """on: boards accumulate the optimizer's momentum themselves and the coordinator applies plain
    SGD (Deep Gradient Compression: with sparse updates, momentum at the coordinator would
    multiply every late-sent coordinate ~1/(1 - m) times); top-k also clears a coordinate's
    momentum once it was sent. auto: on for top-k and adaptive uplinks. off: momentum stays at
    the coordinator."""
    topk_ratio: float = 0.01
    """Fraction kept by the top-k codec when adaptive chooses it."""
    powersgd_rank: int = 4
    """Rank of the PowerSGD codec when adaptive chooses it."""
    adaptive_budget: float = 0.25
    """adaptive: the least lossy codec whose predicted transfer time per step is within this
    fraction of the step's predicted compute time (else the most compressing one)."""
    adaptive_limit: float = 1.0
    """adaptive: when nothing fits the budget, a dense codec (fp16, int8) is still preferred to
    PowerSGD, and PowerSGD to top-k, while its transfer time stays within this multiple of the
    compute time."""
    hysteresis: float = 0.3
    """adaptive: a board's codec is chosen again only after its bandwidth moved by more than this
    fraction since the last choice (noise does not make it flip)."""

    @property
    def boards_keep_momentum(self) -> bool:
        """Whether momentum is accumulated on the boards (momentum correction) for this job."""
        if self.momentum_correction == "auto":
            return self.uplink == "adaptive" or self.uplink.startswith("topk")
        return self.momentum_correction == "on"

    def __post_init__(self) -> None:
        for key in ("uplink", "downlink"):
            value = getattr(self, key)
            if key == "uplink" and value == "adaptive":
                continue
            try:
                parse_codec(value)
            except ValueError as e:
                raise ConfigError(f"{key}={value!r}: {e}") from None
        _require(0 < self.topk_ratio <= 1, "topk_ratio", self.topk_ratio, "must be in (0, 1]")
        _require(isinstance(self.powersgd_rank, int) and not isinstance(self.powersgd_rank, bool)
                 and self.powersgd_rank >= 1, "powersgd_rank", self.powersgd_rank, "must be an integer >= 1")
        _require(self.momentum_correction in ("auto", "on", "off"), "momentum_correction",
                 self.momentum_correction, "must be auto, on or off")
        _require(self.adaptive_budget > 0, "adaptive_budget", self.adaptive_budget, "must be > 0")
        _require(self.adaptive_limit >= self.adaptive_budget, "adaptive_limit", self.adaptive_limit,
                 "must be >= adaptive_budget")
        _require(self.hysteresis >= 0, "hysteresis", self.hysteresis, "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class FederatedConfig:
    """Federated rounds (rule fedavg / fedprox): each board trains locally on its own partition."""

    local_steps: int = 5
    """Local SGD steps per round on each board."""
    local_batch: int = 16
    """Local batch size."""
    partitions: int = 0
    """The training set is split into this many disjoint partitions, one per board in order of
    arrival (0: training.min_clients)."""
    partitioning: str = "iid"
    """How (edgetrain.partition): iid (a seeded permutation dealt round-robin), dirichlet (each
    class spread over the partitions by Dirichlet(dirichlet_alpha) fractions: non-IID) or classes
    (each partition holds classes_per_partition classes only)."""
    dirichlet_alpha: float = 0.5
    """dirichlet: concentration; small (0.1) is very skewed, large (100) is close to iid."""
    classes_per_partition: int = 2
    """classes: how many classes each partition holds."""
    clients_per_round: int = 0
    """Partial participation: each round trains on this many of the boards holding a partition,
    drawn at random (seeded by the job's seed and the round); 0: all of them."""
    prox_mu: float = 0.01
    """fedprox: weight mu of the proximal term (mu / 2) * ||w - w_round||^2."""
    server_lr: float = 1.0
    """The coordinator moves the model by server_lr times the averaged update (1: plain FedAvg)."""
    server_momentum: float = 0.0
    """Outer momentum (Nesterov) on the averaged update, as DiLoCo applies it (0: none; DiLoCo
    uses 0.9 with server_lr 0.7)."""
    local_time_s: float = 0.0
    """Each round every board trains for this many seconds at its own measured speed: a fast board
    takes more local steps than a slow one (at least 1; local_steps is then unused). 0: every board
    takes local_steps."""
    normalize: bool = False
    """FedNova: each board's update is divided by its local steps and the average is scaled by the
    data-weighted mean of the steps, so boards that took more steps do not pull the model towards
    their own data (needed when boards take unequal local steps, as with local_time_s)."""

    def __post_init__(self) -> None:
        _require(self.local_steps >= 1, "local_steps", self.local_steps, "must be >= 1")
        _require(0 <= self.server_momentum < 1, "server_momentum", self.server_momentum, "must be in [0, 1)")
        _require(self.local_time_s >= 0, "local_time_s", self.local_time_s, "must be >= 0 (0: local_steps)")
        _require(self.local_batch >= 1, "local_batch", self.local_batch, "must be >= 1")
        _require(self.partitions >= 0, "partitions", self.partitions, "must be >= 0")
        _require(self.partitioning in ("iid", "dirichlet", "classes"), "partitioning", self.partitioning,
                 "must be iid, dirichlet or classes")
        _require(self.dirichlet_alpha > 0, "dirichlet_alpha", self.dirichlet_alpha, "must be > 0")
        _require(self.classes_per_partition >= 1, "classes_per_partition", self.classes_per_partition, "must be >= 1")
        _require(self.clients_per_round >= 0, "clients_per_round", self.clients_per_round, "must be >= 0")
        _require(self.prox_mu >= 0, "prox_mu", self.prox_mu, "must be >= 0")
        _require(self.server_lr > 0, "server_lr", self.server_lr, "must be > 0")


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
        _require(self.stage_state in ("hosts", "coordinator"), "stage_state", self.stage_state,
                 "must be hosts or coordinator")
        _require(self.sync_every >= 1, "sync_every", self.sync_every, "must be >= 1")

        _require(self.microbatches >= 1, "microbatches", self.microbatches, "must be >= 1")
        _require(self.schedule in PIPELINE_SCHEDULES, "schedule", self.schedule,
                 f"must be one of {PIPELINE_SCHEDULES}")
        _require(0 <= self.dp_share < 1, "dp_share", self.dp_share, "must be in [0, 1)")
        _require(not self.dp_boards or self.dp_share > 0, "dp_share", self.dp_share,
                 "must be > 0 when dp_boards are given (their share of the global batch)")
        _require(self.stage_timeout_s > 0, "stage_timeout_s", self.stage_timeout_s, "must be > 0")
        _require(not (self.stages and self.plan_file), "plan_file", self.plan_file,
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
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return plan_from_dict(data if data is not None else {}, where=str(path))
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
        _require(ok, "objective", self.objective, "must be time, energy or a weight in [0, 1]")
        _require(self.bandwidth_change > 0, "bandwidth_change", self.bandwidth_change, "must be > 0")
        _require(0 <= self.min_gain < 1, "min_gain", self.min_gain, "must be in [0, 1)")
        _require(0 <= self.battery_floor <= 100, "battery_floor", self.battery_floor, "must be in [0, 100]")
        _require(self.overrun > 0, "overrun", self.overrun, "must be > 0")
        _require(self.link_wait_s >= 0, "link_wait_s", self.link_wait_s, "must be >= 0")
        _require(isinstance(self.trial_steps, int) and self.trial_steps >= 0, "trial_steps", self.trial_steps,
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
        _require(self.kind in ("soft", "hard"), "kind", self.kind, "must be soft or hard")
        _require(self.priority > 0, "priority", self.priority, "must be > 0")
        _require(all(isinstance(b, str) and b for b in self.boards), "boards", self.boards,
                 "must be a list of board names")
        _require(len(set(self.boards)) == len(self.boards), "boards", self.boards, "must not repeat a board")
        if self.kind == "hard":
            _require(bool(self.boards) != (self.count > 0), "kind", "hard",
                     "give exactly one of boards (names) or count (> 0)")
        else:
            _require(not self.boards and self.count == 0, "kind", "soft",
                     "a soft job takes min_boards..max_boards; boards and count are for hard jobs")
            _require(self.min_boards >= 1, "min_boards", self.min_boards, "must be >= 1")
            _require(self.max_boards == 0 or self.max_boards >= self.min_boards, "max_boards",
                     self.max_boards, "must be 0 (no limit) or >= min_boards")


@dataclass(kw_only=True, frozen=True)
class PrivacyConfig:
    """What a board that trains on its own images (`edgetrain client --local-data`) tells the
    gateway besides its model updates (docs/design.md, "Data that stays on the board")."""

    class_counts: bool = True
    """Report how many of its images it holds per class (shown in the dashboard and report, and
    logged); false: only its sample count leaves the board."""


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """One training job: model, data, training loop and optimizer."""

    name: str = "demo"
    """Job name; results go to runs/<name>/."""
    model: str = "mobilenet_v2"
    """Model name (see edgetrain.catalog.MODEL_NAMES)."""
    seed: int = 0
    """Seed for the model's initial parameters and the sample order."""
    device: str = "cpu"
    """Where boards train: cpu; auto (CUDA when the board has it, e.g. a Jetson, else CPU); cuda
    (a board without CUDA cannot work for the job: it stops with one line before it trains).
    Boards profile on that device (speed, host<->device copies, free memory), so the split and
    the planner's stage placement follow; data-parallel shards, federated rounds and pipeline
    stages all run there."""
    dataset: DatasetSpec = field(default_factory=lambda: DatasetSpec(name="synthetic"))
    """Training and test data: the coordinator evaluates on its test split and serves boards the
    training samples they need; a board with its own images (--local-data) trains on those."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Training loop settings."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings (the boards' local optimizer in federated rounds)."""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    """How updates are combined and which are refused."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Codecs on the links."""
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    """Local training settings for federated rules."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline model parallelism (empty: data parallelism only)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Hybrid mode: stages and DP shards planned from the live fleet, re-planned as it changes."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """What the job asks of a fleet shared with other jobs (edgetrain submit)."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    """What boards training on their own images report about them."""

    def __post_init__(self) -> None:
        _require(self.model in MODEL_NAMES, "model", self.model, f"must be one of {MODEL_NAMES}")
        if self.training.epochs:
            samples = self.dataset.train_size or FULL_TRAIN_SIZE
            steps = max(1, math.ceil(self.training.epochs * samples / self.training.global_batch))
            object.__setattr__(self, "training", dataclasses.replace(self.training, steps=steps))
        _require(not (self.planner.enabled and self.pipeline.enabled), "planner.enabled", True,
                 "the planner makes the plan: leave pipeline.stages and pipeline.plan_file empty")
        _require(not (self.planner.enabled and self.aggregation.federated), "planner.enabled", True,
                 "hybrid plans are for data-parallel and pipeline training, not federated rounds")
        _require(not (self.pipeline.enabled and self.aggregation.federated), "aggregation.rule", self.aggregation.rule,
                 "federated rounds train the whole model on each board: leave the pipeline section out")
        agg = self.aggregation
        if (self.pipeline.enabled or self.planner.enabled) and self.pipeline.stage_state == "hosts":
            _require(agg.rule == "mean" and agg.deadline == "none" and not agg.clip_norm, "pipeline.stage_state",
                     "hosts", "stage hosts apply their own gradients, so every step must be all or nothing and "
                     "unclipped: use aggregation rule mean without deadline or clip_norm, or "
                     "pipeline.stage_state: coordinator")
        _require(self.device in DEVICES, "device", self.device, f"must be one of {DEVICES}")
        _require(bool(self.name) and "/" not in self.name, "name", self.name,
                 "must be a non-empty name without '/'")


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _build(cls: type, data: Any, where: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, checking keys and value types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{where + ': ' if where else ''}unknown key {key!r} (known: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, f"{where}.{key}" if where else key)
    missing = [f.name for f in fields.values() if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where or 'job'}: missing required key {missing[0]!r}")
    try:
        return cls(**kwargs)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def _coerce(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for typ in allowed:
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ in (str, bool, list) and isinstance(value, typ):
            return value
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{where}: expected {names}, got {type(value).__name__} {value!r}")


def job_from_dict(data: Any, *, source: str = "job") -> JobConfig:
    """A JobConfig from a parsed mapping; errors are prefixed with `source`."""
    try:
        return _build(JobConfig, data if data is not None else {}, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Load a job YAML file, apply dotted overrides (e.g. {"training.steps": 20}), validate."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        data = apply_overrides(data if data is not None else {}, overrides or {})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return job_from_dict(data, source=str(path))


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` with dotted keys set, e.g. {"training.steps": 20}."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}")
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = out
        for depth, key in enumerate(parents):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                where = ".".join(parents[: depth + 1])
                raise ConfigError(f"override {dotted}: {where} is {node!r}, not a section")
        node[leaf] = value
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` from the command line; the value is parsed as YAML (20 -> int)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. training.steps=20")
    value = yaml.safe_load(raw)
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string; users mean a number
        try:
            value = float(value)
        except ValueError:
            pass
    return key.strip(), value


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """Plain-data form of a job (for run directories and logs)."""
    return dataclasses.asdict(job)
