"""`WorkerConfig`: one frozen, validated config per worker process, filled by the CLI (and later by launchers)."""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode")
TRANSFER_BACKENDS = ("shm", "tcp")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs besides the model's own files.

    - `lease_ttl_s`: how long a prefill worker keeps a handle's blocks pinned without a ReleaseKv.
    - `handoff_bytes`: the prefill worker's registered region that pinned blocks are served from.
    - `transfer_deadline_s`: the decode worker's bound on one batched KV read before it falls back.
    - `redis_url` / `disk_path`: optional lower store tiers (`write_through` to them from host).
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
    lease_ttl_s: float = 30.0
    handoff_bytes: int = 256 << 20
    host_tier_bytes: int = 256 << 20
    transfer_deadline_s: float = 2.0
    disk_path: str = ""
    redis_url: str = ""
    grpc_threads: int = 128

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        _require(self.transfer in TRANSFER_BACKENDS,
                 f"transfer must be one of {TRANSFER_BACKENDS}, got {self.transfer!r}")
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535] (0 = a free port), got {self.port}")
        _require(self.lease_ttl_s > 0, f"lease_ttl_s must be > 0 seconds, got {self.lease_ttl_s}")
        _require(self.transfer_deadline_s > 0,
                 f"transfer_deadline_s must be > 0 seconds, got {self.transfer_deadline_s}")
        _require(self.handoff_bytes >= 1 << 20, f"handoff_bytes must be >= 1 MiB, got {self.handoff_bytes}")
        _require(self.host_tier_bytes >= 1 << 20, f"host_tier_bytes must be >= 1 MiB, got {self.host_tier_bytes}")
        _require(1 <= self.grpc_threads <= 1024, f"grpc_threads must be in [1, 1024], got {self.grpc_threads}")
        _require(not self.redis_url or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                 f"redis_url must be empty or start with redis://, rediss:// or unix://, got {self.redis_url!r}")
