"""Typed reasons that cross the wire: why a call was refused, and why a board gave a step up.

Both mirror enums of the wire contract (protos/errors.proto ``ErrorReason``, protos/coordinator.proto
``FailureKind``) value for value, so code on either side acts on a reason, never on message text.
"""

from __future__ import annotations

import enum


class Refusal(enum.IntEnum):
    """Why a server refused a call, beyond its gRPC status (protos/errors.proto ErrorReason)."""

    UNSPECIFIED = 0
    UNKNOWN_DEVICE = 1
    """The server does not know this device id (never registered, or dropped): register again."""
    UNKNOWN_STEP = 2
    """The step or attempt named is not open and never was."""
    STEP_CLOSED = 3
    """The step attempt is closed (answered, redone or past its deadline)."""
    NOT_ASSIGNED = 4
    """The device has no work in the step attempt it named."""
    ALREADY_ANSWERED = 5
    """The device already answered this step attempt."""
    VERSION_NOT_SERVED = 6
    """The parameter version asked for is not served (any more)."""
    DELTAS_NOT_KEPT = 7
    """Parameter deltas from the base version asked for are not kept: download in full."""
    PROTOCOL_MISMATCH = 8
    """The peer speaks another wire protocol version."""
    STAGE_STATE_MISMATCH = 9
    """A pipeline stage's state does not match what the request names (job, blocks, version)."""
    NOT_AUTHENTICATED = 10
    """The call needs a fleet certificate and came without one: pair with a join token first."""
    CREDENTIAL_REVOKED = 11
    """The caller's certificate was revoked: it needs a new join token."""
    NOT_PERMITTED = 12
    """The caller is authenticated but may not do this (wrong role, or another member's name)."""
    TOKEN_REFUSED = 13
    """The join token is unknown, wrong, used up or expired."""
    SOFTWARE_UNSUPPORTED = 14
    """The board's software cannot train here (a torch older than EdgeTrain supports)."""


class FailureKind(enum.IntEnum):
    """Why a board gave up its part of a step (protos/coordinator.proto FailureKind)."""

    UNSPECIFIED = 0
    NEIGHBOUR_TIMEOUT = 1
    """A neighbouring stage's tensors did not arrive within the stage timeout."""
    NEIGHBOUR_UNREACHABLE = 2
    """Sending to a neighbouring stage failed."""
    SUPERSEDED = 3
    """The coordinator opened a newer attempt while the board was still on this one."""
    STAGE_STATE = 4
    """The board's owned stage state does not fit the work (version, blocks), or its gradients
    were not finite."""
    INTERNAL = 5
    """Anything else that went wrong on the board (a neighbour's tensor that does not fit the
    stage, a bug); logged there with its traceback."""
    LOCAL_DATA = 6
    """The board's own training data (--local-data) is gone or unreadable: it leaves the job."""
    OUT_OF_MEMORY = 7
    """The stage did not fit the memory of the board's device: the planner plans again with less
    memory for that board."""
