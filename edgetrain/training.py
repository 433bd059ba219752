"""The training arithmetic both roles share, so distributed and reference runs match exactly.

A device computes the gradient of the *mean* loss over its local samples; the coordinator
combines devices' gradients weighted by samples / global batch, which equals the gradient of the
mean loss over the global batch. BatchNorm semantics (documented in the README): each device
normalises with its own shard's batch statistics (as DDP without SyncBatchNorm); the running
statistics it returns are averaged weighted by samples, which equals one running-statistics
update with the sample-weighted mean of the shards' batch statistics.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.config import OptimizerConfig
from edgetrain.data import make_batch

GRAD_PREFIX = "grad."
BUFFER_PREFIX = "buf."
MOMENTUM_PREFIX = "momentum/"
"""SGD momentum buffers of a pipeline stage's state travel as ``momentum/<parameter name>``."""


@dataclass
class ShardResult:
    """What one device computed on its share of a step."""

    loss: float
    """Mean loss over the shard."""
    correct: int
    """Correctly classified samples in the shard."""
    samples: int
    """Shard size."""
    tensors: dict[str, torch.Tensor]
    """Gradients (``grad.<param>``) and updated float buffers (``buf.<buffer>``)."""


def freeze_heap() -> None:
    """Exempt everything alive now (imports, model, dataset) from later full garbage collections.

    A full collection walks every tracked object: hundreds of thousands in a process that imported
    torch, grpc and the models, a noticeable pause on a board at a tenth of a core, and all boards
    reach it at about the same step into a job. Called once set-up is done, it leaves the collector
    only what the job allocates since.
    """
    gc.collect()
    gc.freeze()


def resolve_device(choice: str) -> torch.device:
    """The torch device for a job's `device` key: cpu; auto: CUDA when this machine has it, else
    CPU; cuda: CUDA, or ValueError when this machine has none."""
    if choice == "cpu":
        return torch.device("cpu")
    if choice in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if choice == "cuda":
            raise ValueError("device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); "
                             "use device auto to fall back to CPU")
        return torch.device("cpu")
    raise ValueError(f"device must be cpu, auto or cuda, got {choice!r}")


def runtime(device: torch.device | None = None) -> str:
    """One line naming torch, the training device and its CUDA: what a board says when it starts
    (`device` None: what it could train on)."""
    cuda = torch.version.cuda
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind = "shares the board's memory" if props.is_integrated else f"{props.total_memory / 2**30:.1f} GiB"
        where = f"device {device} ({props.name}, {kind}), CUDA {cuda}"
    elif cuda:
        where = f"device {device}, CUDA {cuda} built in but {'not used' if torch.cuda.is_available() else 'no GPU found'}"
    else:
        where = f"device {device}, a CPU-only torch (no CUDA)"
    return f"torch {torch.__version__}, {where}"


def exact_arithmetic() -> None:
    """Make a GPU compute what a CPU does, up to float32 rounding: no TF32 (Ampere and Orin use it
    for convolutions by default) and deterministic kernels. Slower: for checking a GPU board
    against single-process training, not for everyday jobs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


class DeviceCopies:
    """How tensors cross between the host (where the wire and the data are) and the device a board
    trains on. On the CPU nothing is copied. A discrete GPU gets received tensors through pinned
    host memory with a non-blocking copy, so the transfer runs while the host goes on; a GPU that
    shares the board's memory (a Jetson: `is_integrated`) gets a plain copy, since staging would
    only add one. Results come back to the host in one (synchronising) copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.discrete = device.type == "cuda" and not torch.cuda.get_device_properties(device).is_integrated

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the training device."""
        if tensor.device.type == self.device.type:  # a board trains on one device of a kind
            return tensor
        if self.discrete and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    @staticmethod
    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in host memory (what the wire packs)."""
        return tensor if tensor.device.type == "cpu" else tensor.cpu()


def model_device(model: nn.Module) -> torch.device:
    """The device the model's parameters are on."""
    return next(model.parameters()).device


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything a device needs to reproduce the model: buffers then parameters, each in the order
    the forward pass meets them, by name (in CPU memory: what is serialised; a CPU model's tensors
    are shared, not copied). In that order a board receiving them can load the few small buffers
    first and run each block as soon as its parameters are in (edge_client.arriving)."""
    out = {name: b.detach().cpu() for name, b in model.named_buffers()}
    out.update({name: p.detach().cpu() for name, p in model.named_parameters()})
    return out


@torch.no_grad()
def load_state_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy received parameters and buffers into `model` in place."""
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    for name, value in tensors.items():
        targets[name].copy_(value)


def shard_tensor_names(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(wire name, template tensor) of what a device uploads: gradients, then float buffers."""
    out = [(GRAD_PREFIX + name, p) for name, p in model.named_parameters()]
    out += [(BUFFER_PREFIX + name, b) for name, b in model.named_buffers() if b.is_floating_point()]
    return out


def chunk_bounds(begin: int, end: int, max_batch: int) -> list[int]:
    """Boundaries of the fewest equal chunks (within one sample) of rows begin..end holding at
    most `max_batch` rows each (0: one chunk)."""
    n = end - begin
    chunks = -(-n // max_batch) if 0 < max_batch < n else 1
    return [begin + n * i // chunks for i in range(chunks + 1)]


def compute_shard(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_batch: int = 0, *,
                  before_last_backward: Callable[[], None] | None = None) -> ShardResult:
    """Forward + backward of the mean cross-entropy on one shard; returns grads and buffers.

    With `max_batch` > 0 a larger shard goes through the model in the fewest equal chunks of at
    most that many samples, gradients accumulated: the same gradient (up to float rounding) at a
    fraction of the memory, and on a CPU whose caches the activations outgrow, faster for some
    models and slower for others (scripts/bench_forward_batch.py; docs/benchmarks.md#forward_batch).
    BatchNorm then normalises each chunk with its own statistics (as each board does its shard),
    and the running statistics returned are the sample-weighted mean of the chunks' updates from
    the same start: one update with the chunks' mean statistics, as across boards.
    `before_last_backward` is called before the backward pass that makes the gradients final
    (a streamed upload sends them as that pass produces them).
    """
    model.train()
    model.zero_grad(set_to_none=True)
    device = model_device(model)
    x, y = x.to(device), y.to(device)  # no-ops on CPU
    n = int(y.numel())
    bounds = chunk_bounds(0, n, max_batch)
    chunks = len(bounds) - 1
    stats = [b for b in model.buffers() if b.is_floating_point()] if chunks > 1 else []
    start = [b.detach().clone() for b in stats]
    mixed = [torch.zeros_like(b) for b in stats]
    loss_sum, correct = 0.0, 0
    for begin, end in zip(bounds, bounds[1:]):
        xs, ys = x[begin:end], y[begin:end]
        with torch.no_grad():
            for b, b0 in zip(stats, start):
                b.copy_(b0)
        logits = model(xs)
        loss = nn.functional.cross_entropy(logits, ys) if chunks == 1 else (
            nn.functional.cross_entropy(logits, ys, reduction="sum") / n)
        if before_last_backward is not None and end == n:
            before_last_backward()
        loss.backward()
        loss_sum += float(loss.detach())
        correct += int((logits.argmax(dim=1) == ys).sum())
        with torch.no_grad():
            for b, acc in zip(stats, mixed):
                acc.add_(b, alpha=len(ys) / n)
    with torch.no_grad():
        for b, acc in zip(stats, mixed):
            b.copy_(acc)
    tensors = {}
    for wire_name, ref in shard_tensor_names(model):
        if wire_name.startswith(GRAD_PREFIX):
            grad = ref.grad if ref.grad is not None else torch.zeros_like(ref)
            tensors[wire_name] = grad.detach().cpu()
        else:
            tensors[wire_name] = ref.detach().cpu()
    return ShardResult(loss=loss_sum, correct=correct, samples=n, tensors=tensors)


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int, batch_size: int, lr: float,
                momentum: float = 0.0, weight_decay: float = 0.0, prox_mu: float = 0.0) -> ShardResult:
    """A federated round on one board: `steps` SGD steps over consecutive `batch_size` slices of
    (x, y), minimising loss + (prox_mu / 2) * ||w - w_round||^2 (FedProx; 0 gives FedAvg).

    Returns the parameter change w_round - w_local under the gradient names (so the coordinator
    applies it like a gradient: with server lr 1 the model becomes the weighted mean of the
    boards' local models) and the final float buffers. Loss and correct count are over the
    samples of the round, as they were seen.
    """
    device = model_device(model)
    x, y = x.to(device), y.to(device)  # no-ops on CPU
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    loss_sum, correct, seen = 0.0, 0, 0
    for i in range(steps):
        lo = (i * batch_size) % len(y)
        xb, yb = x[lo : lo + batch_size], y[lo : lo + batch_size]
        optimizer.zero_grad(set_to_none=True)
        logits = model(xb)
        loss = nn.functional.cross_entropy(logits, yb)
        loss.backward()
        if prox_mu:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.grad is not None:
                        p.grad.add_(p - start[name], alpha=prox_mu)
        optimizer.step()
        loss_sum += float(loss.detach()) * len(yb)
        correct += int((logits.detach().argmax(dim=1) == yb).sum())
        seen += len(yb)
    tensors = {}
    for wire_name, ref in shard_tensor_names(model):
        if wire_name.startswith(GRAD_PREFIX):
            name = wire_name[len(GRAD_PREFIX):]
            tensors[wire_name] = (start[name] - ref.detach()).cpu()
        else:
            tensors[wire_name] = ref.detach().cpu()
    return ShardResult(loss=loss_sum / max(seen, 1), correct=correct, samples=int(y.numel()), tensors=tensors)


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.SGD:
    """SGD with momentum and weight decay, as configured."""
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)


def lr_factor(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Multiplier of the peak LR at `step` (0-based): warm-up, then the configured schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    return 0.5 * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, step: int, total_steps: int,
                      cfg: OptimizerConfig) -> float:
    """Set the LR for `step` (0-based) on every parameter group; returns it.

    Stateless by design: a resumed or redone step gets exactly the LR of an uninterrupted run.
    """
    lr = cfg.lr * lr_factor(step, total_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """Summed loss and correct count over a batch, in eval mode."""
    model.eval()
    device = model_device(model)
    x, y = x.to(device), y.to(device)  # no-ops on CPU
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y, reduction="sum")
    return float(loss), int((logits.argmax(dim=1) == y).sum())


EVAL_BATCH = 256
"""Test samples per forward pass when evaluating a whole test set."""


def evaluate_dataset(model: nn.Module, test_set) -> tuple[float, float, int]:
    """(mean loss, accuracy, samples) over the whole of `test_set`, in batches of EVAL_BATCH,
    without augmentation: the coordinator's evaluation, and every baseline's."""
    loss_sum, correct, seen = 0.0, 0, 0
    for begin in range(0, len(test_set), EVAL_BATCH):
        idx = list(range(begin, min(begin + EVAL_BATCH, len(test_set))))
        x, y = make_batch(test_set, idx, augment=False, seed=0, step=0)
        batch_loss, batch_correct = evaluate(model, x, y)
        loss_sum, correct, seen = loss_sum + batch_loss, correct + batch_correct, seen + len(idx)
    return loss_sum / seen, correct / seen, seen



def single_process_sgd(job, steps: int | None = None) -> dict[str, torch.Tensor]:
    """The model state after `steps` (default: all) steps of `job` (a JobConfig) trained in one
    process on the CPU, on the same global batches a distributed run takes: the ground truth that
    exact data parallelism and pipelines are compared with."""
    from edgetrain.data import dataset_classes, load_dataset
    from edgetrain.models import build_model
    from edgetrain.sampling import batch_indices

    model = build_model(job.model, num_classes=len(dataset_classes(job.dataset)), seed=job.seed)
    optimizer = make_optimizer(model, job.optimizer)
    dataset = load_dataset(job.dataset, train=True)
    model.train()
    for step in range(job.training.steps if steps is None else steps):
        indices = batch_indices(step, job.training.global_batch, len(dataset), job.seed)
        x, y = make_batch(dataset, indices, augment=job.dataset.augment, seed=job.seed, step=step)
        set_learning_rate(optimizer, step, job.training.steps, job.optimizer)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}
