"""The prefill worker's hand-off region: slots keyed by block hash, pinned by leases, reused least recently first."""
from __future__ import annotations

import pytest

from kvstore.transfer import LeaseExpired, TransferConfig, create_agent
from worker_common.handoff_pool import HandoffPool
from worker_common.leases import LeaseTable

SLOT = 4096


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def agent():
    a = create_agent(TransferConfig(backend="shm"))
    yield a
    a.close()


@pytest.fixture
def pool(agent):
    p = HandoffPool(agent, SLOT, 3 * SLOT)
    yield p
    p.close()


def fill(pool: HandoffPool, i: int, byte: int = 7) -> int:
    pinned = pool.pin(h(i))
    assert pinned.view is not None, "a new hash takes a fresh slot"
    pinned.view[:100] = bytes([byte]) * 100
    pool.commit(pinned.slot, h(i), 100)
    return pinned.slot


def test_pin_of_a_committed_hash_shares_its_slot(pool):
    slot = fill(pool, 1)
    again = pool.pin(h(1))
    assert again == (slot, None)
    assert pool.num_pinned == 1
    pool.unpin([slot, slot])
    pool.check_integrity()
    assert pool.num_pinned == 0


def test_unpinned_blocks_stay_until_their_slot_is_needed_least_recent_first(pool):
    slots = [fill(pool, i) for i in range(3)]
    pool.unpin(slots)                       # cached order: 0, 1, 2
    assert pool.pin(h(0)).view is None      # still there; now pinned again
    fresh = pool.pin(h(9))
    assert fresh.slot == slots[1], "the least recently unpinned block gives its slot"
    assert pool.pin(h(1)).view is not None, "block 1 was evicted"
    pool.check_integrity()


def test_pin_returns_none_when_every_slot_is_pinned(pool):
    for i in range(3):
        fill(pool, i)
    assert pool.pin(h(5)) is None
    pool.check_integrity()


def test_descriptor_names_the_slot_range(pool, agent):
    slot = fill(pool, 4)
    desc = pool.descriptor(slot)
    assert (desc.agent, desc.region_id, desc.offset, desc.length) == (agent.address, "kv-handoff", slot * SLOT, 100)


def test_released_lease_unpins_and_ends_transfer_reads(pool, agent):
    reader = create_agent(TransferConfig(backend="shm"))
    try:
        table = LeaseTable(agent, pool)
        slot = fill(pool, 1, byte=42)
        lease = table.grant([slot], ttl_s=30)
        desc = pool.descriptor(slot)._replace(lease_id=lease.transfer_lease_id)
        buf = bytearray(100)
        reader.read([desc], [buf], deadline_s=1.0)
        assert buf == bytes([42]) * 100
        assert table.release(lease.lease_id) is True
        assert table.release(lease.lease_id) is False, "release is idempotent"
        assert pool.num_pinned == 0
        with pytest.raises(LeaseExpired):
            reader.read([desc], [buf], deadline_s=1.0)
        table.close()
    finally:
        reader.close()


def test_expired_lease_unpins_its_slots(pool, agent):
    now = [100.0]
    table = LeaseTable(agent, pool, sweep_interval_s=60, clock=lambda: now[0])
    lease = table.grant([fill(pool, 1), fill(pool, 2)], ttl_s=5)
    assert table.sweep() == 0 and pool.num_pinned == 2
    now[0] += 5.0
    assert table.sweep() == 1
    assert pool.num_pinned == 0 and table.num_expired == 1
    assert table.release(lease.lease_id) is False
    table.close()
