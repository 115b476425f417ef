"""TieredStore's writes below host (kvstore/write_behind.py): never blocking the caller, never lost silently."""
from __future__ import annotations

import time

from tests.integration.store_factories import HASHES, FakeClock, MemoryTier, items, make_store


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


def test_a_retried_write_keeps_the_bytes_host_let_go_of(tmp_path):
    """Host evicts a block whose write is owed: the write carries its bytes from then on, through every retry."""
    remote, clock = MemoryTier(), FakeClock()
    with make_store(tmp_path, host_slots=1, remote=remote, write_through=("redis",), clock=clock,
                    backoff_initial_s=1.0, backoff_max_s=1.0) as store:
        remote.down = True
        store.put(items(0))
        assert store.flush()  # first attempt failed: owed again
        store.put(items(1))  # host (one slot) evicts block 0 and hands its bytes to the owed write
        for _ in range(2):  # further attempts fail while the tier is down
            clock.now += 2.0
            assert store.flush()
        remote.down = False
        clock.now += 4.0
        assert store.flush() and store.pending_writes() == 0
        assert set(remote.data) == set(HASHES[:2])
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
