"""The shm control block: region directory and lease table as a reader in another mapping sees them."""
from __future__ import annotations

import pytest

from kvstore.transfer.control_block import ControlBlock
from kvstore.transfer.lease import now_ns

SEC = 1_000_000_000


@pytest.fixture
def blocks():
    owner = ControlBlock.create(max_regions=4, max_leases=4, max_ranges=3)
    reader = ControlBlock.attach(owner.seg.name)
    yield owner, reader
    reader.detach()
    owner.close()


def test_reader_finds_a_published_region_and_loses_it_on_removal(blocks):
    owner, reader = blocks
    generation = owner.add_region("host-pool", "/st-segment", 4096)
    entry = reader.find_region("host-pool")
    assert (entry.generation, entry.length, entry.shm_name) == (generation, 4096, "/st-segment")
    assert reader.find_region("other") is None
    owner.remove_region(generation)
    assert reader.find_region("host-pool") is None
    assert reader.words[reader.generation_word(entry.slot)] == 0


def test_each_registration_gets_a_new_generation(blocks):
    owner, _ = blocks
    first = owner.add_region("r", "/st-a", 10)
    owner.remove_region(first)
    assert owner.add_region("r", "/st-b", 10) != first


def test_region_directory_has_a_fixed_capacity(blocks):
    owner, _ = blocks
    for i in range(4):
        owner.add_region(f"r{i}", "/st-x", 10)
    with pytest.raises(ValueError, match="max_regions"):
        owner.add_region("r4", "/st-x", 10)


def test_reader_sees_lease_ranges_expiry_and_release(blocks):
    owner, reader = blocks
    generation = owner.add_region("r", "/st-a", 1000)
    expires = now_ns() + 30 * SEC
    lease = owner.grant(generation, [0, 100], [10, 200], expires, now_ns())
    entry = reader.read_lease(lease)
    assert (entry.region_generation, entry.expires_ns, entry.starts, entry.ends) == (generation, expires, [0, 100],
                                                                                      [10, 200])
    seq = reader.lease_seq(lease)
    assert owner.release(lease, now_ns()) is True
    assert reader.read_lease(lease) is None and reader.lease_seq(lease) != seq


def test_lease_slots_are_reused_with_new_ids_and_old_ids_stay_dead(blocks):
    owner, reader = blocks
    generation = owner.add_region("r", "/st-a", 1000)
    first = [owner.grant(generation, [0], [1], now_ns() + SEC, now_ns()) for _ in range(4)]
    with pytest.raises(ValueError, match="max_leases"):
        owner.grant(generation, [0], [1], now_ns() + SEC, now_ns())
    owner.release(first[0], now_ns())
    again = owner.grant(generation, [0], [1], now_ns() + SEC, now_ns())
    assert again not in first and reader.read_lease(first[0]) is None and reader.read_lease(again) is not None


def test_expired_lease_slots_are_reclaimed_when_the_table_is_full(blocks):
    owner, _ = blocks
    generation = owner.add_region("r", "/st-a", 1000)
    for _ in range(4):
        owner.grant(generation, [0], [1], now_ns() - 1, now_ns())  # already expired
    owner.grant(generation, [0], [1], now_ns() + SEC, now_ns())


def test_too_many_ranges_in_one_lease_is_a_clear_error(blocks):
    owner, _ = blocks
    generation = owner.add_region("r", "/st-a", 1000)
    with pytest.raises(ValueError, match="max_ranges_per_lease"):
        owner.grant(generation, [0, 10, 20, 30], [1, 11, 21, 31], now_ns() + SEC, now_ns())


def test_removing_a_region_ends_its_leases(blocks):
    owner, reader = blocks
    generation = owner.add_region("r", "/st-a", 1000)
    lease = owner.grant(generation, [0], [1], now_ns() + SEC, now_ns())
    owner.remove_region(generation)
    assert reader.read_lease(lease) is None


def test_attaching_a_segment_that_is_not_a_control_block_fails():
    from kvstore.transfer.segment import SharedSegment

    seg = SharedSegment.create(4096)
    try:
        with pytest.raises(ValueError):
            ControlBlock.attach(seg.name)
    finally:
        seg.close(unlink=True)


def test_reaper_unlinks_segments_of_dead_processes_only():
    import os
    import subprocess
    import sys

    from kvstore.transfer.segment import SHM_DIR, SharedSegment, reap_orphaned_segments

    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm here")
    code = ("from kvstore.transfer.segment import SharedSegment as S; "
            "s = S.create(4096); s._unlinker.detach(); print(s.name)")  # exits without unlinking: an orphan
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    mine = SharedSegment.create(4096)
    try:
        reaped = reap_orphaned_segments()
        assert orphan in reaped and mine.name not in reaped
        assert not os.path.exists(SHM_DIR + orphan) and os.path.exists(SHM_DIR + mine.name)
    finally:
        mine.close(unlink=True)
