from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class SplitDescription(_message.Message):
    __slots__ = ("name", "samples", "block_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    samples: int
    block_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, name: _Optional[str] = ..., samples: _Optional[int] = ..., block_sha256: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DatasetDescription(_message.Message):
    __slots__ = ("dataset", "block_samples", "image_shape", "splits", "classes")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    block_samples: int
    image_shape: _containers.RepeatedScalarFieldContainer[int]
    splits: _containers.RepeatedCompositeFieldContainer[SplitDescription]
    classes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dataset: _Optional[str] = ..., block_samples: _Optional[int] = ..., image_shape: _Optional[_Iterable[int]] = ..., splits: _Optional[_Iterable[_Union[SplitDescription, _Mapping]]] = ..., classes: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockRequest(_message.Message):
    __slots__ = ("dataset", "split", "block")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    split: str
    block: int
    def __init__(self, dataset: _Optional[str] = ..., split: _Optional[str] = ..., block: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("first_sample", "images", "labels")
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    first_sample: int
    images: bytes
    labels: bytes
    def __init__(self, first_sample: _Optional[int] = ..., images: _Optional[bytes] = ..., labels: _Optional[bytes] = ...) -> None: ...
