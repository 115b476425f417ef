"""Configs of the tiered KV store (DESIGN §5): one frozen dataclass per tier, composed into `StoreConfig`.

Every tier except host is optional (None = not configured). Tiers are always ordered fastest first:
host → disk → redis → s3. Each config validates on construction and names the field that is wrong.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

TIER_ORDER = ("host", "disk", "redis", "s3")
DEMOTION_POLICIES = ("next", "none")

GiB = 1 << 30


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class HostTierConfig:
    """Shared-memory pool of fixed slots. `slot_bytes=0` sizes slots from the first block stored."""

    capacity_bytes: int = 1 * GiB
    slot_bytes: int = 0
    shm_name: str = ""  # empty: a unique name per process; set it so peers can attach by a known name
    populate: bool = False  # fault the whole segment in at creation, in the background (workers: on)

    def __post_init__(self) -> None:
        _require(self.capacity_bytes > 0, f"host.capacity_bytes must be > 0, got {self.capacity_bytes}")
        _require(self.slot_bytes >= 0, f"host.slot_bytes must be >= 0 (0 = auto), got {self.slot_bytes}")
        _require(self.slot_bytes == 0 or self.slot_bytes <= self.capacity_bytes,
                 f"host.slot_bytes ({self.slot_bytes}) must not exceed host.capacity_bytes ({self.capacity_bytes})")
        _require("/" not in self.shm_name, f"host.shm_name must not contain '/', got {self.shm_name!r}")


@dataclass(frozen=True)
class DiskTierConfig:
    """One file per block under `path`. `fsync=True` makes a stored block survive power loss, at a cost."""

    path: str
    capacity_bytes: int = 10 * GiB
    fsync: bool = False
    io_threads: int = 4
    touch_interval_s: float = 30.0  # how stale the LRU order rebuilt after a restart may be

    def __post_init__(self) -> None:
        _require(bool(self.path), "disk.path must be a non-empty directory path")
        _require(self.capacity_bytes > 0, f"disk.capacity_bytes must be > 0, got {self.capacity_bytes}")
        _require(1 <= self.io_threads <= 64, f"disk.io_threads must be in [1, 64], got {self.io_threads}")
        _require(self.touch_interval_s >= 0, f"disk.touch_interval_s must be >= 0, got {self.touch_interval_s}")


@dataclass(frozen=True)
class RedisTierConfig:
    """A Redis server or cluster. `ttl_s=0` keeps keys until Redis evicts them."""

    url: str = "redis://127.0.0.1:6379/0"
    ttl_s: float = 0
    key_prefix: str = "strata:kv"
    cluster: bool = False
    socket_timeout_s: float = 2.0
    quota_bytes: int = 0  # per namespace fingerprint, counted in Redis itself; 0 = none

    def __post_init__(self) -> None:
        _require(self.url.startswith(("redis://", "rediss://", "unix://")),
                 f"redis.url must start with redis://, rediss:// or unix://, got {self.url!r}")
        _require(self.ttl_s >= 0, f"redis.ttl_s must be >= 0 (0 = no expiry), got {self.ttl_s}")
        _require(self.socket_timeout_s > 0, f"redis.socket_timeout_s must be > 0, got {self.socket_timeout_s}")
        _require(self.quota_bytes >= 0, f"redis.quota_bytes must be >= 0 (0 = none), got {self.quota_bytes}")
        _require(not (self.quota_bytes and self.cluster),
                 "redis.quota_bytes needs a single Redis server (cluster=False): a namespace's counter and its "
                 "blocks live in different cluster slots")


@dataclass(frozen=True)
class S3TierConfig:
    """Any S3-compatible store; credentials come from the usual boto3 places.

    `layout`: "pack" (default) stores each batch of blocks as one object and reads a prefix with a few ranged GETs;
    "block" stores one object per block (see kvstore/tiers/s3.py).
    """

    bucket: str
    prefix: str = "strata/kv/"
    endpoint_url: str = ""
    region: str = ""
    create_bucket: bool = False
    layout: str = "pack"
    quota_bytes: int = 0  # per namespace fingerprint, from the pack listing plus this process's writes; 0 = none

    def __post_init__(self) -> None:
        _require(3 <= len(self.bucket) <= 63, f"s3.bucket must be 3 to 63 characters, got {self.bucket!r}")
        _require(self.layout in ("pack", "block"), f"s3.layout must be 'pack' or 'block', got {self.layout!r}")
        _require(self.quota_bytes >= 0, f"s3.quota_bytes must be >= 0 (0 = none), got {self.quota_bytes}")
        _require(not (self.quota_bytes and self.layout != "pack"),
                 f"s3.quota_bytes needs layout='pack' (its pack names carry the namespace), got {self.layout!r}")
        _require(not self.endpoint_url or self.endpoint_url.startswith(("http://", "https://")),
                 f"s3.endpoint_url must be empty or start with http:// or https://, got {self.endpoint_url!r}")


@dataclass(frozen=True)
class StoreConfig:
    """The whole store.

    - `write_through`: lower tiers that every put also goes to, in the background (host is always written).
    - `demotion`: "next" moves a block evicted from a tier into the next configured tier below; "none" drops it.
    - `promote_on_hit`: a hit in a slower tier is copied into host.
    - `queue_depth`: owed background writes that carry their bytes (demotions, blocks host could not keep) at
      most; one beyond it is dropped and counted, never blocks. Write-through carries no bytes (read back from host).
    - `max_pending_writes`: blocks owing a background write at most (keys only); beyond it a write is counted dropped.
    - `write_attempts`: tries of a background write to an unavailable tier (backing off) before it counts as dropped.
    - `lookup_timeout_s`: how long a lookup or read waits for the shared tiers (redis, s3) before treating a tier
      that has not answered as a miss.
    - `backoff_initial_s` / `backoff_max_s`: an unhealthy tier is retried after this, doubling up to the max.
    - `encryption_key_file`: a file of 32 raw bytes or 64 hex characters; set, every tier but host holds its
      blocks sealed with AES-256-GCM (kvstore/sealing.py). Empty: plaintext.
    """

    host: HostTierConfig = field(default_factory=HostTierConfig)
    disk: DiskTierConfig | None = None
    redis: RedisTierConfig | None = None
    s3: S3TierConfig | None = None
    write_through: tuple[str, ...] = ()
    demotion: str = "next"
    promote_on_hit: bool = True
    queue_depth: int = 256
    max_pending_writes: int = 1 << 20
    write_attempts: int = 6
    lookup_timeout_s: float = 2.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    encryption_key_file: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "write_through", tuple(self.write_through))
        if self.encryption_key_file:
            from kvstore.sealing import load_key  # NOTE: lazy: cryptography loads only where encryption is on
            load_key(self.encryption_key_file)  # raises ValueError naming the file and the allowed forms
        for name in self.write_through:
            _require(name in TIER_ORDER[1:], f"write_through entries must be in {TIER_ORDER[1:]}, got {name!r}")
            _require(getattr(self, name) is not None, f"write_through names {name!r} but store.{name} is not set")
        _require(self.demotion in DEMOTION_POLICIES, f"demotion must be one of {DEMOTION_POLICIES}, "
                 f"got {self.demotion!r}")
        _require(1 <= self.queue_depth <= 1 << 20, f"queue_depth must be in [1, 1048576], got {self.queue_depth}")
        _require(1 <= self.max_pending_writes, f"max_pending_writes must be >= 1, got {self.max_pending_writes}")
        _require(1 <= self.write_attempts, f"write_attempts must be >= 1, got {self.write_attempts}")
        _require(self.lookup_timeout_s > 0, f"lookup_timeout_s must be > 0, got {self.lookup_timeout_s}")
        _require(0 < self.backoff_initial_s <= self.backoff_max_s,
                 f"need 0 < backoff_initial_s <= backoff_max_s, got {self.backoff_initial_s}, {self.backoff_max_s}")

    def tier_names(self) -> list[str]:
        """Configured tiers, fastest first."""
        return [name for name in TIER_ORDER if getattr(self, name) is not None]

    def tier_options(self, name: str) -> dict:
        """Keyword options for the tier class registered under `name`."""
        tier_config = getattr(self, name)
        _require(tier_config is not None, f"tier {name!r} is not configured")
        return asdict(tier_config)
