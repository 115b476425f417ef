"""The worker's tiered store: host always, disk and Redis when configured (written through in the background)."""
from __future__ import annotations

from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, StoreConfig
from kvstore.store import TieredStore
from worker_common.config import WorkerConfig


def build_store(config: WorkerConfig) -> TieredStore:
    disk = DiskTierConfig(path=config.disk_path) if config.disk_path else None
    redis = RedisTierConfig(url=config.redis_url) if config.redis_url else None
    write_through = tuple(name for name, tier in (("disk", disk), ("redis", redis)) if tier is not None)
    return TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=config.host_tier_bytes), disk=disk,
                                   redis=redis, write_through=write_through))
