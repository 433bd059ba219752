from protos import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_UNSPECIFIED: _ClassVar[FailureKind]
    NEIGHBOUR_TIMEOUT: _ClassVar[FailureKind]
    NEIGHBOUR_UNREACHABLE: _ClassVar[FailureKind]
    SUPERSEDED: _ClassVar[FailureKind]
    STAGE_STATE: _ClassVar[FailureKind]
    INTERNAL: _ClassVar[FailureKind]
    LOCAL_DATA: _ClassVar[FailureKind]
    OUT_OF_MEMORY: _ClassVar[FailureKind]
FAILURE_KIND_UNSPECIFIED: FailureKind
NEIGHBOUR_TIMEOUT: FailureKind
NEIGHBOUR_UNREACHABLE: FailureKind
SUPERSEDED: FailureKind
STAGE_STATE: FailureKind
INTERNAL: FailureKind
LOCAL_DATA: FailureKind
OUT_OF_MEMORY: FailureKind

class DeviceInfo(_message.Message):
    __slots__ = ("name", "hostname", "arch", "os", "cpu_count", "memory_total_bytes", "emulated_speed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMULATED_SPEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    hostname: str
    arch: str
    os: str
    cpu_count: int
    memory_total_bytes: int
    emulated_speed: float
    def __init__(self, name: _Optional[str] = ..., hostname: _Optional[str] = ..., arch: _Optional[str] = ..., os: _Optional[str] = ..., cpu_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., emulated_speed: _Optional[float] = ...) -> None: ...

class SoftwareVersions(_message.Message):
    __slots__ = ("edgetrain", "python", "torch", "grpcio")
    EDGETRAIN_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    GRPCIO_FIELD_NUMBER: _ClassVar[int]
    edgetrain: str
    python: str
    torch: str
    grpcio: str
    def __init__(self, edgetrain: _Optional[str] = ..., python: _Optional[str] = ..., torch: _Optional[str] = ..., grpcio: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("device", "versions", "protocol_version", "stage_address")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    device: DeviceInfo
    versions: SoftwareVersions
    protocol_version: int
    stage_address: str
    def __init__(self, device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., versions: _Optional[_Union[SoftwareVersions, _Mapping]] = ..., protocol_version: _Optional[int] = ..., stage_address: _Optional[str] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("name", "seed", "train_size", "test_size", "augment")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEST_SIZE_FIELD_NUMBER: _ClassVar[int]
    AUGMENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    seed: int
    train_size: int
    test_size: int
    augment: bool
    def __init__(self, name: _Optional[str] = ..., seed: _Optional[int] = ..., train_size: _Optional[int] = ..., test_size: _Optional[int] = ..., augment: _Optional[bool] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job_id", "model", "num_classes", "dataset", "profile_batch_sizes", "heartbeat_interval_s", "chunk_bytes", "error_feedback", "board_momentum", "max_forward_batch", "device", "stream_upload", "stream_download", "class_names", "share_class_counts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PROFILE_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    BOARD_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    MAX_FORWARD_BATCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STREAM_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    STREAM_DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAMES_FIELD_NUMBER: _ClassVar[int]
    SHARE_CLASS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    num_classes: int
    dataset: DatasetSpec
    profile_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    heartbeat_interval_s: float
    chunk_bytes: int
    error_feedback: bool
    board_momentum: float
    max_forward_batch: int
    device: str
    stream_upload: str
    stream_download: str
    class_names: _containers.RepeatedScalarFieldContainer[str]
    share_class_counts: bool
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., num_classes: _Optional[int] = ..., dataset: _Optional[_Union[DatasetSpec, _Mapping]] = ..., profile_batch_sizes: _Optional[_Iterable[int]] = ..., heartbeat_interval_s: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., error_feedback: _Optional[bool] = ..., board_momentum: _Optional[float] = ..., max_forward_batch: _Optional[int] = ..., device: _Optional[str] = ..., stream_upload: _Optional[str] = ..., stream_download: _Optional[str] = ..., class_names: _Optional[_Iterable[str]] = ..., share_class_counts: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("device_id", "job")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    job: JobSpec
    def __init__(self, device_id: _Optional[str] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class BatchTiming(_message.Message):
    __slots__ = ("batch_size", "seconds")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    seconds: float
    def __init__(self, batch_size: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProfileReport(_message.Message):
    __slots__ = ("device_id", "timings", "memory_total_bytes", "memory_available_bytes", "peak_rss_bytes", "local_samples", "local_class_counts", "device", "device_memory_bytes", "copy_s_per_byte")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CLASS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_S_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    timings: _containers.RepeatedCompositeFieldContainer[BatchTiming]
    memory_total_bytes: int
    memory_available_bytes: int
    peak_rss_bytes: int
    local_samples: int
    local_class_counts: _containers.RepeatedScalarFieldContainer[int]
    device: str
    device_memory_bytes: int
    copy_s_per_byte: float
    def __init__(self, device_id: _Optional[str] = ..., timings: _Optional[_Iterable[_Union[BatchTiming, _Mapping]]] = ..., memory_total_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., local_samples: _Optional[int] = ..., local_class_counts: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., copy_s_per_byte: _Optional[float] = ...) -> None: ...

class ProfileAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("timestamp", "cpu_percent", "memory_used_bytes", "memory_total_bytes", "battery_percent", "battery_charging", "temperature_c", "cpu_freq_mhz", "link_mbit_per_s", "rtt_ms", "energy_j", "step_compute_s", "step_comm_s", "plugged", "idle_w", "busy_w", "energy_measured")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATTERY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    BATTERY_CHARGING_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    CPU_FREQ_MHZ_FIELD_NUMBER: _ClassVar[int]
    LINK_MBIT_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_J_FIELD_NUMBER: _ClassVar[int]
    STEP_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_COMM_S_FIELD_NUMBER: _ClassVar[int]
    PLUGGED_FIELD_NUMBER: _ClassVar[int]
    IDLE_W_FIELD_NUMBER: _ClassVar[int]
    BUSY_W_FIELD_NUMBER: _ClassVar[int]
    ENERGY_MEASURED_FIELD_NUMBER: _ClassVar[int]
    timestamp: float
    cpu_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    battery_percent: float
    battery_charging: bool
    temperature_c: float
    cpu_freq_mhz: float
    link_mbit_per_s: float
    rtt_ms: float
    energy_j: float
    step_compute_s: float
    step_comm_s: float
    plugged: bool
    idle_w: float
    busy_w: float
    energy_measured: bool
    def __init__(self, timestamp: _Optional[float] = ..., cpu_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., battery_percent: _Optional[float] = ..., battery_charging: _Optional[bool] = ..., temperature_c: _Optional[float] = ..., cpu_freq_mhz: _Optional[float] = ..., link_mbit_per_s: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., energy_j: _Optional[float] = ..., step_compute_s: _Optional[float] = ..., step_comm_s: _Optional[float] = ..., plugged: _Optional[bool] = ..., idle_w: _Optional[float] = ..., busy_w: _Optional[float] = ..., energy_measured: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("device_id", "telemetry")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    telemetry: Telemetry
    def __init__(self, device_id: _Optional[str] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("newest_step", "newest_attempt")
    NEWEST_STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    newest_step: int
    newest_attempt: int
    def __init__(self, newest_step: _Optional[int] = ..., newest_attempt: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("newest_step", "newest_attempt")
    NEWEST_STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    newest_step: int
    newest_attempt: int
    def __init__(self, newest_step: _Optional[int] = ..., newest_attempt: _Optional[int] = ...) -> None: ...

class WorkRequest(_message.Message):
    __slots__ = ("device_id", "max_wait_s")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    max_wait_s: float
    def __init__(self, device_id: _Optional[str] = ..., max_wait_s: _Optional[float] = ...) -> None: ...

class StepWork(_message.Message):
    __slots__ = ("step", "attempt", "param_version", "indices", "augment", "data_seed", "codec", "delta_codec", "local", "stage")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    AUGMENT_FIELD_NUMBER: _ClassVar[int]
    DATA_SEED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DELTA_CODEC_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    attempt: int
    param_version: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    augment: bool
    data_seed: int
    codec: str
    delta_codec: str
    local: LocalTraining
    stage: StageWork
    def __init__(self, step: _Optional[int] = ..., attempt: _Optional[int] = ..., param_version: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., augment: _Optional[bool] = ..., data_seed: _Optional[int] = ..., codec: _Optional[str] = ..., delta_codec: _Optional[str] = ..., local: _Optional[_Union[LocalTraining, _Mapping]] = ..., stage: _Optional[_Union[StageWork, _Mapping]] = ...) -> None: ...

class StageHost(_message.Message):
    __slots__ = ("device_id", "address", "row_begin", "row_end", "name", "channel_split", "channel_begin", "channel_end")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_SPLIT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_END_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    address: str
    row_begin: _containers.RepeatedScalarFieldContainer[int]
    row_end: _containers.RepeatedScalarFieldContainer[int]
    name: str
    channel_split: bool
    channel_begin: float
    channel_end: float
    def __init__(self, device_id: _Optional[str] = ..., address: _Optional[str] = ..., row_begin: _Optional[_Iterable[int]] = ..., row_end: _Optional[_Iterable[int]] = ..., name: _Optional[str] = ..., channel_split: _Optional[bool] = ..., channel_begin: _Optional[float] = ..., channel_end: _Optional[float] = ...) -> None: ...

class StageWork(_message.Message):
    __slots__ = ("pipeline", "stage", "stages", "first_block", "end_block", "schedule", "indices", "microbatch_sizes", "hosts", "prev_hosts", "next_hosts", "pipeline_samples", "timeout_s", "owned", "lr", "commit_step", "commit_attempt")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PREV_HOSTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOSTS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    pipeline: int
    stage: int
    stages: int
    first_block: int
    end_block: int
    schedule: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    microbatch_sizes: _containers.RepeatedScalarFieldContainer[int]
    hosts: _containers.RepeatedCompositeFieldContainer[StageHost]
    prev_hosts: _containers.RepeatedCompositeFieldContainer[StageHost]
    next_hosts: _containers.RepeatedCompositeFieldContainer[StageHost]
    pipeline_samples: int
    timeout_s: float
    owned: bool
    lr: float
    commit_step: int
    commit_attempt: int
    def __init__(self, pipeline: _Optional[int] = ..., stage: _Optional[int] = ..., stages: _Optional[int] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., schedule: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., microbatch_sizes: _Optional[_Iterable[int]] = ..., hosts: _Optional[_Iterable[_Union[StageHost, _Mapping]]] = ..., prev_hosts: _Optional[_Iterable[_Union[StageHost, _Mapping]]] = ..., next_hosts: _Optional[_Iterable[_Union[StageHost, _Mapping]]] = ..., pipeline_samples: _Optional[int] = ..., timeout_s: _Optional[float] = ..., owned: _Optional[bool] = ..., lr: _Optional[float] = ..., commit_step: _Optional[int] = ..., commit_attempt: _Optional[int] = ...) -> None: ...

class LocalTraining(_message.Message):
    __slots__ = ("steps", "batch_size", "lr", "momentum", "weight_decay", "prox_mu")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    PROX_MU_FIELD_NUMBER: _ClassVar[int]
    steps: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    prox_mu: float
    def __init__(self, steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., prox_mu: _Optional[float] = ...) -> None: ...

class Idle(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class WorkAssignment(_message.Message):
    __slots__ = ("idle", "step", "finished")
    IDLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    idle: Idle
    step: StepWork
    finished: Finished
    def __init__(self, idle: _Optional[_Union[Idle, _Mapping]] = ..., step: _Optional[_Union[StepWork, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class ParameterRequest(_message.Message):
    __slots__ = ("device_id", "version", "offset", "base_version", "prefixes", "channel_split", "channel_begin", "channel_end")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_SPLIT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_END_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    version: int
    offset: int
    base_version: int
    prefixes: _containers.RepeatedScalarFieldContainer[str]
    channel_split: bool
    channel_begin: float
    channel_end: float
    def __init__(self, device_id: _Optional[str] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., base_version: _Optional[int] = ..., prefixes: _Optional[_Iterable[str]] = ..., channel_split: _Optional[bool] = ..., channel_begin: _Optional[float] = ..., channel_end: _Optional[float] = ...) -> None: ...

class ParameterMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.BundleHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[_tensor_pb2.BundleHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("samples", "loss", "correct", "compute_s", "download_s", "encode_s", "energy_j", "wait_s", "peak_activation_bytes", "peer_bytes", "upload_exposed_s", "download_overlap_s", "download_streamed")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    ENERGY_J_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_OVERLAP_S_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_STREAMED_FIELD_NUMBER: _ClassVar[int]
    samples: int
    loss: float
    correct: int
    compute_s: float
    download_s: float
    encode_s: float
    energy_j: float
    wait_s: float
    peak_activation_bytes: int
    peer_bytes: int
    upload_exposed_s: float
    download_overlap_s: float
    download_streamed: bool
    def __init__(self, samples: _Optional[int] = ..., loss: _Optional[float] = ..., correct: _Optional[int] = ..., compute_s: _Optional[float] = ..., download_s: _Optional[float] = ..., encode_s: _Optional[float] = ..., energy_j: _Optional[float] = ..., wait_s: _Optional[float] = ..., peak_activation_bytes: _Optional[int] = ..., peer_bytes: _Optional[int] = ..., upload_exposed_s: _Optional[float] = ..., download_overlap_s: _Optional[float] = ..., download_streamed: _Optional[bool] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("device_id", "step", "attempt", "bundle", "report", "resume_offset")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    step: int
    attempt: int
    bundle: _tensor_pb2.BundleHeader
    report: StepReport
    resume_offset: int
    def __init__(self, device_id: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., bundle: _Optional[_Union[_tensor_pb2.BundleHeader, _Mapping]] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ..., resume_offset: _Optional[int] = ...) -> None: ...

class UploadMessage(_message.Message):
    __slots__ = ("header", "chunk", "report")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: _tensor_pb2.Chunk
    report: StepReport
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class UploadStatusRequest(_message.Message):
    __slots__ = ("device_id", "step", "attempt")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    step: int
    attempt: int
    def __init__(self, device_id: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class UploadStatus(_message.Message):
    __slots__ = ("received_bytes", "total_bytes")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    total_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("device_id", "payload")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    payload: bytes
    def __init__(self, device_id: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("device_id", "step", "attempt", "reason", "kind")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    step: int
    attempt: int
    reason: str
    kind: FailureKind
    def __init__(self, device_id: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ..., kind: _Optional[_Union[FailureKind, str]] = ...) -> None: ...

class FailureAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceView(_message.Message):
    __slots__ = ("device_id", "info", "state", "left_reason", "seconds_since_seen", "telemetry", "samples_per_s", "samples_done", "energy_per_sample_j", "codec", "rejected_updates", "speed_claim")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEFT_REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    ENERGY_PER_SAMPLE_J_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    REJECTED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    SPEED_CLAIM_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    info: DeviceInfo
    state: str
    left_reason: str
    seconds_since_seen: float
    telemetry: Telemetry
    samples_per_s: float
    samples_done: int
    energy_per_sample_j: float
    codec: str
    rejected_updates: int
    speed_claim: str
    def __init__(self, device_id: _Optional[str] = ..., info: _Optional[_Union[DeviceInfo, _Mapping]] = ..., state: _Optional[str] = ..., left_reason: _Optional[str] = ..., seconds_since_seen: _Optional[float] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., samples_per_s: _Optional[float] = ..., samples_done: _Optional[int] = ..., energy_per_sample_j: _Optional[float] = ..., codec: _Optional[str] = ..., rejected_updates: _Optional[int] = ..., speed_claim: _Optional[str] = ...) -> None: ...

class ListDevicesReply(_message.Message):
    __slots__ = ("job_id", "cluster", "devices")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    cluster: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceView]
    def __init__(self, job_id: _Optional[str] = ..., cluster: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceView, _Mapping]]] = ...) -> None: ...
