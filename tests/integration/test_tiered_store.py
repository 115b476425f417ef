"""TieredStore over real host (shared memory) and disk tiers: lookups, reads, promotion, demotion, tier health
and integrity (the background writes below host: test_store_write_behind.py)."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.store import TieredStore
from kvstore.tiers.host import HostTier
from tests.integration.store_factories import (FP, HASHES, LAYOUT, NS, SIZE, SLOT, TOKENS, FakeClock, MemoryTier,
                                               Recorder, get, items, make_block, make_store)


def test_store_built_from_config_alone(tmp_path):
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20),
                         disk=DiskTierConfig(str(tmp_path), capacity_bytes=1 << 20), write_through=("disk",))
    with TieredStore(config) as store:
        store.put(items(0, 1))
        assert store.flush()
        assert store.lookup(HASHES[:3]) == ((2, ("host", "host"), {"host": 2, "disk": 0}))
        assert store.tier("disk").contains(HASHES[:3]) == [True, True, False]


def test_lookup_gives_the_fastest_tier_per_block_asking_slower_tiers_only_for_the_missing_ones(tmp_path):
    remote = MemoryTier()
    asked: list[list[bytes]] = []
    contains = remote.contains
    remote.contains = lambda keys: asked.append(list(keys)) or contains(keys)
    with make_store(tmp_path, remote=remote) as store:
        store.put(items(0, 1))
        store.tier("disk").put(items(1, 2, 3, 6))
        remote.put(items(0, 1, 2, 3, 4))
        result = store.lookup(HASHES[:8])
        assert result.per_tier == {"host": 2, "disk": 2, "remote": 1}
        assert result.num_hit_blocks == 5
        assert result.tiers == ("host", "host", "disk", "disk", "remote")
        assert asked == [[HASHES[4], HASHES[5], HASHES[7]]]  # neither host's nor disk's blocks


def test_a_host_hit_never_asks_a_slower_tier(tmp_path):
    remote = MemoryTier()
    remote.delay_s = 0.5  # a slow shared tier: a host hit must not wait for it
    with make_store(tmp_path, remote=remote) as store:
        store.put(items(0, 1, 2))
        calls = remote.calls
        result = store.lookup(HASHES[:3])
        got = store.get(HASHES[:3], [bytearray(SIZE) for _ in range(3)], FP, hint=result.tiers)
        assert result.tiers == ("host",) * 3 and got.tiers == ["host"] * 3
        assert remote.calls == calls


def test_a_block_missing_from_its_hinted_tier_is_not_asked_of_that_tier_again(tmp_path):
    remote = MemoryTier()
    with make_store(tmp_path, remote=remote) as store:
        remote.put(items(0))
        found = store.lookup(HASHES[:1])
        remote.data.clear()  # gone between the lookup and the read
        calls = remote.calls
        got = store.get(HASHES[:1], [bytearray(SIZE)], FP, hint=found.tiers)
        assert got.tiers == [None] and remote.calls == calls + 1  # the hinted read only, no second try


def test_a_shared_tier_that_does_not_answer_in_time_is_a_miss(tmp_path):
    remote = MemoryTier()
    remote.name = "redis"  # a shared tier: asked under the lookup deadline
    config = StoreConfig(host=HostTierConfig(capacity_bytes=8 * SLOT, slot_bytes=SLOT), lookup_timeout_s=0.2)
    with TieredStore(config, tiers={"host": HostTier(**config.tier_options("host")), "redis": remote}) as store:
        remote.put(items(0))
        remote.delay_s = 3.0
        started = time.perf_counter()
        result = store.lookup(HASHES[:1])
        assert result.num_hit_blocks == 0
        assert time.perf_counter() - started < 2.5  # the deadline, not the tier's 3 s
        assert store.stats()["redis"].skipped == 1
        remote.delay_s = 0.0


def test_get_reads_the_fastest_copy_and_promotes_slower_hits_into_host(tmp_path):
    remote, events = MemoryTier(), Recorder()
    with make_store(tmp_path, remote=remote, publisher=events) as store:
        store.put(items(0))
        store.tier("disk").put(items(1))
        remote.put(items(1, 2))
        result = get(store, 0, 1, 2, 3)
        assert result.tiers == ["host", "disk", "remote", None] and result.num_hit_blocks == 3
        assert [bytes(b.payload[:1]) for b in result.blocks[:3]] == [b"\x01", b"\x02", b"\x03"]
        assert list(result.blocks[2].tokens) == TOKENS[8:12]
        assert store.tier("host").contains(HASHES[:4]) == [True, True, True, False]
        stats = store.stats()
        assert stats["host"].promotions == 2 and stats["disk"].hits == 1 and stats["remote"].hits == 1
        promoted = store.get([HASHES[2]], [bytearray(SIZE)], FP)
        assert promoted.tiers == ["host"]
        stored = events.of("BlockStored", "host")
        assert [e.block_hashes for e in stored] == [[HASHES[0]], [HASHES[1]], [HASHES[2]]]
        assert stored[2].parent_block_hash == HASHES[1] and stored[2].token_ids == TOKENS[8:12]
        assert stored[2].block_size == 4


def test_host_eviction_demotes_to_disk_in_lru_order(tmp_path):
    events = Recorder()
    with make_store(tmp_path, host_slots=2, publisher=events) as store:
        store.put(items(0, 1))
        get(store, 0)  # 1 is now the least recently used
        store.put(items(2))
        store.put(items(3))
        assert store.flush()
        disk = store.tier("disk")
        assert disk.keys_lru_order() == [HASHES[1], HASHES[0]]
        assert store.tier("host").keys_lru_order() == [HASHES[2], HASHES[3]]
        assert store.stats()["disk"].demotions == 2 and store.stats()["host"].evictions == 2
        assert [e.block_hashes for e in events.of("BlockRemoved", "host")] == [[HASHES[1]], [HASHES[0]]]
        assert [e.block_hashes for e in events.of("BlockStored", "disk")] == [[HASHES[1]], [HASHES[0]]]
        assert get(store, 0, 1, 2, 3).tiers == ["disk", "disk", "host", "host"]


def test_eviction_cascades_host_to_disk_to_remote(tmp_path):
    remote = MemoryTier()
    with make_store(tmp_path, host_slots=1, disk_blocks=1, remote=remote) as store:
        for i in range(3):
            store.put(items(i))
            assert store.flush()
        # host holds 2; disk received 0 then 1 and evicted 0 into the remote tier
        assert store.lookup(HASHES[:3]).tiers == ("remote", "disk", "host")
        assert list(remote.data) == [HASHES[0]]
        stats = store.stats()
        assert (stats["disk"].demotions, stats["remote"].demotions, stats["disk"].evictions) == (2, 1, 1)


def test_demotion_none_drops_evicted_blocks(tmp_path):
    with make_store(tmp_path, host_slots=1, demotion="none") as store:
        store.put(items(0, 1))
        assert store.flush()
        assert store.lookup(HASHES[:2]).per_tier == {"host": 0, "disk": 0}


def test_unhealthy_tier_is_skipped_then_retried_with_exponential_backoff(tmp_path):
    remote, clock = MemoryTier(), FakeClock()
    with make_store(tmp_path, remote=remote, clock=clock, backoff_initial_s=1.0, backoff_max_s=4.0) as store:
        remote.put(items(0))
        remote.down = True
        calls = remote.calls
        assert get(store, 0).tiers == [None]  # the failure: counted, tier marked unhealthy
        assert get(store, 0).tiers == [None]  # skipped: the tier is not called again
        assert remote.calls == calls + 1
        stats = store.stats()["remote"]
        assert (stats.errors, stats.skipped, stats.healthy) == (1, 1, False)
        for expected_backoff in (1.0, 2.0, 4.0, 4.0):  # doubles per failed retry, capped
            clock.now += expected_backoff - 0.01
            get(store, 0)
            assert remote.calls == calls + 1, "retried before the backoff ran out"
            clock.now += 0.01
            get(store, 0)
            calls += 1
            assert remote.calls == calls + 1
        remote.down = False
        clock.now += 4.0
        assert get(store, 0).tiers == ["remote"]
        assert store.stats()["remote"].healthy


def test_writes_and_reads_back_off_separately(tmp_path):
    """A tier that cannot write (full) still serves reads."""
    with make_store(tmp_path, write_through=("disk",)) as store:
        store.tier("disk").put(items(0))
        shutil.rmtree(tmp_path / "disk" / HASHES[1].hex()[:2], ignore_errors=True)
        (tmp_path / "disk" / HASHES[1].hex()[:2]).write_bytes(b"not a directory")  # a real write failure
        store.put(items(1))
        assert store.flush()
        disk = store.stats()["disk"]
        assert disk.errors == 1 and not disk.healthy
        store.tier("host").clear()
        assert get(store, 0).tiers == ["disk"]


def test_real_disk_failure_is_retried_after_backoff_and_recovers(tmp_path):
    clock = FakeClock()
    with make_store(tmp_path, write_through=("disk",), clock=clock, backoff_initial_s=1.0) as store:
        shard = tmp_path / "disk" / HASHES[0].hex()[:2]
        shard.rmdir()
        shard.write_bytes(b"in the way")  # a file where the shard directory must be: writes fail for real
        store.put(items(0))
        assert store.flush() and not store.stats()["disk"].healthy
        assert store.pending_writes() == 1  # owed again after the backoff, not lost
        os.unlink(shard)  # repaired: the tier recreates the directory on its next write
        clock.now += 1.0
        assert store.flush()
        assert store.stats()["disk"].healthy and store.tier("disk").contains(HASHES[:1]) == [True]
        assert store.stats()["disk"].dropped == 0


def test_bad_copy_in_host_is_deleted_and_the_disk_copy_is_served(tmp_path):
    events = Recorder()
    with make_store(tmp_path, write_through=("disk",), publisher=events) as store:
        store.put(items(0))
        assert store.flush()
        host = store.tier("host")
        slot = host._lru[bytes(HASHES[0])]
        host._segment.slot_data(slot, SIZE)[SIZE - 1] ^= 0x01  # a bit flips in shared memory
        result = get(store, 0)
        assert result.tiers == ["disk"] and bytes(result.blocks[0].payload) == b"\x01" * len(result.blocks[0].payload)
        assert store.stats()["host"].checksum_failures == 1
        assert [e.block_hashes for e in events.of("BlockRemoved", "host")] == [[HASHES[0]]]
        assert get(store, 0).tiers == ["host"]  # promoted again, good copy


def test_bad_copy_everywhere_is_a_miss_never_wrong_kv(tmp_path):
    remote = MemoryTier()
    with make_store(tmp_path, remote=remote) as store:
        bad = bytearray(make_block(0))
        bad[-1] ^= 0xFF
        remote.put([(HASHES[0], bytes(bad))])
        other_namespace = codec.encode(NS.with_salt("t2").fingerprint(), HASHES[1], LAYOUT, "float16",
                                       b"\x00" * LAYOUT.payload_bytes("float16"))
        remote.put([(HASHES[1], other_namespace)])
        assert get(store, 0, 1).tiers == [None, None]
        assert store.stats()["remote"].checksum_failures == 2 and remote.data == {}


def test_put_refuses_bytes_the_key_does_not_name(tmp_path):
    with make_store(tmp_path) as store:
        with pytest.raises(ValueError, match="header names"):
            store.put([(HASHES[1], make_block(0))])
        with pytest.raises(ValueError, match="not an encoded block"):
            store.put([(HASHES[0], b"raw bytes")])


def test_clear_empties_every_tier_and_publishes_all_cleared(tmp_path):
    events = Recorder()
    with make_store(tmp_path, write_through=("disk",), publisher=events) as store:
        store.put(items(0, 1))
        store.clear()
        assert store.lookup(HASHES[:2]).per_tier == {"host": 0, "disk": 0}
        assert type(events.events[-1]).__name__ == "AllBlocksCleared"


def test_a_write_in_hand_counts_as_pending_until_it_is_made(tmp_path):
    """A worker answers first and writes after (`writing`): whoever waits for no pending write waits for it too."""
    with make_store(tmp_path) as store:
        assert store.pending_writes() == 0
        with store.writing():
            assert store.pending_writes() == 1
            with store.writing():
                assert store.pending_writes() == 2
            store.put(items(0))
            assert store.pending_writes() >= 1
        assert store.flush() and store.pending_writes() == 0
        with pytest.raises(RuntimeError), store.writing():   # a failed write is not owed forever
            raise RuntimeError("the write failed")
        assert store.pending_writes() == 0
