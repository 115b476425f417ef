from strata.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("skip_text", "include_prompt_token_ids", "include_metrics")
    SKIP_TEXT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_METRICS_FIELD_NUMBER: _ClassVar[int]
    skip_text: bool
    include_prompt_token_ids: bool
    include_metrics: bool
    def __init__(self, skip_text: _Optional[bool] = ..., include_prompt_token_ids: _Optional[bool] = ..., include_metrics: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "sampling", "request_id", "cache_salt", "stream_options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    request_id: str
    cache_salt: str
    stream_options: StreamOptions
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "disaggregated", "timings", "blocks_transferred", "blocks_from_store", "blocks_recomputed", "tail_tokens_transferred")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKENS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    disaggregated: bool
    timings: _common_pb2.Timings
    blocks_transferred: int
    blocks_from_store: int
    blocks_recomputed: int
    tail_tokens_transferred: int
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., disaggregated: _Optional[bool] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., blocks_transferred: _Optional[int] = ..., blocks_from_store: _Optional[int] = ..., blocks_recomputed: _Optional[int] = ..., tail_tokens_transferred: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "finish_reason", "usage", "prompt_token_ids", "stop_str", "stop_token_id", "metrics", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_str: str
    stop_token_id: int
    metrics: RequestMetrics
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ...) -> None: ...

class GetCacheStatsRequest(_message.Message):
    __slots__ = ("worker_ids", "tier")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    tier: str
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., tier: _Optional[str] = ...) -> None: ...

class GetCacheStatsResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerCacheStats]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerCacheStats, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role", "include_dead")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DEAD_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    include_dead: bool
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., include_dead: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ...) -> None: ...
