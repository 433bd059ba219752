from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    UNKNOWN_DEVICE: _ClassVar[ErrorReason]
    UNKNOWN_STEP: _ClassVar[ErrorReason]
    STEP_CLOSED: _ClassVar[ErrorReason]
    NOT_ASSIGNED: _ClassVar[ErrorReason]
    ALREADY_ANSWERED: _ClassVar[ErrorReason]
    VERSION_NOT_SERVED: _ClassVar[ErrorReason]
    DELTAS_NOT_KEPT: _ClassVar[ErrorReason]
    PROTOCOL_MISMATCH: _ClassVar[ErrorReason]
    STAGE_STATE_MISMATCH: _ClassVar[ErrorReason]
    NOT_AUTHENTICATED: _ClassVar[ErrorReason]
    CREDENTIAL_REVOKED: _ClassVar[ErrorReason]
    NOT_PERMITTED: _ClassVar[ErrorReason]
    TOKEN_REFUSED: _ClassVar[ErrorReason]
    SOFTWARE_UNSUPPORTED: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
UNKNOWN_DEVICE: ErrorReason
UNKNOWN_STEP: ErrorReason
STEP_CLOSED: ErrorReason
NOT_ASSIGNED: ErrorReason
ALREADY_ANSWERED: ErrorReason
VERSION_NOT_SERVED: ErrorReason
DELTAS_NOT_KEPT: ErrorReason
PROTOCOL_MISMATCH: ErrorReason
STAGE_STATE_MISMATCH: ErrorReason
NOT_AUTHENTICATED: ErrorReason
CREDENTIAL_REVOKED: ErrorReason
NOT_PERMITTED: ErrorReason
TOKEN_REFUSED: ErrorReason
SOFTWARE_UNSUPPORTED: ErrorReason

class ErrorDetail(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorReason
    def __init__(self, reason: _Optional[_Union[ErrorReason, str]] = ...) -> None: ...
