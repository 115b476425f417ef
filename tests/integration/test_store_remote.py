"""TieredStore over all four tiers with a real redis-server and a real S3-compatible server (moto), both started
on free loopback ports by tests/integration/conftest.py. The store is built from config alone (TIER_REGISTRY)."""
from __future__ import annotations

import time

import pytest

from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, S3TierConfig, StoreConfig
from kvstore.hashing import Namespace, hash_blocks
from kvstore.store import TieredStore

NS = Namespace("tiny@remote-test", "bs4-l1-h2-d8", "float16")
FP = NS.fingerprint()
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=2, head_dim=8)
TOKENS = list(range(300, 300 + 4 * 16))
HASHES = hash_blocks(NS, TOKENS, 4)
SLOT = 4096


def items(*indices: int) -> list[tuple[bytes, bytes]]:
    return [(HASHES[i], codec.encode(FP, HASHES[i], LAYOUT, "float16", bytes([i + 1]) * 256,
                                     tokens=TOKENS[4 * i:4 * i + 4])) for i in indices]


def get(store: TieredStore, *indices: int):
    return store.get([HASHES[i] for i in indices], [bytearray(SLOT) for _ in indices], FP)


@pytest.fixture
def s3_credentials(monkeypatch, s3_server):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)


def make_config(tmp_path, redis_url: str, key_prefix: str, s3=None, host_slots: int = 16, disk_bytes: int = 1 << 20,
                **policy) -> StoreConfig:
    return StoreConfig(host=HostTierConfig(capacity_bytes=host_slots * SLOT, slot_bytes=SLOT),
                       disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=disk_bytes),
                       redis=RedisTierConfig(url=redis_url, key_prefix=key_prefix, socket_timeout_s=0.5),
                       s3=s3, **policy)


def test_four_tiers_lookup_get_and_promote(tmp_path, redis_server, redis_key_prefix, s3_server, s3_bucket,
                                           s3_credentials):
    s3 = S3TierConfig(bucket=s3_bucket, endpoint_url=s3_server.url, region=s3_server.region)
    config = make_config(tmp_path, redis_server.url, redis_key_prefix, s3=s3, write_through=("redis", "s3"))
    with TieredStore(config) as store:
        store.put(items(0, 1, 2, 3))
        assert store.flush(30)
        assert store.lookup(HASHES[:5]).per_tier == {"host": 4, "disk": 0, "redis": 0, "s3": 0}
        assert store.tier("redis").contains(HASHES[:5]) == store.tier("s3").contains(HASHES[:5]) == [True] * 4 + [False]
        store.tier("host").clear()
        store.tier("redis").delete(HASHES[2:4])  # blocks 2 and 3 now live only in S3
        found = store.lookup(HASHES[:5])
        assert found.tiers == ("redis", "redis", "s3", "s3") and found.per_tier["s3"] == 2
        result = get(store, 0, 1, 2, 3, 4)
        assert result.tiers == ["redis", "redis", "s3", "s3", None] and result.num_hit_blocks == 4
        assert [bytes(b.payload[:1]) for b in result.blocks[:4]] == [b"\x01", b"\x02", b"\x03", b"\x04"]
        lookup = store.lookup(HASHES[:4])
        assert lookup.tiers == ("host",) * 4
        stats = store.stats()
        assert stats["host"].promotions == 4 and stats["redis"].hits == 2 and stats["s3"].hits == 2


def test_evictions_cascade_from_host_through_disk_into_redis(tmp_path, redis_server, redis_key_prefix):
    block = len(items(0)[0][1])
    config = make_config(tmp_path, redis_server.url, redis_key_prefix, host_slots=1, disk_bytes=block)
    with TieredStore(config) as store:
        for i in range(3):
            store.put(items(i))
            assert store.flush(30)
        assert store.lookup(HASHES[:3]).tiers == ("redis", "disk", "host")
        assert store.stats()["redis"].demotions == 1
        assert get(store, 0).tiers == ["redis"]


def test_redis_killed_mid_run_is_skipped_counted_and_recovers(tmp_path, fresh_redis_server, redis_key_prefix):
    config = make_config(tmp_path, fresh_redis_server.url, redis_key_prefix, write_through=("redis",),
                         backoff_initial_s=0.2, backoff_max_s=0.4)
    with TieredStore(config) as store:
        store.put(items(0, 1))
        assert store.flush(30)
        fresh_redis_server.kill()
        store.put(items(2))  # host takes it; the background write to Redis fails
        assert store.flush(30)
        assert get(store, 0, 1, 2).tiers == ["host", "host", "host"]  # serving goes on
        assert store.lookup(HASHES[:4]).num_hit_blocks == 3
        redis_stats = store.stats()["redis"]
        assert redis_stats.errors >= 1 and not redis_stats.healthy
        fresh_redis_server.restart()  # empty: Redis keeps nothing across a restart here
        time.sleep(0.5)  # past the backoff
        store.put(items(3))
        assert store.flush(30)
        assert store.tier("redis").contains([HASHES[3]]) == [True]
        assert store.stats()["redis"].healthy


def test_the_shared_tiers_are_asked_only_about_the_blocks_the_router_expects(tmp_path, redis_server, redis_key_prefix,
                                                                             s3_server, s3_bucket, s3_credentials):
    """`shared_upto`: Redis and S3 are asked about the leading blocks the router's index knows of, not about the
    rest (each question is a network round trip); the local tiers are asked about every block."""
    s3 = S3TierConfig(bucket=s3_bucket, endpoint_url=s3_server.url, region=s3_server.region)
    config = make_config(tmp_path, redis_server.url, redis_key_prefix, s3=s3, write_through=("redis", "s3"))
    with TieredStore(config) as store:
        store.put(items(0, 1, 2, 3))
        assert store.flush(30)
        store.tier("host").clear()
        asked: dict[str, list] = {"redis": [], "s3": [], "disk": []}
        for name, keys in asked.items():
            tier = store.tier(name)
            contains = tier.contains
            tier.contains = lambda hashes, contains=contains, keys=keys: keys.extend(hashes) or contains(hashes)
        assert store.lookup(HASHES[:6], shared_upto=2).tiers == ("redis", "redis")
        assert asked["redis"] == asked["s3"] == HASHES[:2] and asked["disk"] == HASHES[:6]
        assert store.lookup(HASHES[:6], shared_upto=0).num_hit_blocks == 0 and asked["redis"] == HASHES[:2]
        assert store.lookup(HASHES[:6]).tiers == ("redis",) * 4  # no limit: every block asked
        assert asked["redis"] == HASHES[:2] + HASHES[:6]


def test_blocks_another_worker_wrote_to_s3_are_found_when_the_router_expects_them(tmp_path, s3_server, s3_bucket,
                                                                                    s3_credentials):
    """S3 answers lookups from a cached index: a block another worker stored since the last refresh looks absent,
    until a lookup told (by the router's index) that more blocks are stored refreshes it, once."""
    s3 = S3TierConfig(bucket=s3_bucket, endpoint_url=s3_server.url, region=s3_server.region)

    def store_of(name: str) -> TieredStore:
        return TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=16 * SLOT, slot_bytes=SLOT),
                                       s3=s3, write_through=("s3",)))

    with store_of("writer") as writer, store_of("reader") as reader:
        assert reader.lookup(HASHES[:4]).num_hit_blocks == 0  # the reader's index is loaded now, and empty
        writer.put(items(0, 1, 2, 3))
        assert writer.flush(30)
        assert reader.lookup(HASHES[:4]).num_hit_blocks == 0  # stale, and nobody said otherwise: no LIST
        found = reader.lookup(HASHES[:5], expect=4)
        assert found.tiers == ("s3",) * 4
        got = reader.get(HASHES[:4], [bytearray(SLOT) for _ in range(4)], FP, hint=found.tiers)
        assert got.tiers == ["s3"] * 4


def test_a_prompt_s_blocks_put_at_once_go_to_s3_as_one_pack(tmp_path, s3_server, s3_bucket, s3_credentials):
    """The background writer wakes once a put's blocks are all owed (`submit_many`) and takes up to 128 at a time,
    so a prefix stored in one put is one pack: a reader learns it with one tail read and reads it with one ranged
    GET (moto's server: each request costs ~10 ms)."""
    import boto3

    many = hash_blocks(NS, list(range(1000, 1000 + 4 * 124)), 4)
    s3 = S3TierConfig(bucket=s3_bucket, endpoint_url=s3_server.url, region=s3_server.region)
    config = StoreConfig(host=HostTierConfig(capacity_bytes=130 * 512, slot_bytes=512), s3=s3, write_through=("s3",))
    with TieredStore(config) as store:
        blocks = [codec.encode(FP, h, LAYOUT, "float16", bytes([i % 251]) * 256) for i, h in enumerate(many)]
        assert store.put(list(zip(many, blocks))).queued == 124
        assert store.flush(30)
        client = boto3.client("s3", endpoint_url=s3_server.url, region_name=s3_server.region)
        listed = client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        assert len([o for o in listed if "/packs/" in o["Key"]]) == 1
        assert store.tier("s3").contains(many) == [True] * 124
