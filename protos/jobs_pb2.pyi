from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("job_yaml", "idempotency_key")
    JOB_YAML_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    job_yaml: str
    idempotency_key: str
    def __init__(self, job_yaml: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class JobView(_message.Message):
    __slots__ = ("id", "name", "model", "kind", "request", "state", "boards", "priority", "submitted", "planned_start", "predicted_finish", "started", "finished", "steps", "steps_done", "predicted_samples_per_s", "message", "run_dir", "launches", "measured_samples_per_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BOARDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    PLANNED_START_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FINISH_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    model: str
    kind: str
    request: str
    state: str
    boards: _containers.RepeatedScalarFieldContainer[str]
    priority: float
    submitted: float
    planned_start: float
    predicted_finish: float
    started: float
    finished: float
    steps: int
    steps_done: int
    predicted_samples_per_s: float
    message: str
    run_dir: str
    launches: int
    measured_samples_per_s: float
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[str] = ..., request: _Optional[str] = ..., state: _Optional[str] = ..., boards: _Optional[_Iterable[str]] = ..., priority: _Optional[float] = ..., submitted: _Optional[float] = ..., planned_start: _Optional[float] = ..., predicted_finish: _Optional[float] = ..., started: _Optional[float] = ..., finished: _Optional[float] = ..., steps: _Optional[int] = ..., steps_done: _Optional[int] = ..., predicted_samples_per_s: _Optional[float] = ..., message: _Optional[str] = ..., run_dir: _Optional[str] = ..., launches: _Optional[int] = ..., measured_samples_per_s: _Optional[float] = ...) -> None: ...

class BoardView(_message.Message):
    __slots__ = ("name", "speed", "link_mbit_per_s", "job", "alive", "claimed_speed", "measured_speed", "flag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    LINK_MBIT_PER_S_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_SPEED_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SPEED_FIELD_NUMBER: _ClassVar[int]
    FLAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    speed: float
    link_mbit_per_s: float
    job: str
    alive: bool
    claimed_speed: float
    measured_speed: float
    flag: str
    def __init__(self, name: _Optional[str] = ..., speed: _Optional[float] = ..., link_mbit_per_s: _Optional[float] = ..., job: _Optional[str] = ..., alive: _Optional[bool] = ..., claimed_speed: _Optional[float] = ..., measured_speed: _Optional[float] = ..., flag: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs", "boards", "scheduler", "now", "plan_exact")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    BOARDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    PLAN_EXACT_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobView]
    boards: _containers.RepeatedCompositeFieldContainer[BoardView]
    scheduler: str
    now: float
    plan_exact: bool
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobView, _Mapping]]] = ..., boards: _Optional[_Iterable[_Union[BoardView, _Mapping]]] = ..., scheduler: _Optional[str] = ..., now: _Optional[float] = ..., plan_exact: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("name", "reference_s", "link_mbit_per_s", "protocol_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_S_FIELD_NUMBER: _ClassVar[int]
    LINK_MBIT_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    reference_s: float
    link_mbit_per_s: float
    protocol_version: int
    def __init__(self, name: _Optional[str] = ..., reference_s: _Optional[float] = ..., link_mbit_per_s: _Optional[float] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("poll_s",)
    POLL_S_FIELD_NUMBER: _ClassVar[int]
    poll_s: float
    def __init__(self, poll_s: _Optional[float] = ...) -> None: ...

class NextJobRequest(_message.Message):
    __slots__ = ("name", "max_wait_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_wait_s: float
    def __init__(self, name: _Optional[str] = ..., max_wait_s: _Optional[float] = ...) -> None: ...

class JobOffer(_message.Message):
    __slots__ = ("job_id", "port", "job_name")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    port: int
    job_name: str
    def __init__(self, job_id: _Optional[str] = ..., port: _Optional[int] = ..., job_name: _Optional[str] = ...) -> None: ...

class LobbyProbe(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class LobbyProbeAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
