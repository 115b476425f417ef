"""`WorkerConfig`: one frozen, validated config per worker process, filled by the CLI (and later by launchers)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.config import CacheConfig, MoEConfig, ModelConfig, SpeculativeConfig
from kvstore.events.wire import WIRE_PRESETS
from strata import moe_options
from strata.speculative_options import DEFAULT_NUM_SPECULATIVE_TOKENS, speculative_config
from worker_common.fleet_tls import FleetTls

ROLES = ("prefill", "decode")
TRANSFER_BACKENDS = ("shm", "tcp", "nixl")
_EP_INIT = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\s\[\]]+):(\d{1,5})$")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs besides the model's own files.

    - `lease_ttl_s`: how long a prefill worker keeps a handle's blocks pinned without a ReleaseKv.
    - `handoff_bytes`: the prefill worker's registered region that pinned blocks are served from.
    - `transfer_deadline_s`: the decode worker's bound on one batched KV read before it falls back.
    - `redis_url` / `disk_path` / `s3_url`: optional lower store tiers (`write_through` to them from host).
    - `kv_encryption_key_file`: a 32-byte key (raw or 64 hex characters); set, the disk, Redis and S3 tiers hold
      their blocks sealed with AES-256-GCM (kvstore/sealing.py). `tier_quota_bytes`: bytes each namespace (tenant)
      may hold in each shared tier (Redis, S3); 0 = no quota.
    - `kv_events_endpoint` / `kv_replay_endpoint`: ZeroMQ binds of the KV-event PUB and replay sockets (DESIGN §6);
      `tcp://127.0.0.1:*` picks a free port (printed on READY); an empty `kv_events_endpoint` publishes nothing (and
      binds no replay socket either). `kv_events_format`: the vLLM release whose consumers read the stream
      (`kvstore.events.WIRE_PRESETS`): "vllm" (current: map events, topic-framed replays), "vllm-0.25", "vllm-0.23".
    - `router_address`: the router's Registry (host:port) to register with and heartbeat every `heartbeat_s`;
      empty = do not register (the router may still probe this worker with `--worker`). `advertise_host` replaces
      a wildcard bind host (0.0.0.0) in the addresses it registers (default: `host`, else the machine's name).
    - `model_id`: the model name the worker registers under; empty = the checkpoint folder's name (the router's
      default too).
    - `metrics_port`: Prometheus `/metrics` over HTTP on `host` (its tiers and load); 0 = a free port (printed on
      READY), -1 = none.
    - `speculative` (ngram, draft, eagle; None = off), `num_speculative_tokens`, `speculative_model` (the draft
      checkpoint or EAGLE head; None = the bundled one), `speculative_adaptive`: speculative decoding on a decode
      worker. A prefill worker samples one token per request and never speculates: it accepts and ignores them.
    - `expert_parallel`: this role runs as that many ranks on one host, sharding the MoE experts (1 = a plain
      worker; `worker_common.ep_worker`). `ep_rank` (0 = the rank the router talks to, which starts the others) and
      `ep_init` (tcp://HOST:PORT of the group's rendezvous; empty on rank 0 = a free loopback port) are set by rank 0
      for the ranks it starts. `moe_capacity_factor` (None = no limit), `moe_overflow` (drop | next),
      `num_redundant_experts`, `eplb_interval`, `eplb_window`: the sparse layers' `engine.config.MoEConfig`.
    - `max_requests`: requests the worker holds at once (each holds one of its `grpc_threads` while it runs or
      streams); past it RESOURCE_EXHAUSTED with a retry hint, and the threads left answer Health, Stats, ReleaseKv
      and Abort however busy it is.
    - `cluster_secret`: the fleet's shared secret (empty = none): required on the router's Registry, on every
      Worker RPC but Health, and on tcp transfer reads; `strata serve` draws one per launch.
    - `fleet_tls_cert_file` / `fleet_tls_key_file` / `fleet_tls_ca_file`: fleet TLS (all three or none;
      worker_common.fleet_tls): the gRPC port serves mTLS, the registration and peer channels dial with TLS, and
      the tcp transfer's connections are TLS both ways.
    """

    role: str
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    transfer: str = "shm"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enforce_eager: bool = False
    quantization: str | None = None
    quant_group_size: int = 128
    quantize_vocab: bool = False
    kv_cache_dtype: str = "auto"
    speculative: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    speculative_model: str | None = None
    speculative_adaptive: bool = True
    lease_ttl_s: float = 30.0
    handoff_bytes: int = 256 << 20
    host_tier_bytes: int = 256 << 20
    transfer_deadline_s: float = 2.0
    disk_path: str = ""
    redis_url: str = ""
    s3_url: str = ""
    kv_encryption_key_file: str = ""
    tier_quota_bytes: int = 0
    kv_events_endpoint: str = "tcp://127.0.0.1:*"
    kv_replay_endpoint: str = "tcp://127.0.0.1:*"
    kv_events_format: str = "vllm"
    router_address: str = ""
    advertise_host: str = ""
    heartbeat_s: float = 2.0
    drain_timeout_s: float = 30.0
    model_id: str = ""
    grpc_threads: int = 512
    max_requests: int = 448
    metrics_port: int = -1
    expert_parallel: int = 1
    ep_rank: int = 0
    ep_init: str = ""
    moe_capacity_factor: float | None = None
    moe_overflow: str = "drop"
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    eplb_window: int = 200
    cluster_secret: str = field(default="", repr=False)   # NOTE: never in a log line or a traceback
    fleet_tls_cert_file: str = ""
    fleet_tls_key_file: str = ""
    fleet_tls_ca_file: str = ""

    def __post_init__(self) -> None:
        ModelConfig(self.model or "-", dtype=self.dtype, quantization=self.quantization,
                    quant_group_size=self.quant_group_size,
                    quantize_vocab=self.quantize_vocab)                # validates those fields, naming them
        CacheConfig(self.block_size, kv_cache_dtype=self.kv_cache_dtype)
        self.speculative_config()                                     # validates the speculative fields
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        _require(self.transfer in TRANSFER_BACKENDS,
                 f"transfer must be one of {TRANSFER_BACKENDS}, got {self.transfer!r}")
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535] (0 = a free port), got {self.port}")
        _require(-1 <= self.metrics_port <= 65535,
                 f"metrics_port must be in [-1, 65535] (0 = a free port, -1 = none), got {self.metrics_port}")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0 seconds, got {self.drain_timeout_s}")
        _require(self.lease_ttl_s > 0, f"lease_ttl_s must be > 0 seconds, got {self.lease_ttl_s}")
        _require(self.transfer_deadline_s > 0,
                 f"transfer_deadline_s must be > 0 seconds, got {self.transfer_deadline_s}")
        _require(self.handoff_bytes >= 1 << 20, f"handoff_bytes must be >= 1 MiB, got {self.handoff_bytes}")
        _require(self.host_tier_bytes >= 1 << 20, f"host_tier_bytes must be >= 1 MiB, got {self.host_tier_bytes}")
        _require(1 <= self.grpc_threads <= 1024, f"grpc_threads must be in [1, 1024], got {self.grpc_threads}")
        _require(1 <= self.max_requests <= self.grpc_threads - 16,
                 f"max_requests must be in [1, grpc_threads - 16 = {self.grpc_threads - 16}] (each request holds a "
                 f"gRPC thread; the rest answer Health, Stats, ReleaseKv and Abort), got {self.max_requests}")
        _require(not self.redis_url or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                 f"redis_url must be empty or start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        _require(not self.s3_url or self.s3_url.startswith(("s3://", "http://", "https://")),
                 f"s3_url must be empty or s3://BUCKET[/PREFIX] or http(s)://HOST:PORT/BUCKET[/PREFIX], "
                 f"got {self.s3_url!r}")
        _require(self.tier_quota_bytes >= 0, f"tier_quota_bytes must be >= 0 (0 = none), got {self.tier_quota_bytes}")
        if self.kv_encryption_key_file:
            from kvstore.sealing import load_key  # NOTE: lazy: cryptography loads only where encryption is on
            load_key(self.kv_encryption_key_file)  # a bad key file fails here, naming it, before the model loads
        _require(self.kv_events_format in WIRE_PRESETS, f"kv_events_format must be one of {sorted(WIRE_PRESETS)}, "
                                                        f"got {self.kv_events_format!r}")
        for name in ("kv_events_endpoint", "kv_replay_endpoint"):
            value = getattr(self, name)
            _require(not value or value.startswith(("tcp://", "ipc://", "inproc://")),
                     f"{name} must be empty or a ZeroMQ endpoint (tcp://HOST:PORT, tcp://HOST:* or ipc://PATH), "
                     f"got {value!r}")
        _require(0.05 <= self.heartbeat_s <= 3600, f"heartbeat_s must be in [0.05, 3600] seconds, "
                                                   f"got {self.heartbeat_s}")
        _require(not self.router_address or ":" in self.router_address,
                 f"router_address must be empty or HOST:PORT, got {self.router_address!r}")
        self._check_expert_parallel()
        self.fleet_tls()                                              # validates the three files together

    def fleet_tls(self) -> FleetTls:
        """The fleet TLS files (`enabled` False: plain text on every internal link)."""
        return FleetTls(self.fleet_tls_cert_file, self.fleet_tls_key_file, self.fleet_tls_ca_file)

    def _check_expert_parallel(self) -> None:
        self.moe_config()                                             # validates the MoE fields, naming them
        n = self.expert_parallel
        _require(isinstance(self.ep_rank, int) and 0 <= self.ep_rank < n,
                 f"ep_rank must be in [0, {n - 1}] (expert_parallel={n}), got {self.ep_rank!r}")
        match = _EP_INIT.match(self.ep_init)
        _require(not self.ep_init or (match is not None and 1 <= int(match.group(2)) <= 65535),
                 f"ep_init must be empty or tcp://HOST:PORT (PORT in [1, 65535]), got {self.ep_init!r}")
        _require(not self.ep_init or n > 1, f"ep_init is only used with expert_parallel > 1, got {self.ep_init!r}")
        if self.ep_rank > 0:
            _require(bool(self.ep_init), f"ep_init must be set on ep_rank {self.ep_rank} (rank 0 passes its "
                                         "rendezvous to the ranks it starts)")
            _require(not self.router_address, f"router_address must be empty on ep_rank {self.ep_rank}: only rank 0 "
                                              f"registers (the group's front), got {self.router_address!r}")

    def moe_config(self) -> MoEConfig:
        """The sparse layers' config: the expert-parallel backend when `expert_parallel` > 1, else the local one."""
        return moe_options.moe_config({name: getattr(self, name) for name, _, _ in moe_options.OPTIONS})

    def speculative_config(self) -> SpeculativeConfig:
        """The engine's speculative decoding config, its drafter's folder resolved (`method` None: off)."""
        return speculative_config(self.speculative, self.num_speculative_tokens, self.speculative_model,
                                  self.speculative_adaptive)
