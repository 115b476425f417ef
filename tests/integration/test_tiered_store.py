"""TieredStore over real host (shared memory) and disk tiers, plus an in-memory tier standing in for a remote one
where a test must control failures and latency exactly (the Redis and S3 fault tests use the real servers)."""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, StoreConfig
from kvstore.hashing import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

NS = Namespace("tiny@store-test", "bs4-l1-h2-d8", "float16")
FP = NS.fingerprint()
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=2, head_dim=8)
TOKENS = list(range(1000, 1000 + 4 * 64))
HASHES = hash_blocks(NS, TOKENS, 4)
SLOT = 4096


def make_block(i: int) -> bytes:
    return codec.encode(FP, HASHES[i], LAYOUT, "float16", bytes([i + 1]) * LAYOUT.payload_bytes("float16"),
                        tokens=TOKENS[4 * i:4 * i + 4], parent_hash=HASHES[i - 1] if i else None)


SIZE = len(make_block(0))


def items(*indices: int) -> list[tuple[bytes, bytes]]:
    return [(HASHES[i], make_block(i)) for i in indices]


class MemoryTier(Tier):
    """A dict-backed tier whose failures (`down`) and latency (`delay_s`) a test switches."""

    name = "remote"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[bytes, bytes] = {}
        self.down, self.delay_s, self.calls = False, 0.0, 0

    def _enter(self, op: str) -> None:
        self.calls += 1
        time.sleep(self.delay_s)
        if self.down:
            raise self._failed(op, ConnectionError("connection refused"))

    def contains(self, keys):
        self._enter("contains")
        return [bytes(k) in self.data for k in keys]

    def get(self, keys, bufs):
        self._enter("get")
        out = []
        for key, buf in zip(keys, bufs):
            blob = self.data.get(bytes(key))
            if blob is not None:
                buf[:len(blob)] = blob
            out.append(None if blob is None else len(blob))
        self._count(hits=sum(n is not None for n in out), misses=sum(n is None for n in out))
        return out

    def put(self, items):
        self._enter("put")
        for key, data in items:
            self.data[bytes(key)] = bytes(data)
        return [True] * len(items)

    def delete(self, keys):
        return sum(self.data.pop(bytes(k), None) is not None for k in keys)

    def clear(self):
        self.data.clear()


class Recorder:
    """An event publisher that keeps what it was given."""

    def __init__(self) -> None:
        self.events, self._lock = [], threading.Lock()

    def publish(self, events) -> None:
        with self._lock:
            self.events.extend(events)

    def of(self, kind: str, medium: str) -> list:
        return [e for e in self.events if type(e).__name__ == kind and e.medium == medium]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(tmp_path, host_slots: int = 8, disk_blocks: int = 100, remote: MemoryTier | None = None,
               publisher=None, clock=time.monotonic, **policy) -> TieredStore:
    """`remote` stands in as tier "remote"; as "redis" (a shared tier the config may write through to) when
    `write_through` names it."""
    shared = "redis" in policy.get("write_through", ())
    config = StoreConfig(host=HostTierConfig(capacity_bytes=host_slots * SLOT, slot_bytes=SLOT),
                         disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=disk_blocks * SIZE),
                         redis=RedisTierConfig() if shared else None, **policy)
    tiers = {"host": HostTier(**config.tier_options("host")), "disk": DiskTier(**config.tier_options("disk"))}
    if remote is not None:
        tiers["redis" if shared else "remote"] = remote
    return TieredStore(config, publisher, tiers=tiers, clock=clock)


def get(store: TieredStore, *indices: int):
    bufs = [bytearray(SIZE) for _ in indices]
    return store.get([HASHES[i] for i in indices], bufs, FP)


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


def test_write_through_copies_every_put_to_lower_tiers_in_the_background(tmp_path):
    remote = MemoryTier()
    with make_store(tmp_path, remote=remote, write_through=("disk",)) as store:
        result = store.put(items(0, 1, 2))
        assert (result.stored, result.queued, result.dropped) == (3, 3, 0)
        assert store.flush()
        assert store.tier("disk").contains(HASHES[:3]) == [True] * 3
        assert remote.data == {}


def test_background_writes_never_block_and_a_long_prompt_reaches_every_tier(tmp_path):
    """Write-through owes each block a write without queueing its bytes: 200 blocks at once (far past
    `queue_depth`) all land in every lower tier, and a slow tier never slows the caller."""
    remote = MemoryTier()
    remote.delay_s = 0.05  # per batched call: a slow remote the caller must not feel
    with make_store(tmp_path, host_slots=256, disk_blocks=256, remote=remote, write_through=("disk", "redis"),
                    queue_depth=4) as store:
        started = time.perf_counter()
        result = store.put(items(*range(64)))
        assert time.perf_counter() - started < 2.0
        assert (result.stored, result.queued, result.dropped) == (64, 128, 0)
        assert store.flush(30)
        assert store.tier("disk").contains(HASHES[:64]) == [True] * 64
        assert set(remote.data) == set(HASHES[:64])
        assert all(s.dropped == 0 for s in store.stats().values())


def test_a_block_host_evicts_before_its_write_through_still_lands_below(tmp_path):
    remote = MemoryTier()
    remote.delay_s = 0.3
    with make_store(tmp_path, host_slots=2, remote=remote, write_through=("redis",)) as store:
        for i in range(6):  # host keeps 2: the rest are evicted while their write-through is still owed
            store.put(items(i))
        assert store.flush(30)
        assert set(remote.data) == set(HASHES[:6])
        assert store.stats()["redis"].dropped == 0


def test_a_write_the_bound_refuses_is_counted_dropped_and_visible(tmp_path):
    remote = MemoryTier()
    remote.delay_s = 0.5
    with make_store(tmp_path, host_slots=64, remote=remote, write_through=("redis",),
                    max_pending_writes=4) as store:
        results = [store.put(items(i)) for i in range(40)]
        dropped = sum(r.dropped for r in results)
        assert dropped > 0 and sum(r.queued for r in results) + dropped == 40
        assert store.flush(30)
        assert store.stats()["redis"].dropped == dropped
        assert len(remote.data) == 40 - dropped
        assert store.tier("host").contains(HASHES[:40]) == [True] * 40  # host always got every block


def test_a_write_to_a_tier_that_is_down_is_retried_when_it_returns(tmp_path):
    remote, clock = MemoryTier(), FakeClock()
    with make_store(tmp_path, remote=remote, write_through=("redis",), clock=clock, backoff_initial_s=1.0) as store:
        remote.down = True
        store.put(items(0, 1))
        assert store.flush()
        assert store.pending_writes() == 2 and remote.data == {}  # owed, waiting out the backoff
        remote.down = False
        clock.now += 1.0
        assert store.flush()
        assert set(remote.data) == set(HASHES[:2]) and store.pending_writes() == 0
        assert store.stats()["redis"].dropped == 0


def test_a_write_that_fails_every_attempt_is_counted_dropped(tmp_path):
    remote, clock = MemoryTier(), FakeClock()
    with make_store(tmp_path, remote=remote, write_through=("redis",), clock=clock, backoff_initial_s=1.0,
                    backoff_max_s=1.0, write_attempts=3) as store:
        remote.down = True
        store.put(items(0))
        for _ in range(4):
            assert store.flush()
            clock.now += 10.0
        assert store.flush() and store.pending_writes() == 0
        assert store.stats()["redis"].dropped == 1


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
