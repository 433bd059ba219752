from protos import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepRequest(_message.Message):
    __slots__ = ("job_id", "first_block", "end_block", "step", "attempt", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    first_block: int
    end_block: int
    step: int
    attempt: int
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("job_id", "first_block", "end_block", "version", "commit_step", "commit_attempt", "supersede_attempt", "momentum", "weight_decay", "nesterov", "from_device", "release", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDE_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    FROM_DEVICE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    first_block: int
    end_block: int
    version: int
    commit_step: int
    commit_attempt: int
    supersede_attempt: int
    momentum: float
    weight_decay: float
    nesterov: bool
    from_device: str
    release: bool
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., version: _Optional[int] = ..., commit_step: _Optional[int] = ..., commit_attempt: _Optional[int] = ..., supersede_attempt: _Optional[int] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., nesterov: _Optional[bool] = ..., from_device: _Optional[str] = ..., release: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class StateMessage(_message.Message):
    __slots__ = ("request", "header", "chunk")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    request: StateRequest
    header: _tensor_pb2.BundleHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, request: _Optional[_Union[StateRequest, _Mapping]] = ..., header: _Optional[_Union[_tensor_pb2.BundleHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class StageHeader(_message.Message):
    __slots__ = ("job_id", "step", "attempt", "pipeline", "microbatch", "backward", "from_stage", "row_begin", "row_end", "from_device", "bundle", "exchange")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    ROW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    FROM_DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    attempt: int
    pipeline: int
    microbatch: int
    backward: bool
    from_stage: int
    row_begin: int
    row_end: int
    from_device: str
    bundle: _tensor_pb2.BundleHeader
    exchange: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., pipeline: _Optional[int] = ..., microbatch: _Optional[int] = ..., backward: _Optional[bool] = ..., from_stage: _Optional[int] = ..., row_begin: _Optional[int] = ..., row_end: _Optional[int] = ..., from_device: _Optional[str] = ..., bundle: _Optional[_Union[_tensor_pb2.BundleHeader, _Mapping]] = ..., exchange: _Optional[int] = ...) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: StageHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[StageHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class StageAck(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...
