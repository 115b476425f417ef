"""The Redis tier against a real redis-server: round trips, batched lookups, TTL, namespacing, clear."""
from __future__ import annotations

import os
import time

import pytest
import redis

from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.base import TIER_REGISTRY
from kvstore.tiers.redis import RedisTier

NS = Namespace("tiny-llama:abc", "L2-H4-D16-B4", "float16")


def make_hashes(n: int, salt: str = "") -> list[bytes]:
    return hash_blocks(NS.with_salt(salt), list(range(n * 4)), 4)


def make_block(i: int, size: int = 4096) -> bytes:
    return bytes([i % 251]) * (size // 2) + os.urandom(size - size // 2)


@pytest.fixture
def tier(redis_server, redis_key_prefix):
    t = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS)
    yield t
    t.clear()
    t.close()


def test_round_trip_returns_the_stored_bytes_into_caller_buffers(tier):
    hashes = make_hashes(3)
    blocks = [make_block(i) for i in range(3)]

    assert tier.put(list(zip(hashes, blocks))) == [True, True, True]
    bufs = [memoryview(bytearray(8192)) for _ in hashes]
    assert tier.get(hashes, bufs) == [4096, 4096, 4096]
    assert [bytes(b[:4096]) for b in bufs] == blocks


def test_get_of_missing_keys_is_none_and_counts_misses(tier):
    hashes = make_hashes(3)
    tier.put([(hashes[1], b"x" * 10)])

    assert tier.get(hashes, [memoryview(bytearray(16)) for _ in hashes]) == [None, 10, None]
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_read, stats.bytes_written) == (1, 2, 10, 10)


def test_put_of_present_key_is_a_noop_that_returns_true(tier):
    h = make_hashes(1)[0]
    assert tier.put([(h, b"first")]) == [True]
    assert tier.put([(h, b"other")]) == [True]
    buf = memoryview(bytearray(8))
    assert tier.get([h], [buf]) == [5] and bytes(buf[:5]) == b"first"


def test_contains_is_batched_and_longest_prefix_stops_at_first_gap(tier):
    hashes = make_hashes(300)  # more than one batch of 128
    tier.put([(h, b"v") for i, h in enumerate(hashes) if i != 200])

    present = tier.contains(hashes)
    assert present == [i != 200 for i in range(300)]
    assert tier.longest_prefix(hashes) == 200
    assert tier.longest_prefix(hashes[201:]) == 99


def test_keys_are_namespaced_by_prefix_namespace_and_hash_hex(tier, redis_server, redis_key_prefix):
    h = make_hashes(1)[0]
    tier.put([(h, b"v")])
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.get(f"{redis_key_prefix}:{NS.fingerprint().hex()}:{h.hex()}") == b"v"


def test_two_namespaces_on_one_server_do_not_see_each_other(redis_server, redis_key_prefix):
    a = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS)
    b = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS.with_salt("tenant-b"))
    h = make_hashes(1)[0]
    a.put([(h, b"a")])
    assert a.contains([h]) == [True] and b.contains([h]) == [False]


def test_ttl_expires_keys(redis_server, redis_key_prefix):
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, ttl_s=0.3)
    h = make_hashes(1)[0]
    tier.put([(h, b"v")])
    assert tier.contains([h]) == [True]
    pttl = redis.Redis.from_url(redis_server.url).pttl(tier.key(h))
    assert 0 < pttl <= 300

    time.sleep(0.5)
    assert tier.contains([h]) == [False]


def test_put_again_renews_the_ttl(redis_server, redis_key_prefix):
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, ttl_s=0.6)
    h = make_hashes(1)[0]
    tier.put([(h, b"v")])
    time.sleep(0.4)
    tier.put([(h, b"v")])
    time.sleep(0.4)  # 0.8 s after the first put, 0.4 s after the second
    assert tier.contains([h]) == [True]


def test_clear_removes_only_its_own_prefix_and_namespace(tier, redis_server, redis_key_prefix):
    raw = redis.Redis.from_url(redis_server.url)
    raw.set("unrelated:key", b"keep")
    other_ns = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace="other")
    other_prefix = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix + "-x", namespace=NS)
    hashes = make_hashes(700)  # more than one UNLINK batch
    for t in (tier, other_ns, other_prefix):
        t.put([(h, b"v") for h in hashes[:10]])
    tier.put([(h, b"v") for h in hashes[10:]])

    tier.clear()

    assert not any(tier.contains(hashes))
    assert all(other_ns.contains(hashes[:10])) and all(other_prefix.contains(hashes[:10]))
    assert raw.get("unrelated:key") == b"keep"
    other_ns.clear(), other_prefix.clear(), raw.delete("unrelated:key")


def test_delete_counts_present_keys_and_ignores_missing(tier):
    hashes = make_hashes(3)
    tier.put([(hashes[0], b"v"), (hashes[1], b"v")])
    assert tier.delete(hashes) == 2
    assert tier.contains(hashes) == [False, False, False]


def unlink_calls(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return stats.get("cmdstat_unlink", {}).get("calls", 0)


def test_delete_of_thousands_of_keys_is_one_unlink_per_chunk_and_counts_what_redis_held(tier, redis_server):
    """2,000 keys, 1,500 of them stored: 4 round trips of 500 keys (one multi-key UNLINK each), 1,500 removed."""
    hashes = make_hashes(2000)
    tier.put([(h, b"v") for h in hashes[:1500]])
    before = unlink_calls(redis_server.url)

    assert tier.delete(hashes) == 1500

    assert unlink_calls(redis_server.url) - before == 4
    assert not any(tier.contains(hashes))
    assert tier.delete(hashes) == 0          # a second delete (another worker's, say) finds nothing left


def test_clear_returns_how_many_keys_it_removed(tier):
    hashes = make_hashes(1200)               # more than two UNLINK batches
    tier.put([(h, b"v") for h in hashes])
    assert tier.clear() == 1200
    assert tier.clear() == 0


def test_stats_track_blocks_and_bytes_this_process_has_seen(tier):
    hashes = make_hashes(4)
    tier.put([(h, b"x" * 100) for h in hashes])
    tier.delete(hashes[:1])
    stats = tier.stats()
    assert (stats.blocks, stats.used_bytes, stats.healthy) == (3, 300, True)
    assert sum(stats.put_latency_counts) == 1
    assert tier.scan_usage() == (3, 300)


def test_buffer_too_small_is_a_value_error(tier):
    h = make_hashes(1)[0]
    tier.put([(h, b"x" * 100)])
    with pytest.raises(ValueError, match="too small"):
        tier.get([h], [memoryview(bytearray(10))])


def test_large_blocks_round_trip_through_one_batch(tier):
    hashes = make_hashes(4)
    blocks = [make_block(i, 1 << 20) for i in range(4)]
    tier.put(list(zip(hashes, (memoryview(b) for b in blocks))))
    bufs = [memoryview(bytearray(1 << 20)) for _ in hashes]
    assert tier.get(hashes, bufs) == [1 << 20] * 4
    assert all(bytes(b) == blk for b, blk in zip(bufs, blocks))


def test_registered_under_its_config_name_and_takes_config_options(redis_server, redis_key_prefix):
    from dataclasses import asdict

    from kvstore.config import RedisTierConfig

    options = asdict(RedisTierConfig(url=redis_server.url, ttl_s=60, key_prefix=redis_key_prefix))
    tier = TIER_REGISTRY["redis"](**options)
    assert isinstance(tier, RedisTier) and tier.ttl_ms == 60_000


@pytest.mark.parametrize("url", ["http://localhost:6379", "localhost:6379"])
def test_bad_url_is_rejected_with_the_allowed_schemes(url):
    with pytest.raises(ValueError, match="redis://"):
        RedisTier(url=url)


@pytest.fixture(scope="module")
def redis_cluster():
    """A one-node Redis Cluster (cluster mode on, every slot on this node): the cluster code path, for real."""
    from strata.devservers import RedisServer

    with RedisServer(extra_args=("--cluster-enabled", "yes")) as server:
        raw = redis.Redis.from_url(server.url)
        raw.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while b"cluster_state:ok" not in raw.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "cluster did not become ok"
            time.sleep(0.05)
        yield server


def test_cluster_mode_round_trip_lookup_and_clear(redis_cluster):
    tier = RedisTier(url=redis_cluster.url, cluster=True, key_prefix="cluster-test", namespace=NS)
    hashes = make_hashes(300)  # keys spread over many slots
    blocks = [make_block(i, 64) for i in range(300)]
    tier.put(list(zip(hashes, blocks)))
    assert tier.delete(hashes[150:151] + make_hashes(2, salt="absent")) == 1

    assert tier.longest_prefix(hashes) == 150
    bufs = [memoryview(bytearray(64)) for _ in hashes]
    assert tier.get(hashes, bufs) == [64] * 150 + [None] + [64] * 149
    assert [bytes(b) for b in bufs[:150]] == blocks[:150]
    assert tier.scan_usage() == (299, 299 * 64)
    assert tier.clear() == 299
    assert not any(tier.contains(hashes))


def test_batches_are_split_by_bytes_as_well_as_keys(redis_server, redis_key_prefix):
    """batch_bytes caps one round trip; a split batch still returns every block in order."""
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, batch_bytes=3000, batch_size=4)
    hashes = make_hashes(10)
    blocks = [make_block(i, 1024) for i in range(10)]
    tier.put(list(zip(hashes, blocks)))
    bufs = [memoryview(bytearray(1024)) for _ in hashes]
    assert tier.get(hashes, bufs) == [1024] * 10
    assert [bytes(b) for b in bufs] == blocks
    tier.clear()
