"""What the coordinator asks of a board, and what a board reports back: plain data both roles use.

The coordinator builds these, edgetrain.serde turns them into wire messages and back, and the
board executes them; neither side handles protobuf messages beyond that boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgetrain.catalog import DatasetSpec


@dataclass(frozen=True)
class LocalWork:
    """A federated round's local training on the board."""

    steps: int
    """Local SGD steps."""
    batch_size: int
    """Samples per local step."""
    lr: float
    momentum: float
    weight_decay: float
    prox_mu: float
    """FedProx: weight of (mu / 2) * ||w - w_round||^2 (0: plain FedAvg)."""


@dataclass(frozen=True)
class StageHost:
    """A host of a pipeline stage and its rows of each micro-batch."""

    device_id: str
    address: str
    """host:port of its StagePeer endpoint."""
    rows: tuple[tuple[int, int], ...]
    """[begin, end) rows of each micro-batch it computes."""
    name: str = ""
    """The board's name as its fleet certificate names it: stage hosts accept tensors only from
    the boards their plan names ("" from an --insecure coordinator)."""
    channels: tuple[float, float] | None = None
    """A channel group member's share [begin, end) of each split layer's output channels
    (edgetrain.channels; it computes every row); None for a host splitting by rows."""

    @property
    def member(self) -> tuple[tuple[float, float], bool] | None:
        """A channel group member's (share of the channels, whether it leads the group), as
        `edgetrain.updates.UpdateFormats` takes it; None for a host splitting by rows."""
        return None if self.channels is None else (self.channels, self.sends)

    @property
    def sends(self) -> bool:
        """Whether this host sends the stage's tensors to neighbouring stages: every host of a
        sample-split group, only the leader of a channel group (its members hold the same)."""
        return self.channels is None or self.channels[0] == 0.0


@dataclass(frozen=True)
class StageWork:
    """A board's pipeline stage in one step attempt."""

    pipeline: int
    stage: int
    stages: int
    first_block: int
    end_block: int
    """The stage's blocks [first_block, end_block) of the model's block list."""
    schedule: str
    """gpipe or 1f1b."""
    indices: tuple[int, ...]
    """The pipeline's samples, in micro-batch order."""
    microbatch_sizes: tuple[int, ...]
    hosts: tuple[StageHost, ...]
    """This stage's hosts (the board is one of them)."""
    prev_hosts: tuple[StageHost, ...]
    next_hosts: tuple[StageHost, ...]
    pipeline_samples: int
    """Samples of the whole pipeline: each micro-batch's loss is divided by it."""
    timeout_s: float
    """Longest wait for a neighbour."""
    owned: bool = False
    """The host holds the stage's parameters and optimizer state (it uploads no stage gradients)."""
    lr: float = 0.0
    """The step's learning rate (an owned stage applies it)."""
    commit_step: int = -1
    commit_attempt: int = 0
    """The last committed step and its attempt: an owned stage applies that attempt's gradients."""

    def host(self, device_id: str) -> StageHost | None:
        """This stage's host registered as `device_id` (None if it hosts no part of it)."""
        return next((h for h in self.hosts if h.device_id == device_id), None)


@dataclass(frozen=True)
class Assignment:
    """One board's work in a step attempt."""

    step: int
    attempt: int
    param_version: int
    indices: tuple[int, ...]
    """The samples it computes (a federated round: those its local training reads)."""
    augment: bool
    data_seed: int
    codec: str = "none"
    """Codec of the update (edgetrain.compression)."""
    delta_codec: str = ""
    """Non-empty: the board may download parameter deltas in this codec."""
    local: LocalWork | None = None
    """Set for a federated round."""
    stage: StageWork | None = None
    """Set for a pipeline stage."""


@dataclass(frozen=True)
class Finished:
    """The job is over; boards stop working for it."""

    reason: str


@dataclass(frozen=True)
class StepReport:
    """What a board says about the update it uploads."""

    samples: int
    loss: float
    """Mean loss over its samples."""
    correct: int
    compute_s: float
    download_s: float = 0.0
    encode_s: float = 0.0
    energy_j: float | None = None
    """Energy it used for the step; None when it cannot tell."""
    wait_s: float = 0.0
    """Pipeline stages: seconds waiting for neighbours."""
    peak_activation_bytes: int = 0
    peer_bytes: int = 0
    """Pipeline stages: activation bytes sent to neighbours."""
    upload_exposed_s: float = 0.0
    """A streamed upload (sent during backward): seconds from the end of compute to its last byte
    sent, the part of the upload backward did not hide; 0 for an upload sent after compute."""
    download_overlap_s: float = 0.0
    """A download that ran while the board computed (edge_client.arriving): the seconds of it the
    compute did not wait for; `download_s` is then only the part it waited for."""
    download_streamed: bool = False
    """This step's full parameter download ran under the compute (the board's choice; its
    measured overlap is `download_overlap_s`)."""

    def check(self) -> None:
        """ValueError unless every figure is finite and every duration >= 0 (what the coordinator
        accepts; a board reports what it measured, even a diverged loss)."""
        timings = (self.compute_s, self.download_s, self.encode_s, self.wait_s, self.upload_exposed_s,
                   self.download_overlap_s)
        if not all(math.isfinite(t) and t >= 0 for t in timings):
            raise ValueError(f"step report timings must be finite and >= 0, got {timings}")
        if not math.isfinite(self.loss):
            raise ValueError(f"step report loss must be finite, got {self.loss}")
        if self.energy_j is not None and not (math.isfinite(self.energy_j) and self.energy_j >= 0):
            raise ValueError(f"step report energy_j must be finite and >= 0, got {self.energy_j}")


STREAM_MODES = ("on", "off", "auto")
"""`BoardJob.stream_upload`'s and `stream_download`'s values (a value a board does not know counts as "off")."""


@dataclass(frozen=True)
class BoardJob:
    """The job as a board needs it: model, data, and how to talk to the coordinator."""

    job_id: str
    model: str
    num_classes: int
    dataset: DatasetSpec
    """The job's dataset, read from the board's own data directory."""
    profile_batch_sizes: tuple[int, ...]
    """Batch sizes the board times itself at when it joins."""
    heartbeat_interval_s: float
    chunk_bytes: int
    max_forward_batch: int
    """Most samples per forward pass (larger shards go in chunks; 0: no chunking)."""
    error_feedback: bool
    """Keep what a lossy uplink codec did not send and add it to the next update."""
    board_momentum: float
    """Momentum the board accumulates itself (momentum correction); 0: the coordinator's."""
    device: str = "cpu"
    """Where the board trains: cpu, auto (CUDA when it has it) or cuda (job key `device`)."""
    stream_upload: str = "off"
    """Upload a data-parallel shard's uncompressed gradients as backward produces them: "on",
    "off" or "auto" (while the board's uploads wait on its link; job key `training.stream_upload`)."""
    stream_download: str = "off"
    """Run each block of a data-parallel shard's forward pass as soon as its parameters have
    arrived, the download going on meanwhile: "on", "off" or "auto" (while the board's downloads
    wait on its link; job key `training.stream_download`)."""
    class_names: tuple[str, ...] = ()
    """The dataset's class names in label order: a board with its own images maps its class
    folders onto them by name."""
    share_class_counts: bool = True
    """A board with its own images reports its samples per class (job key `privacy.class_counts`)."""


@dataclass(frozen=True)
class BoardProfile:
    """What a board measured about itself when it joined a job."""

    timings: tuple[tuple[int, float], ...]
    """(batch size, seconds of one forward + backward) on the job's model."""
    memory_total_bytes: int
    """Physical memory of the board."""
    memory_available_bytes: int
    """Memory available when it profiled."""
    peak_rss_bytes: int
    """Resident memory of the client after profiling."""
    local_samples: int = 0
    """Samples of the board's own data, which it trains on alone (0: it trains on the job's dataset)."""
    local_class_counts: tuple[int, ...] = ()
    """Its own samples per class of the job's dataset (empty: not shared, or no own data)."""
    device: str = "cpu"
    """Where it trains and profiled (e.g. "cuda:0 Orin (shares memory)"); `timings` are there."""
    device_memory_bytes: int = 0
    """Free memory of a GPU with memory of its own when it profiled (0: it trains in the board's
    memory, `memory_available_bytes`)."""
    copy_s_per_byte: float = 0.0
    """Seconds per byte to move a tensor to its device and back (0 on a CPU): what every byte it
    sends or receives costs it besides its link."""

    def __post_init__(self) -> None:
        if not self.timings or any(b <= 0 or not (s > 0 and math.isfinite(s)) for b, s in self.timings):
            raise ValueError(f"a profile needs timings with batch_size > 0 and finite seconds > 0, "
                             f"got {self.timings}")


@dataclass(frozen=True)
class StateRequest:
    """The coordinator's hand-over (LoadState) or pull (PullState) of a stage a board owns."""

    job_id: str
    first_block: int
    end_block: int
    version: int
    """Parameters as they are before step `version` (after `version` committed steps)."""
    commit_step: int = -1
    commit_attempt: int = 0
    """The step committed last and the attempt whose gradients count (-1: none)."""
    supersede_attempt: int = 0
    """Attempts of step `version` before this one are over."""
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    """LoadState: the SGD the board applies to the stage."""
    release: bool = False
    """PullState: the board gives the stage up after sending it."""
    offset: int = 0
    """PullState: resume an interrupted pull from this byte."""
