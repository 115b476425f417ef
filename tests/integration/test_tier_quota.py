"""The Redis tier's per-namespace byte quota against a real redis-server: the counters live in Redis, so two tiers
(two workers) share one quota; deletes give bytes back; the public and a tenant namespace are counted apart; a
refused write through the store is counted and never blocks `put`."""
from __future__ import annotations

from kvstore.config import HostTierConfig, RedisTierConfig, StoreConfig
from kvstore.metrics import stats_dict
from kvstore.sealing import Sealer, SealedTier
from kvstore.store import TieredStore
from kvstore.tiers.redis import RedisTier
from tests.integration.store_factories import SLOT
from tests.unit.test_tier_quota import BLOCK, NS, TENANT, make_blocks
from worker_common.cache_stats import store_tier_stats


def make_tier(server, prefix: str, quota: int) -> RedisTier:
    return RedisTier(url=server.url, key_prefix=prefix, quota_bytes=quota)


def test_two_workers_share_one_quota_per_namespace_kept_in_redis(redis_server, redis_key_prefix):
    a, b = make_tier(redis_server, redis_key_prefix, 3 * BLOCK), make_tier(redis_server, redis_key_prefix, 3 * BLOCK)
    public, tenant = make_blocks(NS, 5), make_blocks(TENANT, 5)
    assert a.put(public[:2]) == [True, True]
    assert b.put(public[2:5]) == [True, False, False]  # the other worker's two blocks count
    assert b.put(tenant[:3]) == [True] * 3            # a tenant's namespace has its own quota
    assert a.namespace_usage(NS.fingerprint()) == b.namespace_usage(TENANT.fingerprint()) == 3 * BLOCK
    assert b.stats().quota_refused == 2 and a.stats().quota_refused == 0
    assert a.put(public[:1]) == [True]                 # already stored: no bytes, not refused


def test_deletes_give_bytes_back_and_clear_resets_the_counters(redis_server, redis_key_prefix):
    tier = make_tier(redis_server, redis_key_prefix, 2 * BLOCK)
    blocks = make_blocks(TENANT, 3)
    tier.put(blocks[:2])
    assert tier.delete([blocks[0][0], blocks[0][0]]) == 1  # the second delete of it finds nothing to give back
    assert tier.namespace_usage(TENANT.fingerprint()) == BLOCK
    assert tier.put(blocks[2:]) == [True]
    tier.clear()
    assert tier.namespace_usage(TENANT.fingerprint()) == 0 and tier.scan_usage() == (0, 0)


def test_sealed_blocks_are_charged_at_their_sealed_size(redis_server, redis_key_prefix):
    tier = SealedTier(make_tier(redis_server, redis_key_prefix, 1 << 20), Sealer(bytes(32)))
    tier.put(make_blocks(TENANT, 2))
    assert tier.namespace_usage(TENANT.fingerprint()) == 2 * (BLOCK + 56)


def test_a_write_past_the_quota_through_the_store_is_counted_not_blocking(redis_server, redis_key_prefix):
    config = StoreConfig(host=HostTierConfig(capacity_bytes=16 * SLOT, slot_bytes=SLOT),
                         redis=RedisTierConfig(url=redis_server.url, key_prefix=redis_key_prefix,
                                               quota_bytes=2 * BLOCK), write_through=("redis",))
    with TieredStore(config) as store:
        result = store.put(make_blocks(TENANT, 4))
        assert result.stored == 4 and result.queued == 4  # the forward pass only queues the writes
        assert store.flush(10)
        stats = store.stats()["redis"]
        assert stats.quota_refused == 2 and stats.blocks == 2
        # what a worker's Stats answers (and `strata cache stats` and the router's /metrics show) carries it too
        tier = store_tier_stats("redis", stats_dict(store)["tiers"]["redis"], block_size=16)
        assert (tier.tier, tier.shared, tier.quota_refused, tier.blocks) == ("redis", True, 2, 2)
