"""The meeting point of the training driver and the RPC handlers.

The driver opens step attempts: one *ticket* per device (which sample indices, on which
parameter version, with which codec). Handlers hand tickets out, receive uploads chunk by chunk
(keeping partial uploads so a broken stream resumes), validate and decode them, and record each
device's contribution or the reason it was rejected. The driver waits until every ticket of the
attempt is answered, its device gone, or the deadline passed. Unanswered tickets are then closed
— or, under bounded staleness, kept open so a slow board's late update can still be used in a
later step (`take_late`). A closed ticket refuses uploads, so no contribution is applied twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from edgetrain.errors import FailureKind, Refusal
from edgetrain.pipeline import stage_parameter_prefixes
from edgetrain.streaming import ChunkAssembler, TransferError, check_metas
from edgetrain.tensors import check_finite, unpack
from edgetrain.updates import UpdateFormat
from edgetrain.work import Assignment, Finished, LocalWork, StageWork, StepReport

logger = logging.getLogger(__name__)


class StepError(Exception):
    """A request about a step the board cannot serve. `kind` names the gRPC status, `refusal` the
    typed reason the peer acts on."""

    def __init__(self, kind: str, message: str, refusal: Refusal = Refusal.UNSPECIFIED) -> None:
        super().__init__(message)
        self.kind = kind
        """not_found, failed_precondition, already_exists or invalid_argument."""
        self.refusal = refusal


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
    """Decoded (dense float32) gradients and buffers."""
    energy_j: float | None = None
    """Energy the device used for this step; None when it cannot tell."""
    step: int = 0
    """The step whose ticket this answers."""
    param_version: int = 0
    """Parameter version the update was computed on (staleness = current version - this)."""
    codec: str = "none"
    """Codec it travelled in."""
    wire_bytes: int = 0
    """Payload bytes it took on the wire."""
    stage: StageWork | None = None
    """The pipeline stage it computed, if any (its tensors cover only that stage)."""
    local: LocalWork | None = None
    """The local training it did (a federated round's, or a board's beside the steps): its
    gradients are then the parameter change of that training."""
    wait_s: float = 0.0
    peak_activation_bytes: int = 0
    peer_bytes: int = 0
    """Pipeline stages: activation bytes sent to neighbours this step."""
    turnaround_s: float | None = None
    """Seconds from the board taking its work (GetWork) to its upload being complete, on the
    coordinator's own clock (None: the work was never taken through GetWork)."""
    decode_s: float = 0.0
    """Seconds the coordinator spent unpacking, decoding and checking the upload (after its last
    byte arrived; not part of `upload_s`)."""
    accepted_at: float | None = None
    """When the update was accepted (decoded and checked), on the step board's clock."""
    upload_exposed_s: float = 0.0
    """A streamed upload's part after the board's compute ended (its `upload_s`)."""
    download_overlap_s: float = 0.0
    """The part of the board's download that ran under its compute (not in `download_s`)."""
    download_streamed: bool = False
    """The board's full parameter download ran under its compute this step."""
    streamed: bool = False
    """The update was streamed during the board's backward pass: `upload_s` is only the part of
    the upload that ran past compute, not a measure of the link."""

    @property
    def comm_s(self) -> float:
        """Seconds this device's update spent being moved: parameters down, the update encoded,
        uploaded, and decoded on the coordinator."""
        return self.download_s + self.encode_s + self.upload_s + self.decode_s


@dataclass
class _Upload:
    assembler: ChunkAssembler
    report: StepReport | None
    """None until a streamed upload's report arrives (after its last chunk)."""
    started: float


@dataclass
class _Ticket:
    assignment: Assignment
    fmt: UpdateFormat
    upload: _Upload | None = None
    accepted: Contribution | None = None
    rejected: str | None = None
    collected: bool = False
    taken_at: float | None = None
    """When the board first took this work (GetWork), on the coordinator's clock."""

    @property
    def answered(self) -> bool:
        return self.accepted is not None or self.rejected is not None


@dataclass(frozen=True)
class AttemptOutcome:
    """How a step attempt ended."""

    accepted: dict[str, Contribution]
    rejected: dict[str, str]
    missing: list[str]
    """Devices that left (or, when late tickets are closed, missed the deadline) without answering."""
    late: list[str] = field(default_factory=list)
    """Devices still alive whose tickets were unanswered at the deadline."""
    taken: dict[str, float] = field(default_factory=dict)
    """When each board took its work (GetWork), on the step board's clock."""
    closed_at: float | None = None
    """When the attempt closed (wait_attempt returned), on the step board's clock."""


class StepBoard:
    """Thread-safe state shared by the training driver and the RPC handlers."""

    def __init__(self, formats: Callable[..., UpdateFormat], block_names: Sequence[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._formats = formats
        self._block_names = list(block_names)
        self._clock = clock
        self._cond = threading.Condition()
        self._tickets: dict[tuple[str, int, int], _Ticket] = {}
        self._closed: set[tuple[int, int]] = set()
        self._current: tuple[int, int] | None = None
        self._finished: Finished | None = None
        self._expired: list[tuple[str, int, float, bool]] = []

    # --- driver side -------------------------------------------------------------------
    def open_attempt(self, assignments: Mapping[str, Assignment]) -> None:
        """Start a step attempt: each device in `assignments` gets its work on its next poll."""
        with self._cond:
            for device_id, a in assignments.items():
                self._tickets[(device_id, a.step, a.attempt)] = _Ticket(
                    a, self._formats(a.codec, self._upload_prefixes(a.stage), _member(a.stage, device_id)))
                self._current = (a.step, a.attempt)
            self._cond.notify_all()

    def wait_attempt(self, step: int, attempt: int, deadline: float, is_alive: Callable[[str], bool], *,
                     keep_late: bool = False, all_or_nothing: bool = False,
                     ends_on_loss: bool = False, beside: set[str] | frozenset[str] = frozenset()) -> AttemptOutcome:
        """Block until every ticket of (step, attempt) is answered or its device left, or `deadline`.

        Unanswered tickets of devices that left are closed. Those of live devices are closed
        too (and reported in `missing`), unless `keep_late`: then they stay open, are reported in
        `late`, and their answers come later through `take_late`. The tickets of the devices in
        `beside` (boards training beside the step) are neither waited for nor reported: they stay
        open and their answers come through `take_late`.
        """
        with self._cond:
            mine = {k[0]: t for k, t in self._tickets.items() if k[1:] == (step, attempt) and k[0] not in beside}
            assert mine, f"no tickets for step {step} attempt {attempt}"
            while True:
                pending = [d for d, t in mine.items() if not t.answered]
                gone = [d for d in pending if not is_alive(d)]
                if len(gone) == len(pending) or self._clock() >= deadline or self._finished:
                    break
                if all_or_nothing and (gone or any(t.rejected is not None for t in mine.values())):
                    break  # a pipeline that lost a host cannot finish this attempt
                if ends_on_loss and gone:
                    break  # it cannot count without the board that left
                self._cond.wait(timeout=min(0.2, max(0.0, deadline - self._clock())))
            late = [d for d in pending if d not in gone] if keep_late else []
            for device_id, ticket in mine.items():
                ticket.collected = ticket.answered
                if device_id not in late:
                    self._close((device_id, step, attempt))
            self._closed.add((step, attempt))
            accepted = {d: t.accepted for d, t in mine.items() if t.accepted is not None}
            rejected = {d: t.rejected for d, t in mine.items() if t.rejected is not None}
            taken = {d: t.taken_at for d, t in mine.items() if t.taken_at is not None}
            return AttemptOutcome(accepted, rejected, [d for d in pending if d not in late], late, taken,
                                  closed_at=self._clock())

    def take_late(self, oldest_step: int) -> tuple[list[Contribution], dict[str, str]]:
        """Answers that arrived for kept-open tickets since the last call; tickets of steps before
        `oldest_step` are closed unanswered (their updates would be too stale)."""
        with self._cond:
            accepted, rejected = [], {}
            for key, ticket in list(self._tickets.items()):
                if ticket.answered and not ticket.collected:
                    ticket.collected = True
                    if ticket.accepted is not None:
                        accepted.append(ticket.accepted)
                    else:
                        rejected[key[0]] = ticket.rejected
                    self._close(key)
                elif not ticket.answered and key[1] < oldest_step:
                    if ticket.taken_at is not None:
                        self._expired.append((key[0], len(ticket.assignment.indices), self._clock() - ticket.taken_at,
                                              ticket.assignment.local is not None))
                    self._close(key)
            return accepted, rejected

    def take_expired(self) -> list[tuple[str, int, float, bool]]:
        """Kept-open tickets `take_late` closed unanswered since the last call: (device, samples,
        seconds since the board took the work, whether it was local training)."""
        with self._cond:
            expired, self._expired = self._expired, []
            return expired

    def cancel_step(self, step: int, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Close every ticket of `step` still open (its samples are being redone), but those of the
        devices in `keep` (boards beside the step: their work is not the step's)."""
        with self._cond:
            for key in [k for k in self._tickets if k[1] == step and k[0] not in keep]:
                self._close(key)

    def newest(self) -> tuple[int, int] | None:
        """The newest (step, attempt) opened, or None before the first."""
        with self._cond:
            return self._current

    def wait_newer(self, seen: tuple[int, int] | None, timeout_s: float) -> tuple[int, int] | None:
        """The newest (step, attempt) once it differs from `seen`, or after `timeout_s` (or when
        the job finished): what a board's presence stream pushes."""
        with self._cond:
            self._cond.wait_for(lambda: self._current != seen or self._finished is not None, timeout_s)
            return self._current

    @property
    def finished(self) -> bool:
        """Whether the job ended (every poll answers Finished)."""
        with self._cond:
            return self._finished is not None

    def wake(self) -> None:
        """A board left: the driver re-checks who is still alive now instead of at its next tick."""
        with self._cond:
            self._cond.notify_all()

    def busy(self) -> set[str]:
        """Devices holding an open, unanswered ticket (still computing an earlier step)."""
        with self._cond:
            return {k[0] for k, t in self._tickets.items() if not t.answered}

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
                mine = [t for k, t in self._tickets.items() if k[0] == device_id and not t.answered]
                if mine:
                    ticket = max(mine, key=lambda t: (t.assignment.step, t.assignment.attempt))
                    if ticket.taken_at is None:
                        ticket.taken_at = self._clock()
                    return ticket.assignment
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=remaining)

    def begin_upload(self, device_id: str, step: int, attempt: int, metas, report: StepReport | None,
                     resume_offset: int) -> ChunkAssembler:
        """Validate an upload's header; returns the assembler to feed (kept across resumes).
        A streamed upload has no report yet: `complete_upload` gets it."""
        with self._cond:
            ticket = self._ticket_for(device_id, step, attempt)
            try:
                check_metas(metas, ticket.fmt.metas(),
                            f"upload from {device_id} for step {step} (codec {ticket.fmt.spec})")
            except TransferError as e:
                self._reject(device_id, ticket, str(e))
                raise
            if ticket.upload is None:
                ticket.upload = _Upload(ChunkAssembler(ticket.fmt.wire_bytes()), report, self._clock())
            if resume_offset > ticket.upload.assembler.received:
                raise TransferError("out_of_range", f"resume_offset {resume_offset} is past the "
                                    f"{ticket.upload.assembler.received} bytes held; resume from there")
            ticket.upload.report = report
            return ticket.upload.assembler

    def complete_upload(self, device_id: str, step: int, attempt: int,
                        report: StepReport | None = None) -> Contribution:
        """Decode and validate a fully received upload and record it (or its rejection); `report`
        is a streamed upload's, sent after its last chunk."""
        with self._cond:
            ticket = self._ticket_for(device_id, step, attempt)
            upload = ticket.upload
            if upload is None:
                raise TransferError("data_loss", f"upload from {device_id} for step {step}: no bytes received")
            payload = upload.assembler.payload()
            if report is not None:
                upload.report = report
            if upload.report is None:
                raise TransferError("invalid_argument", f"upload from {device_id} for step {step} ended without "
                                    "its step report (a streamed upload sends it after its last chunk)")
        a = ticket.assignment
        what = f"upload from {device_id} for step {step}"
        received = self._clock()
        try:  # decoding a large gradient takes tens of ms: not under the lock
            wire = unpack(ticket.fmt.metas(), payload)
            check_finite(wire, what)
            try:
                tensors = ticket.fmt.decode(wire)
            except ValueError as e:
                raise TransferError("invalid_argument", f"{what}: {e}") from None
            check_finite(tensors, what)
            if upload.report.samples != len(a.indices):
                raise TransferError("invalid_argument", f"{what}: report says {upload.report.samples} samples, "
                                    f"assignment had {len(a.indices)}")
        except TransferError as e:
            with self._cond:
                self._reject(device_id, self._ticket_for(device_id, step, attempt), str(e))
            raise
        now = self._clock()
        streamed = report is not None  # timed by the board: its upload overlapped its compute
        contribution = Contribution(device_id=device_id, tensors=tensors, decode_s=now - received, accepted_at=now,
                                    upload_s=upload.report.upload_exposed_s if streamed else received - upload.started,
                                    streamed=streamed,
                                    step=a.step, param_version=a.param_version, codec=str(ticket.fmt.spec),
                                    wire_bytes=len(payload), stage=a.stage, local=a.local,
                                    turnaround_s=None if ticket.taken_at is None else now - ticket.taken_at,
                                    **vars(upload.report))
        with self._cond:
            ticket = self._ticket_for(device_id, step, attempt)
            ticket.accepted, ticket.upload = contribution, None
            self._cond.notify_all()
        return contribution

    def refuse(self, device_id: str, step: int, attempt: int, reason: str) -> None:
        """The device's answer to its ticket is refused before its upload began (e.g. a bad report)."""
        with self._cond:
            self._reject(device_id, self._ticket_for(device_id, step, attempt), reason)

    def fail(self, device_id: str, step: int, attempt: int, kind: FailureKind, reason: str) -> None:
        """The device reports it cannot complete its ticket; recorded as its answer."""
        with self._cond:
            self._reject(device_id, self._ticket_for(device_id, step, attempt),
                         f"failed ({kind.name.lower()}): {reason}")

    def upload_status(self, device_id: str, step: int, attempt: int) -> tuple[int, int]:
        """(bytes held, total bytes) of the device's upload for this attempt."""
        with self._cond:
            ticket = self._ticket_for(device_id, step, attempt)
            return (ticket.upload.assembler.received if ticket.upload else 0), ticket.fmt.wire_bytes()

    def _upload_prefixes(self, stage: StageWork | None) -> tuple[str, ...] | None:
        """What a ticket's upload holds: the whole model (None), a stage's tensors, or nothing
        (a stage whose host owns it uploads no gradients)."""
        if stage is None:
            return None
        return () if stage.owned else stage_parameter_prefixes(self._block_names, stage.first_block, stage.end_block)

    def _ticket_for(self, device_id: str, step: int, attempt: int) -> _Ticket:
        key = (device_id, step, attempt)
        ticket = self._tickets.get(key)
        if ticket is None:
            if (step, attempt) in self._closed:
                raise StepError("failed_precondition", f"step {step} attempt {attempt} is closed", Refusal.STEP_CLOSED)
            if any(k[1:] == (step, attempt) for k in self._tickets):
                raise StepError("failed_precondition", f"device {device_id} has no work in step {step} attempt {attempt}",
                                Refusal.NOT_ASSIGNED)
            current = f"step {self._current[0]} attempt {self._current[1]}" if self._current else "no open step"
            raise StepError("not_found", f"unknown step {step} attempt {attempt}; current: {current}", Refusal.UNKNOWN_STEP)
        if ticket.answered:
            raise StepError("already_exists", f"device {device_id} already answered step {step} attempt {attempt}",
                            Refusal.ALREADY_ANSWERED)
        return ticket

    def _close(self, key: tuple[str, int, int]) -> None:
        self._tickets.pop(key, None)

    def _reject(self, device_id: str, ticket: _Ticket, reason: str) -> None:
        logger.warning("[Coordinator.Upload] rejected %s step %d: %s", device_id, ticket.assignment.step, reason)
        ticket.rejected, ticket.upload = reason, None
        self._cond.notify_all()


def _member(stage: StageWork | None, device_id: str) -> tuple[tuple[float, float], bool] | None:
    host = stage.host(device_id) if stage is not None else None
    return host.member if host is not None else None
