"""The stage a board owns: its parameters, buffers and optimizer state live on the board.

When a stage has a single host (and no data-parallel shard shares its parameters), the
coordinator hands that host the stage's state once (`StagePeer.LoadState`) and from then on only
activations cross the board's link: the host keeps the gradients of each step pending and applies
them with SGD when the coordinator says the step committed (the next step's work, or a
`PullState`, names the committed step and attempt). A redone step discards the pending gradients
and restores the buffers (BatchNorm running statistics) the discarded forward passes moved, so a
committed step is applied exactly once, with exactly the arithmetic of the coordinator's
optimizer. The coordinator pulls the state back (`PullState`) to checkpoint, evaluate, or hand
the stage to another board.

With `pipeline.replicate` the coordinator keeps a replica instead of pulling: for every attempt
it asks for what the attempt will change (`replica`: the gradients the host will apply and the
buffers after its forward passes), waiting until the host has computed them, and counts the
attempt only once they arrived. The coordinator then applies them to its master copy with the
same SGD, so its copy equals the host's state after every committed step and a host that dies
takes nothing with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.pipeline import stage_parameter_prefixes
from edgetrain.training import BUFFER_PREFIX, GRAD_PREFIX, MOMENTUM_PREFIX
from edgetrain.work import StateRequest


class StageStateError(Exception):
    """A load, pull or step that does not fit the state this board holds."""


@dataclass
class _Pending:
    step: int
    attempt: int
    lr: float


class StageState:
    """The owned stage of one board (thread-safe: the worker's steps and the coordinator's
    LoadState/PullState calls take the same lock)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        """Notified when an attempt on the stage begins, ends, or the stage changes hands."""
        self.model: nn.Module | None = None
        self.job_id = ""
        self.blocks: tuple[int, int] | None = None
        self.version = -1
        self._optimizer: torch.optim.SGD | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._saved_buffers: dict[str, torch.Tensor] = {}
        self._pending: _Pending | None = None
        self._attempt = (-1, -1)
        """The newest attempt begun on the stage (step, attempt) ..."""
        self._attempt_over = False
        """... and whether it ended without gradients (failed on this board)."""

    def attach(self, model: nn.Module, job_id: str) -> None:
        """A new job's model: any state held for an earlier one is gone."""
        with self.lock:
            self.model, self.job_id = model, job_id
            self.drop()

    def drop(self) -> None:
        """Hold nothing (the board was given other work, or re-registered)."""
        with self.lock:
            self.blocks, self.version, self._optimizer, self._pending = None, -1, None, None
            self._params, self._buffers, self._saved_buffers = {}, {}, {}
            self.changed.notify_all()

    def holds(self, first: int, end: int) -> bool:
        with self.lock:
            return self.blocks == (first, end)

    # --- coordinator side ------------------------------------------------------------------
    def expected(self, first: int, end: int) -> dict[str, torch.Tensor]:
        """Templates of what LoadState must carry for blocks [first, end) (momentum optional)."""
        params, buffers = self._stage_tensors(first, end)
        out = {n: p.detach() for n, p in params.items()}
        out.update(buffers)
        return out

    def load(self, request: StateRequest, tensors: dict[str, torch.Tensor]) -> None:
        """Own blocks [first, end) at `request.version` with these parameters, buffers and momenta."""
        with self.lock:
            self._check_job(request.job_id)
            params, buffers = self._stage_tensors(request.first_block, request.end_block)
            wanted = set(params) | set(buffers)
            missing = sorted(wanted - set(tensors))
            extra = sorted(n for n in tensors if n not in wanted and not (
                n.startswith(MOMENTUM_PREFIX) and n[len(MOMENTUM_PREFIX):] in params))
            if missing or extra:
                raise StageStateError(f"stage state for blocks [{request.first_block}, {request.end_block}) "
                                      f"missing {missing[:4]}, unexpected {extra[:4]}")
            for name, t in tensors.items():
                target = params.get(name[len(MOMENTUM_PREFIX):]) if name.startswith(MOMENTUM_PREFIX) else (
                    params.get(name, buffers.get(name)))
                if t.shape != target.shape or t.dtype != target.dtype:
                    raise StageStateError(f"{name}: got {t.dtype} {list(t.shape)}, the model has "
                                          f"{target.dtype} {list(target.shape)}")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(tensors[name])
                    p.grad = None
                for name, b in buffers.items():
                    b.copy_(tensors[name])
            # the per-tensor loop, as the coordinator's replica of this stage steps (stage_owners)
            self._optimizer = torch.optim.SGD(list(params.values()), lr=0.0, momentum=request.momentum,
                                              weight_decay=request.weight_decay, nesterov=request.nesterov,
                                              foreach=False)
            for name, p in params.items():
                momentum = tensors.get(MOMENTUM_PREFIX + name)
                if momentum is not None:
                    self._optimizer.state[p]["momentum_buffer"] = momentum.to(p.device, copy=True)
            self._params, self._buffers = params, buffers
            self.blocks, self.version, self._pending = (request.first_block, request.end_block), request.version, None
            self._save_buffers()
            self.changed.notify_all()

    def export(self, request: StateRequest) -> dict[str, torch.Tensor]:
        """The state at `request.version`, after applying the committed step's pending gradients."""
        with self.lock:
            self._check_job(request.job_id)
            if self.blocks != (request.first_block, request.end_block):
                raise StageStateError(f"this board owns {self.describe()}, not blocks "
                                      f"[{request.first_block}, {request.end_block})")
            self.settle(request.commit_step, request.commit_attempt)
            if self.version != request.version:
                raise StageStateError(f"this board holds version {self.version} of its stage, "
                                      f"not {request.version}")
            out = {n: p.detach().clone() for n, p in self._params.items()}
            out.update({n: b.clone() for n, b in self._buffers.items()})
            for name, p in self._params.items():
                momentum = self._optimizer.state.get(p, {}).get("momentum_buffer")
                if momentum is not None:
                    out[MOMENTUM_PREFIX + name] = momentum.clone()
            if request.release:
                self.drop()
            return out

    def replica(self, job_id: str, first: int, end: int, step: int, attempt: int, *, deadline: float,
                gone: Callable[[], str | None] = lambda: None) -> dict[str, torch.Tensor]:
        """What attempt (step, attempt) will change if it commits: the gradients this board will
        apply ("grad.<name>") and the stage's buffers after the attempt ("buf.<name>").

        Waits until the attempt's gradients are computed, until the monotonic `deadline`, or
        until `gone()` gives a reason to stop (the attempt was superseded, the caller left);
        StageStateError when the attempt ended here without gradients or cannot be had."""
        with self.changed:
            while True:
                self._check_job(job_id)
                if self.blocks != (first, end):
                    raise StageStateError(f"this board owns {self.describe()}, not blocks [{first}, {end})")
                pending = self._pending
                if pending is not None and (pending.step, pending.attempt) == (step, attempt):
                    out = {GRAD_PREFIX + n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                           for n, p in self._params.items()}
                    out.update({BUFFER_PREFIX + n: b.clone() for n, b in self._buffers.items()})
                    return out
                if self._attempt > (step, attempt) or (self._attempt == (step, attempt) and self._attempt_over):
                    raise StageStateError(f"step {step} attempt {attempt} ended on this board without a result")
                if self.version > step:
                    raise StageStateError(f"this board holds version {self.version} of its stage: step {step} "
                                          "is past")
                reason = gone()
                if reason:
                    raise StageStateError(f"step {step} attempt {attempt}: {reason}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StageStateError(f"step {step} attempt {attempt} was not computed on this board in time")
                self.changed.wait(min(remaining, 0.5))

    # --- worker side ---------------------------------------------------------------------
    def settle(self, commit_step: int, commit_attempt: int) -> None:
        """Apply the pending gradients if they are the committed step's, else discard them."""
        with self.lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            if (pending.step, pending.attempt) == (commit_step, commit_attempt) and pending.step == self.version:
                for group in self._optimizer.param_groups:
                    group["lr"] = pending.lr
                self._optimizer.step()
                self.version = pending.step + 1
                self._save_buffers()
            else:
                self._restore_buffers()
            self._optimizer.zero_grad(set_to_none=True)

    def begin(self, step: int, first: int, end: int, commit_step: int, commit_attempt: int, *,
              attempt: int) -> None:
        """Before running attempt `attempt` of `step` on the owned stage: settle the previous
        step, check the version."""
        with self.lock:
            self._attempt, self._attempt_over = (step, attempt), True  # unless it can run:
            self.changed.notify_all()
            if self.blocks != (first, end):
                raise StageStateError(f"asked to run blocks [{first}, {end}) as their owner, but this board "
                                      f"owns {self.describe()}")
            self.settle(commit_step, commit_attempt)
            if self.version != step:
                raise StageStateError(f"step {step} needs version {step} of blocks [{first}, {end}); "
                                      f"this board holds version {self.version}")
            self._attempt_over = False

    def finish(self, step: int, attempt: int, lr: float) -> None:
        """The stage's gradients of (step, attempt) are computed: keep them until the commit.
        Non-finite gradients void the step (StageStateError): nothing checks them downstream."""
        with self.lock:
            for name, p in self._params.items():
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    self.abandon()
                    raise StageStateError(f"step {step}: the gradient of {name} has NaN/Inf values")
            self._pending = _Pending(step, attempt, lr)
            self.changed.notify_all()

    def abandon(self) -> None:
        """The step failed on this board: its gradients and buffer updates are void."""
        with self.lock:
            self._pending, self._attempt_over = None, True
            self.changed.notify_all()
            if self._optimizer is not None:
                self._optimizer.zero_grad(set_to_none=True)
                self._restore_buffers()

    # --- internals -----------------------------------------------------------------------
    def _check_job(self, job_id: str) -> None:
        if self.model is None or job_id != self.job_id:
            raise StageStateError(f"this board runs job {self.job_id or '(none)'!r}, not {job_id!r}")

    def _stage_tensors(self, first: int, end: int) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
        if self.model is None:
            raise StageStateError("this board has no job yet")
        names = self.model.block_names
        if not 0 <= first < end <= len(names):
            raise StageStateError(f"blocks [{first}, {end}) are not a range of the model's {len(names)} blocks")
        prefixes = stage_parameter_prefixes(names, first, end)
        params = {n: p for n, p in self.model.named_parameters() if n.startswith(prefixes)}
        buffers = {n: b for n, b in self.model.named_buffers() if n.startswith(prefixes)}
        return params, buffers

    def _save_buffers(self) -> None:
        self._saved_buffers = {n: b.clone() for n, b in self._buffers.items()}

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for name, b in self._buffers.items():
                b.copy_(self._saved_buffers[name])

    def describe(self) -> str:
        return f"blocks [{self.blocks[0]}, {self.blocks[1]})" if self.blocks else "no stage"

