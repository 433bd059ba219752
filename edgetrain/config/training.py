"""How each step is computed, combined and carried: the optimizer, the training loop, the
aggregation rule, the codecs on the links and federated rounds (sections of a job file)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgetrain.catalog import parse_codec
from edgetrain.config.files import ConfigError, require

SPLITS = ("proportional", "equal")
SCHEDULES = ("cosine", "constant", "step")
RULES = ("mean", "staleness", "fedavg", "fedprox")
DEADLINES = ("none", "predicted")


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
        require(self.lr > 0, "lr", self.lr, "must be > 0")
        require(0 <= self.momentum < 1, "momentum", self.momentum, "must be in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(self.schedule in SCHEDULES, "schedule", self.schedule, f"must be one of {SCHEDULES}")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")


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
        require(self.global_batch > 0, "global_batch", self.global_batch, "must be > 0")
        require(self.steps > 0, "steps", self.steps, "must be > 0")
        require(self.epochs >= 0, "epochs", self.epochs, "must be >= 0")
        require(0 <= self.target_accuracy <= 1, "target_accuracy", self.target_accuracy, "must be in [0, 1]")
        require(not self.target_accuracy or self.eval_every > 0, "target_accuracy", self.target_accuracy,
                "needs eval_every > 0 (the accuracy is checked at each evaluation)")
        require(self.split in SPLITS, "split", self.split, f"must be one of {SPLITS}")
        require(self.min_clients >= 1, "min_clients", self.min_clients, "must be >= 1")
        require(self.eval_every >= 0, "eval_every", self.eval_every, "must be >= 0")
        require(self.start_grace_s == 0 or 1 <= self.start_grace_s < math.inf, "start_grace_s", self.start_grace_s,
                "must be 0 (wait for min_clients) or >= 1 (seconds)")
        require(math.isfinite(self.time_limit_s) and self.time_limit_s >= 0, "time_limit_s", self.time_limit_s,
                "must be >= 0 (0: no limit)")
        require(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, "must be >= 0")
        require(self.checkpoint_every_s >= 0, "checkpoint_every_s", self.checkpoint_every_s,
                "must be >= 0 (0: no checkpoints by time)")
        require(self.step_timeout_s >= 0, "step_timeout_s", self.step_timeout_s, "must be >= 0")
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", self.heartbeat_interval_s,
                "must be > 0")
        require(self.heartbeat_timeout_s > self.heartbeat_interval_s, "heartbeat_timeout_s",
                self.heartbeat_timeout_s, "must exceed heartbeat_interval_s")
        require(self.max_attempts >= 1, "max_attempts", self.max_attempts, "must be >= 1")
        require(4096 <= self.chunk_bytes <= 1024 * 1024, "chunk_bytes", self.chunk_bytes,
                "must be in [4096, 1048576]")
        require(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        require(self.max_forward_batch >= 0, "max_forward_batch", self.max_forward_batch, "must be >= 0")
        require(isinstance(self.stream_upload, bool) or self.stream_upload == "auto", "stream_upload",
                self.stream_upload, "must be true, false or auto")
        require(isinstance(self.stream_download, bool) or self.stream_download == "auto", "stream_download",
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
        require(self.rule in RULES, "rule", self.rule, f"must be one of {RULES}")
        require(self.staleness_bound >= 0, "staleness_bound", self.staleness_bound, "must be >= 0")
        require(self.staleness_exponent >= 0, "staleness_exponent", self.staleness_exponent, "must be >= 0")
        require(self.deadline in DEADLINES, "deadline", self.deadline, f"must be one of {DEADLINES}")
        require(self.deadline_factor >= 1, "deadline_factor", self.deadline_factor, "must be >= 1")
        require(self.deadline_slack_s >= 0, "deadline_slack_s", self.deadline_slack_s, "must be >= 0")
        require(0 < self.min_fraction <= 1, "min_fraction", self.min_fraction, "must be in (0, 1]")
        require(self.clip_norm >= 0, "clip_norm", self.clip_norm, "must be >= 0 (0 disables)")
        require(self.outlier_factor == 0 or self.outlier_factor > 1, "outlier_factor", self.outlier_factor,
                "must be > 1 (0 disables)")
        require(self.quarantine_after >= 1, "quarantine_after", self.quarantine_after, "must be >= 1")
        require(self.quarantine_window >= 1, "quarantine_window", self.quarantine_window, "must be >= 1")
        require(self.quarantine_steps >= 0, "quarantine_steps", self.quarantine_steps, "must be >= 0")

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
        require(0 < self.topk_ratio <= 1, "topk_ratio", self.topk_ratio, "must be in (0, 1]")
        require(isinstance(self.powersgd_rank, int) and not isinstance(self.powersgd_rank, bool)
                and self.powersgd_rank >= 1, "powersgd_rank", self.powersgd_rank, "must be an integer >= 1")
        require(self.momentum_correction in ("auto", "on", "off"), "momentum_correction",
                self.momentum_correction, "must be auto, on or off")
        require(self.adaptive_budget > 0, "adaptive_budget", self.adaptive_budget, "must be > 0")
        require(self.adaptive_limit >= self.adaptive_budget, "adaptive_limit", self.adaptive_limit,
                "must be >= adaptive_budget")
        require(self.hysteresis >= 0, "hysteresis", self.hysteresis, "must be >= 0")


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
        require(self.local_steps >= 1, "local_steps", self.local_steps, "must be >= 1")
        require(0 <= self.server_momentum < 1, "server_momentum", self.server_momentum, "must be in [0, 1)")
        require(self.local_time_s >= 0, "local_time_s", self.local_time_s, "must be >= 0 (0: local_steps)")
        require(self.local_batch >= 1, "local_batch", self.local_batch, "must be >= 1")
        require(self.partitions >= 0, "partitions", self.partitions, "must be >= 0")
        require(self.partitioning in ("iid", "dirichlet", "classes"), "partitioning", self.partitioning,
                "must be iid, dirichlet or classes")
        require(self.dirichlet_alpha > 0, "dirichlet_alpha", self.dirichlet_alpha, "must be > 0")
        require(self.classes_per_partition >= 1, "classes_per_partition", self.classes_per_partition, "must be >= 1")
        require(self.clients_per_round >= 0, "clients_per_round", self.clients_per_round, "must be >= 0")
        require(self.prox_mu >= 0, "prox_mu", self.prox_mu, "must be >= 0")
        require(self.server_lr > 0, "server_lr", self.server_lr, "must be > 0")
