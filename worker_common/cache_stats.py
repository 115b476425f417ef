"""`WorkerCacheStats` of one worker (what Stats answers and `strata cache stats` prints): the device tier from the
engine's prefix cache, then every store tier from `kvstore.metrics.stats_dict`, fastest first.

    device   blocks = hashed (reusable) device blocks; used_bytes = blocks holding KV (in use or cached-free);
             hits / misses = the block manager's prefix-cache lookups, by blocks and by tokens;
             evictions = cached blocks the pool reused for new KV
    host...  the store's counters; a tier block is `block_size` tokens, so tokens = blocks * block_size;
             p50 / p99 latency from the tier's histogram: the upper bound of the bucket the quantile falls in
             (the last finite bound for the +Inf bucket), in ms
"""
from __future__ import annotations

from typing import Sequence

from kvstore.metrics import stats_dict
from kvstore.store import TieredStore
from kvstore.tiers.base import LATENCY_BUCKETS
from strata.v1 import common_pb2
from worker_common.engine_setup import EngineBundle

SHARED_TIERS = ("redis", "s3")


def latency_quantile_ms(counts: Sequence[int], q: float) -> float:
    """The q-quantile of a bucketed histogram (`LATENCY_BUCKETS` + +Inf), as the bucket's upper bound in ms."""
    total = sum(counts)
    if not total:
        return 0.0
    rank, running = q * total, 0
    for i, count in enumerate(counts):
        running += count
        if running >= rank:
            return LATENCY_BUCKETS[min(i, len(LATENCY_BUCKETS) - 1)] * 1000.0
    return LATENCY_BUCKETS[-1] * 1000.0


def device_tier_stats(bundle: EngineBundle) -> common_pb2.CacheTierStats:
    """Read from any thread: plain ints the engine thread updates (a snapshot may be one step old)."""
    manager = bundle.engine.block_manager
    pool, prefix = manager.pool, manager.stats
    block_bytes = bundle.span_bytes
    hashed = sum(1 for h in list(pool.block_hashes) if h is not None)
    holding = pool.num_used_blocks + pool.num_cached_free_blocks
    return common_pb2.CacheTierStats(
        tier="device", shared=False, capacity_bytes=pool.num_blocks * block_bytes, used_bytes=holding * block_bytes,
        blocks=hashed, hit_blocks=prefix.hit_blocks, miss_blocks=prefix.query_blocks - prefix.hit_blocks,
        hit_tokens=prefix.hit_tokens, miss_tokens=prefix.query_tokens - prefix.hit_tokens,
        evictions=pool.num_evictions, healthy=True)


def store_tier_stats(name: str, entry: dict, block_size: int) -> common_pb2.CacheTierStats:
    get_counts, put_counts = entry["get_latency"]["counts"], entry["put_latency"]["counts"]
    return common_pb2.CacheTierStats(
        tier=name, shared=name in SHARED_TIERS, capacity_bytes=entry["capacity_bytes"],
        used_bytes=entry["used_bytes"], blocks=entry["blocks"], hit_blocks=entry["hits"],
        miss_blocks=entry["misses"], hit_tokens=entry["hits"] * block_size, miss_tokens=entry["misses"] * block_size,
        bytes_read=entry["bytes_read"], bytes_written=entry["bytes_written"], evictions=entry["evictions"],
        promotions=entry["promotions"], demotions=entry["demotions"], errors=entry["errors"],
        checksum_failures=entry["checksum_failures"], dropped=entry.get("dropped", 0),
        quota_refused=entry.get("quota_refused", 0),
        get_latency_p50_ms=latency_quantile_ms(get_counts, 0.5),
        get_latency_p99_ms=latency_quantile_ms(get_counts, 0.99),
        put_latency_p50_ms=latency_quantile_ms(put_counts, 0.5),
        put_latency_p99_ms=latency_quantile_ms(put_counts, 0.99), healthy=bool(entry["healthy"]))


def cache_stats(worker_id: str, bundle: EngineBundle, store: TieredStore,
                collected_at_ms: int) -> common_pb2.WorkerCacheStats:
    store_stats = stats_dict(store)
    tiers = [device_tier_stats(bundle)]
    tiers += [store_tier_stats(name, entry, bundle.block_size) for name, entry in store_stats["tiers"].items()]
    return common_pb2.WorkerCacheStats(worker_id=worker_id, tiers=tiers, collected_at_unix_ms=collected_at_ms,
                                       pending_writes=store_stats.get("pending_writes", 0))
