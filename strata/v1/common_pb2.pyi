from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DEAD: _ClassVar[WorkerState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DEAD: WorkerState

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "min_tokens", "prompt_logprobs", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    prompt_logprobs: int
    speculative: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., speculative: _Optional[str] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("sampled", "rank", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: Logprob
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, sampled: _Optional[_Union[Logprob, _Mapping]] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "store_ms", "transfer_ms", "ttft_ms", "decode_ms", "load_lookup_ms", "load_read_ms", "load_verify_ms", "load_install_ms", "blocks_by_tier")
    class BlocksByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_READ_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_INSTALL_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    store_ms: float
    transfer_ms: float
    ttft_ms: float
    decode_ms: float
    load_lookup_ms: float
    load_read_ms: float
    load_verify_ms: float
    load_install_ms: float
    blocks_by_tier: _containers.ScalarMap[str, int]
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., store_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., load_lookup_ms: _Optional[float] = ..., load_read_ms: _Optional[float] = ..., load_verify_ms: _Optional[float] = ..., load_install_ms: _Optional[float] = ..., blocks_by_tier: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KvSpec(_message.Message):
    __slots__ = ("model_fingerprint", "kv_layout", "kv_dtype", "block_size")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    kv_layout: str
    kv_dtype: str
    block_size: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., kv_layout: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "kv")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    kv: KvSpec
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv: _Optional[_Union[KvSpec, _Mapping]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("worker_id", "backend", "agent_address", "region_id", "offset", "length", "transfer_lease_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    backend: str
    agent_address: str
    region_id: str
    offset: int
    length: int
    transfer_lease_id: int
    def __init__(self, worker_id: _Optional[str] = ..., backend: _Optional[str] = ..., agent_address: _Optional[str] = ..., region_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., transfer_lease_id: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("namespace_fingerprint", "block_size", "block_hashes", "num_tokens", "blocks", "lease_id", "lease_deadline_unix_ms", "lease_worker_address", "tail", "tail_tokens", "agent_metadata")
    NAMESPACE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    namespace_fingerprint: bytes
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    lease_id: str
    lease_deadline_unix_ms: int
    lease_worker_address: str
    tail: BlockLocation
    tail_tokens: int
    agent_metadata: bytes
    def __init__(self, namespace_fingerprint: _Optional[bytes] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., lease_id: _Optional[str] = ..., lease_deadline_unix_ms: _Optional[int] = ..., lease_worker_address: _Optional[str] = ..., tail: _Optional[_Union[BlockLocation, _Mapping]] = ..., tail_tokens: _Optional[int] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class CacheTierStats(_message.Message):
    __slots__ = ("tier", "shared", "capacity_bytes", "used_bytes", "blocks", "hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "bytes_read", "bytes_written", "evictions", "promotions", "demotions", "errors", "checksum_failures", "get_latency_p50_ms", "get_latency_p99_ms", "put_latency_p50_ms", "put_latency_p99_ms", "healthy", "dropped", "quota_refused")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    GET_LATENCY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    GET_LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    PUT_LATENCY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    PUT_LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    QUOTA_REFUSED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    shared: bool
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hit_blocks: int
    miss_blocks: int
    hit_tokens: int
    miss_tokens: int
    bytes_read: int
    bytes_written: int
    evictions: int
    promotions: int
    demotions: int
    errors: int
    checksum_failures: int
    get_latency_p50_ms: float
    get_latency_p99_ms: float
    put_latency_p50_ms: float
    put_latency_p99_ms: float
    healthy: bool
    dropped: int
    quota_refused: int
    def __init__(self, tier: _Optional[str] = ..., shared: _Optional[bool] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., miss_tokens: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., errors: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., get_latency_p50_ms: _Optional[float] = ..., get_latency_p99_ms: _Optional[float] = ..., put_latency_p50_ms: _Optional[float] = ..., put_latency_p99_ms: _Optional[float] = ..., healthy: _Optional[bool] = ..., dropped: _Optional[int] = ..., quota_refused: _Optional[int] = ...) -> None: ...

class WorkerCacheStats(_message.Message):
    __slots__ = ("worker_id", "tiers", "collected_at_unix_ms", "error", "pending_writes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[CacheTierStats]
    collected_at_unix_ms: int
    error: str
    pending_writes: int
    def __init__(self, worker_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[CacheTierStats, _Mapping]]] = ..., collected_at_unix_ms: _Optional[int] = ..., error: _Optional[str] = ..., pending_writes: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "pending_prefill_tokens", "running_tokens", "backlog_s", "prefill_tokens_per_s", "prefill_rate_samples", "host_read_latency_s", "host_read_bytes_per_s", "host_read_samples", "disk_read_latency_s", "disk_read_bytes_per_s", "disk_read_samples", "redis_read_latency_s", "redis_read_bytes_per_s", "redis_read_samples", "s3_read_latency_s", "s3_read_bytes_per_s", "s3_read_samples", "transfer_read_latency_s", "transfer_read_bytes_per_s", "transfer_read_samples")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RATE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HOST_READ_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    HOST_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    HOST_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REDIS_READ_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    REDIS_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    REDIS_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    S3_READ_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    S3_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    S3_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_READ_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    pending_prefill_tokens: int
    running_tokens: int
    backlog_s: float
    prefill_tokens_per_s: float
    prefill_rate_samples: int
    host_read_latency_s: float
    host_read_bytes_per_s: float
    host_read_samples: int
    disk_read_latency_s: float
    disk_read_bytes_per_s: float
    disk_read_samples: int
    redis_read_latency_s: float
    redis_read_bytes_per_s: float
    redis_read_samples: int
    s3_read_latency_s: float
    s3_read_bytes_per_s: float
    s3_read_samples: int
    transfer_read_latency_s: float
    transfer_read_bytes_per_s: float
    transfer_read_samples: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., pending_prefill_tokens: _Optional[int] = ..., running_tokens: _Optional[int] = ..., backlog_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_rate_samples: _Optional[int] = ..., host_read_latency_s: _Optional[float] = ..., host_read_bytes_per_s: _Optional[float] = ..., host_read_samples: _Optional[int] = ..., disk_read_latency_s: _Optional[float] = ..., disk_read_bytes_per_s: _Optional[float] = ..., disk_read_samples: _Optional[int] = ..., redis_read_latency_s: _Optional[float] = ..., redis_read_bytes_per_s: _Optional[float] = ..., redis_read_samples: _Optional[int] = ..., s3_read_latency_s: _Optional[float] = ..., s3_read_bytes_per_s: _Optional[float] = ..., s3_read_samples: _Optional[int] = ..., transfer_read_latency_s: _Optional[float] = ..., transfer_read_bytes_per_s: _Optional[float] = ..., transfer_read_samples: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("id", "role", "address", "state", "load", "model", "kv_events_endpoint", "kv_replay_endpoint", "transfer_backends", "tiers", "last_heartbeat_unix_ms", "speculative")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: WorkerRole
    address: str
    state: WorkerState
    load: WorkerLoad
    model: ModelInfo
    kv_events_endpoint: str
    kv_replay_endpoint: str
    transfer_backends: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    last_heartbeat_unix_ms: int
    speculative: SpeculativeStats
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., kv_events_endpoint: _Optional[str] = ..., kv_replay_endpoint: _Optional[str] = ..., transfer_backends: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Iterable[str]] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeStats, _Mapping]] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("method", "methods", "num_speculative_tokens", "verifies", "draft_tokens", "accepted_tokens", "emitted_tokens", "draft_seconds", "verify_seconds", "acceptance_rate", "mean_accepted_length")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    method: str
    methods: _containers.RepeatedScalarFieldContainer[str]
    num_speculative_tokens: int
    verifies: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    draft_seconds: float
    verify_seconds: float
    acceptance_rate: float
    mean_accepted_length: float
    def __init__(self, method: _Optional[str] = ..., methods: _Optional[_Iterable[str]] = ..., num_speculative_tokens: _Optional[int] = ..., verifies: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., emitted_tokens: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ...) -> None: ...

class CacheAdminResult(_message.Message):
    __slots__ = ("worker_id", "tier", "blocks_removed", "bytes_freed", "blocks_demoted", "error", "shared")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tier: str
    blocks_removed: int
    bytes_freed: int
    blocks_demoted: int
    error: str
    shared: bool
    def __init__(self, worker_id: _Optional[str] = ..., tier: _Optional[str] = ..., blocks_removed: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., blocks_demoted: _Optional[int] = ..., error: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class EvictCacheRequest(_message.Message):
    __slots__ = ("worker_id", "tier", "block_hashes", "bytes", "demote")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tier: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    bytes: int
    demote: bool
    def __init__(self, worker_id: _Optional[str] = ..., tier: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., bytes: _Optional[int] = ..., demote: _Optional[bool] = ...) -> None: ...

class EvictCacheResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CacheAdminResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CacheAdminResult, _Mapping]]] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ("worker_id", "tier")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tier: str
    def __init__(self, worker_id: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CacheAdminResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CacheAdminResult, _Mapping]]] = ...) -> None: ...
