"""The meeting point of the training driver and the RPC handlers.

The driver publishes parameters and opens one step attempt at a time (who computes which
sample indices); handlers hand that work out, receive uploads chunk by chunk (keeping partial
uploads so a broken stream resumes), validate them and record each device's contribution or the
reason it was rejected. The driver waits until every assigned device has answered, failed or the
deadline passed, then closes the attempt: late uploads for a closed attempt are refused, so no
contribution is ever applied twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from edgetrain.tensors import (
    ChunkAssembler,
    TensorMeta,
    TransferError,
    check_finite,
    check_metas,
    unpack,
)

logger = logging.getLogger(__name__)


class StepError(Exception):
    """A request about a step the board cannot serve. `kind` names the gRPC status."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        """not_found, failed_precondition or already_exists."""


@dataclass(frozen=True)
class Assignment:
    """One device's work in a step attempt."""

    step: int
    attempt: int
    param_version: int
    indices: tuple[int, ...]
    augment: bool
    data_seed: int


@dataclass(frozen=True)
class Finished:
    """The job is over; clients should stop."""

    reason: str


@dataclass
class Contribution:
    """A device's accepted result for one step attempt."""

    device_id: str
    samples: int
    loss: float
    correct: int
    compute_s: float
    download_s: float
    encode_s: float
    upload_s: float
    tensors: dict[str, torch.Tensor]
    energy_j: float | None = None
    """Energy the device used for this step; None when it cannot tell."""

    @property
    def comm_s(self) -> float:
        """Seconds this device spent moving parameters and gradients this step."""
        return self.download_s + self.encode_s + self.upload_s


@dataclass
class _Upload:
    assembler: ChunkAssembler
    report: dict
    started: float


@dataclass
class _Attempt:
    step: int
    attempt: int
    assignments: dict[str, Assignment]
    accepted: dict[str, Contribution] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    uploads: dict[str, _Upload] = field(default_factory=dict)

    def answered(self, device_id: str) -> bool:
        return device_id in self.accepted or device_id in self.rejected


@dataclass(frozen=True)
class AttemptOutcome:
    """How a step attempt ended."""

    accepted: dict[str, Contribution]
    rejected: dict[str, str]
    missing: list[str]
    """Devices that neither answered nor were rejected before the deadline or that left."""


class StepBoard:
    """Thread-safe state shared by the training driver and the RPC handlers."""

    def __init__(self, upload_metas: Sequence[TensorMeta], clock: Callable[[], float] = time.monotonic) -> None:
        self._upload_metas = list(upload_metas)
        self._upload_bytes = sum(m.nbytes for m in upload_metas)
        self._clock = clock
        self._cond = threading.Condition()
        self._version = -1
        self._param_metas: list[TensorMeta] = []
        self._param_payload: memoryview = memoryview(b"")
        self._attempt: _Attempt | None = None
        self._closed: set[tuple[int, int]] = set()
        self._finished: Finished | None = None

    # --- driver side -------------------------------------------------------------------
    def publish_parameters(self, version: int, metas: list[TensorMeta], payload: memoryview) -> None:
        """Make parameters of `version` the ones served for downloads."""
        with self._cond:
            self._version, self._param_metas, self._param_payload = version, metas, payload

    def open_attempt(self, assignments: Mapping[str, Assignment]) -> None:
        """Start a step attempt: each device in `assignments` gets its work on its next poll."""
        first = next(iter(assignments.values()))
        with self._cond:
            self._attempt = _Attempt(first.step, first.attempt, dict(assignments))
            self._cond.notify_all()

    def wait_attempt(self, deadline: float, is_alive: Callable[[str], bool]) -> AttemptOutcome:
        """Block until every assigned device answered or left, or until `deadline`; then close."""
        with self._cond:
            attempt = self._attempt
            assert attempt is not None, "no open attempt"
            while True:
                pending = [d for d in attempt.assignments if not attempt.answered(d)]
                gone = [d for d in pending if not is_alive(d)]
                if len(gone) == len(pending) or self._clock() >= deadline or self._finished:
                    break
                self._cond.wait(timeout=min(0.2, max(0.0, deadline - self._clock())))
            self._closed.add((attempt.step, attempt.attempt))
            self._attempt = None
            return AttemptOutcome(dict(attempt.accepted), dict(attempt.rejected), pending)

    def finish(self, reason: str) -> None:
        """End the job: every poll now answers Finished."""
        with self._cond:
            self._finished = Finished(reason)
            self._cond.notify_all()

    # --- handler side ------------------------------------------------------------------
    def next_work(self, device_id: str, max_wait_s: float) -> Assignment | Finished | None:
        """The device's pending assignment, Finished, or None after `max_wait_s` without work."""
        deadline = self._clock() + max_wait_s
        with self._cond:
            while True:
                if self._finished is not None:
                    return self._finished
                attempt = self._attempt
                if attempt and device_id in attempt.assignments and not attempt.answered(device_id):
                    return attempt.assignments[device_id]
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=remaining)

    def parameters(self, version: int) -> tuple[list[TensorMeta], memoryview]:
        """Metas and payload of parameters `version`, if it is the current one."""
        with self._cond:
            if version != self._version:
                raise StepError("failed_precondition",
                                f"parameter version {version} is not served; current version is {self._version}")
            return self._param_metas, self._param_payload

    def begin_upload(self, device_id: str, step: int, attempt: int, metas: Sequence[TensorMeta],
                     report: dict, resume_offset: int) -> ChunkAssembler:
        """Validate an upload's header; returns the assembler to feed (kept across resumes)."""
        with self._cond:
            state = self._open_attempt_for(device_id, step, attempt)
            try:
                check_metas(metas, self._upload_metas, f"upload from {device_id} for step {step}")
            except TransferError as e:
                self._reject(state, device_id, str(e))
                raise
            upload = state.uploads.get(device_id)
            if upload is None:
                upload = _Upload(ChunkAssembler(self._upload_bytes), report, self._clock())
                state.uploads[device_id] = upload
            if resume_offset > upload.assembler.received:
                raise TransferError("out_of_range", f"resume_offset {resume_offset} is past the "
                                    f"{upload.assembler.received} bytes held; resume from there")
            upload.report = report
            return upload.assembler

    def complete_upload(self, device_id: str, step: int, attempt: int) -> Contribution:
        """Decode and validate a fully received upload and record it (or its rejection)."""
        with self._cond:
            upload = self._open_attempt_for(device_id, step, attempt).uploads[device_id]
            payload = upload.assembler.payload()
            want = len(self._attempt.assignments[device_id].indices)
        try:  # decoding a large gradient takes tens of ms: not under the lock
            tensors = unpack(self._upload_metas, payload)
            check_finite(tensors, f"upload from {device_id} for step {step}")
            if int(upload.report["samples"]) != want:
                raise TransferError("invalid_argument",
                                    f"report says {upload.report['samples']} samples, assignment had {want}")
        except TransferError as e:
            with self._cond:
                self._reject(self._open_attempt_for(device_id, step, attempt), device_id, str(e))
            raise
        contribution = Contribution(device_id=device_id, tensors=tensors,
                                    upload_s=self._clock() - upload.started, **upload.report)
        with self._cond:
            state = self._open_attempt_for(device_id, step, attempt)
            state.accepted[device_id] = contribution
            state.uploads.pop(device_id, None)
            self._cond.notify_all()
        return contribution

    def upload_status(self, device_id: str, step: int, attempt: int) -> tuple[int, int]:
        """(bytes held, total bytes) of the device's upload for this attempt."""
        with self._cond:
            state = self._open_attempt_for(device_id, step, attempt)
            upload = state.uploads.get(device_id)
            return (upload.assembler.received if upload else 0), self._upload_bytes

    def _open_attempt_for(self, device_id: str, step: int, attempt: int) -> _Attempt:
        state = self._attempt
        if (step, attempt) in self._closed:
            raise StepError("failed_precondition", f"step {step} attempt {attempt} is closed")
        if state is None or (state.step, state.attempt) != (step, attempt):
            current = f"step {state.step} attempt {state.attempt}" if state else "no open step"
            raise StepError("not_found", f"unknown step {step} attempt {attempt}; current: {current}")
        if device_id not in state.assignments:
            raise StepError("failed_precondition", f"device {device_id} has no work in step {step}")
        if state.answered(device_id):
            raise StepError("already_exists",
                            f"device {device_id} already answered step {step} attempt {attempt}")
        return state

    def _reject(self, state: _Attempt, device_id: str, reason: str) -> None:
        logger.warning("[Coordinator.Upload] rejected %s step %d: %s", device_id, state.step, reason)
        state.rejected[device_id] = reason
        state.uploads.pop(device_id, None)
        self._cond.notify_all()
