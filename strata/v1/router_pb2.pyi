from strata.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_ms", "heartbeat_timeout_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "kv_event_batches_published", "speculative")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_BATCHES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    kv_event_batches_published: int
    speculative: _common_pb2.SpeculativeStats
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., kv_event_batches_published: _Optional[int] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeStats, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.WorkerState
    def __init__(self, state: _Optional[_Union[_common_pb2.WorkerState, str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
