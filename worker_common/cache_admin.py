"""EvictCache / FlushCache on one worker (common.proto `EvictCacheRequest`, `FlushCacheRequest`): one
`CacheAdminResult` per tier touched, and the KV events that tell routers what left.

    tier      evict block_hashes                evict bytes                    flush
    device    cached-free blocks, not in use    oldest cached-free first       every cached-free block
    host/disk delete                            least recently used first      clear
    redis/s3  one delete of every hash          refused: no LRU order          clear (only when named)
              (only when named)

An empty `tier` means every *local* tier (device, host, disk): shared tiers hold every worker's blocks, so they are
touched only when named, and then by one worker for all (the router asks one; results say `shared`). On a shared
tier the counts are the backend's: `delete` answers how many objects it removed (no existence check per key first:
on S3 that is a request per key), a flush counts what the backend held (Redis SCAN, S3 LIST) just before. Its
`bytes_freed` counts only blocks whose size this worker had seen (the backend reports no sizes on delete).
Blocks in use by a running request or pinned under a lease stay (the proto's contract).
Events: device removals come from the pool's own hook (`BlockRemoved` medium device); store tiers publish
`BlockRemoved` with the keys that left; a flush of every tier the worker runs publishes `AllBlocksCleared`, and so
does a flush of a shared tier, whose keys this worker cannot list (the router then forgets this worker's entries:
a safe under-estimate, never a wrong hit).
`demote` moves store blocks one tier down (`worker_common.demotion`; `blocks_demoted`, the rest `blocks_removed`);
the last tier has nowhere to demote to (an error result). The device tier's KV is written through to host when
computed, so a demoted device block counts as demoted when host holds it, else as removed.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

from engine.block_pool import BlockPool
from kvstore.hashing import HASH_BYTES
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from strata.v1 import common_pb2
from worker_common.cache_stats import SHARED_TIERS
from worker_common.convert import InvalidArgument
from worker_common.demotion import demote
from worker_common.engine_loop import EngineLoop
from worker_common.kv_blocks import slot_bytes
from worker_common.kv_events import WorkerEvents
from worker_common.store_setup import LOCAL_TIERS

log = logging.getLogger(__name__)

DEVICE = "device"


# ---- the device tier (engine thread only) ------------------------------------------------------------------------

# ---- the admin ---------------------------------------------------------------------------------------------------

class CacheAdmin:
    def __init__(self, worker_id: str, loop: EngineLoop, store: TieredStore, events: WorkerEvents) -> None:
        self.worker_id, self.loop, self.store, self.events = worker_id, loop, store, events
        bundle = loop.bundle
        self.block_bytes = bundle.span_bytes
        self.encoded_bytes = slot_bytes(bundle)          # one encoded block of this worker's namespace
        self.tiers = (DEVICE, *store.stats().keys())     # fastest first

    # -- requests (InvalidArgument names the field) --

    def _check(self, worker_id: str, tier: str) -> list[str]:
        if worker_id and worker_id != self.worker_id:
            raise InvalidArgument(f"worker_id must be empty or this worker's id {self.worker_id!r}, got {worker_id!r}")
        if tier and tier not in self.tiers:
            raise InvalidArgument(f"tier must be empty or one of this worker's tiers {list(self.tiers)}, got {tier!r}")
        return [tier] if tier else [t for t in self.tiers if t == DEVICE or t in LOCAL_TIERS]

    def evict(self, request: common_pb2.EvictCacheRequest) -> list[common_pb2.CacheAdminResult]:
        tiers = self._check(request.worker_id, request.tier)
        if bool(request.block_hashes) == bool(request.bytes):
            raise InvalidArgument("exactly one of block_hashes and bytes must be given")
        if any(len(h) != HASH_BYTES for h in request.block_hashes):
            raise InvalidArgument(f"block_hashes must be {HASH_BYTES} bytes each")
        hashes = [bytes(h) for h in request.block_hashes]
        return [self._guarded(t, lambda t=t: self._evict_tier(t, hashes, request.bytes, request.demote))
                for t in tiers]

    def flush(self, request: common_pb2.FlushCacheRequest) -> list[common_pb2.CacheAdminResult]:
        tiers = self._check(request.worker_id, request.tier)
        results = [self._guarded(t, lambda t=t: self._flush_tier(t, announce=len(tiers) < len(self.tiers)))
                   for t in tiers]
        if len(tiers) == len(self.tiers):
            self.events.cleared()  # every tier this worker runs is empty (but what is in use or leased)
        return results

    # -- per tier --

    def _guarded(self, tier: str, action: Callable[[], common_pb2.CacheAdminResult]) -> common_pb2.CacheAdminResult:
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - one tier's failure is its result; the others still run
            log.warning("cache admin on tier %s failed: %s", tier, exc)
            return self._result(tier, error=f"{type(exc).__name__}: {exc}")

    def _evict_tier(self, tier: str, hashes: list[bytes], nbytes: int, demoting: bool) -> common_pb2.CacheAdminResult:
        if tier == DEVICE:
            return self._on_device(lambda pool: self._device_victims(pool, hashes, nbytes), demoting)
        store_tier = self.store.tier(tier)
        if demoting and self._below(tier) is None:
            return self._result(tier, error=f"{tier} is this worker's slowest tier: nothing to demote into")
        if hashes:
            shared = tier in SHARED_TIERS  # NOTE: `delete` counts what the backend held; asking first costs a trip
            keys = hashes if shared else [h for h, held in zip(hashes, store_tier.contains(hashes)) if held]
            before = store_tier.stats().used_bytes
            dropped, demoted = self._drop(tier, store_tier, keys, demoting)
            return self._result(tier, dropped, max(0, before - store_tier.stats().used_bytes), demoted)
        if not hasattr(store_tier, "keys_lru_order"):
            return self._result(tier, error=f"evicting bytes from the shared {tier} tier is not supported "
                                            "(it keeps no LRU order): name block_hashes")
        return self._evict_bytes(tier, store_tier, nbytes, demoting)

    def _device_victims(self, pool: BlockPool, hashes: list[bytes], nbytes: int) -> list[int]:
        if hashes:
            return [b for b in (pool.lookup(h) for h in hashes) if b is not None]
        wanted = -(-nbytes // self.block_bytes)
        return pool.cached_free_blocks()[:wanted]

    def _flush_tier(self, tier: str, announce: bool) -> common_pb2.CacheAdminResult:
        if tier == DEVICE:
            return self._on_device(BlockPool.cached_free_blocks, demoting=False)
        store_tier = self.store.tier(tier)
        if tier in SHARED_TIERS:
            return self._flush_shared(tier, store_tier, announce)
        before = store_tier.stats()
        keys = store_tier.keys_lru_order()
        store_tier.clear()
        if announce:
            self.events.removed(tier, keys)
        after = store_tier.stats()
        return self._result(tier, max(0, before.blocks - after.blocks), max(0, before.used_bytes - after.used_bytes))

    def _flush_shared(self, tier: str, store_tier: Tier, announce: bool) -> common_pb2.CacheAdminResult:
        held = _backend_usage(store_tier)
        cleared = store_tier.clear()
        if announce:
            self.events.cleared(tier)  # the router clears this tier for every worker, never their host or disk
        blocks = cleared if isinstance(cleared, int) else held.blocks  # Redis's clear counts what it unlinked
        return self._result(tier, blocks, held.bytes)

    def _on_device(self, victims: Callable[[BlockPool], list[int]], demoting: bool) -> common_pb2.CacheAdminResult:
        """Evict on the engine thread (the pool's hook publishes the device's BlockRemoved)."""
        def run() -> list[bytes]:
            pool = self.loop.engine.block_manager.pool
            evicted = pool.evict_cached(victims(pool))
            if self.loop.events is not None:
                self.loop.events.flush()  # NOTE: now, so the device's BlockRemoved precede what the caller publishes
            return evicted
        evicted = self.loop.post(run).result(timeout=30)
        demoted = sum(self.store.host.contains(evicted)) if demoting and evicted else 0
        return self._result(DEVICE, len(evicted) - demoted, len(evicted) * self.block_bytes, demoted)

    def _evict_bytes(self, tier: str, store_tier: Tier, nbytes: int, demoting: bool) -> common_pb2.CacheAdminResult:
        """Drop (or demote) least recently used blocks until `nbytes` are freed (or the tier is empty)."""
        start = store_tier.stats().used_bytes
        dropped = demoted = 0
        order = list(store_tier.keys_lru_order())
        while order and start - store_tier.stats().used_bytes < nbytes:
            count = _blocks_for(store_tier, nbytes - (start - store_tier.stats().used_bytes))
            batch, order = order[:count], order[count:]
            gone, moved = self._drop(tier, store_tier, batch, demoting)
            dropped, demoted = dropped + gone, demoted + moved
        return self._result(tier, dropped, max(0, start - store_tier.stats().used_bytes), demoted)

    def _drop(self, tier: str, store_tier: Tier, keys: list[bytes], demoting: bool) -> tuple[int, int]:
        """Remove `keys` from a store tier, moving them one tier down when demoting: (dropped, demoted)."""
        if not keys:
            return 0, 0
        if demoting:
            below = self._below(tier)
            moved = demote(tier, store_tier, below, self.store.tier(below), keys, self.encoded_bytes, self.events)
            return moved.dropped, moved.demoted
        removed = store_tier.delete(keys)
        self.events.removed(tier, keys)
        return removed, 0

    def _below(self, tier: str) -> str | None:
        i = self.tiers.index(tier)
        return self.tiers[i + 1] if i + 1 < len(self.tiers) else None

    def _result(self, tier: str, removed: int = 0, freed: int = 0, demoted: int = 0,
                error: str = "") -> common_pb2.CacheAdminResult:
        return common_pb2.CacheAdminResult(worker_id=self.worker_id, tier=tier, blocks_removed=removed,
                                           bytes_freed=freed, blocks_demoted=demoted, error=error,
                                           shared=tier in SHARED_TIERS)


class Usage(NamedTuple):
    blocks: int
    bytes: int


def _backend_usage(store_tier: Tier) -> Usage:
    """What a shared backend holds under this tier's prefix and namespace: Redis by SCAN (`scan_usage`), S3 by
    LIST (`refresh_index`, which takes every listed object's size); else what this worker has seen."""
    if hasattr(store_tier, "scan_usage"):
        return Usage(*store_tier.scan_usage())
    if hasattr(store_tier, "refresh_index"):
        store_tier.refresh_index()
    stats = store_tier.stats()
    return Usage(stats.blocks, stats.used_bytes)


def _blocks_for(store_tier: Tier, nbytes: int) -> int:
    """Blocks to remove to free about `nbytes`, from the tier's mean block size (tiers expose no object's size)."""
    stats = store_tier.stats()
    mean = max(1, stats.used_bytes // stats.blocks) if stats.blocks else 1
    return max(1, -(-nbytes // mean))
