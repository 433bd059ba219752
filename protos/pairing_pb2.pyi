from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PairRequest(_message.Message):
    __slots__ = ("token_id", "secret", "csr_pem", "protocol_version")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    secret: str
    csr_pem: bytes
    protocol_version: int
    def __init__(self, token_id: _Optional[str] = ..., secret: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class PairReply(_message.Message):
    __slots__ = ("certificate_pem",)
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    def __init__(self, certificate_pem: _Optional[bytes] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("certificate_pem",)
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    def __init__(self, certificate_pem: _Optional[bytes] = ...) -> None: ...
