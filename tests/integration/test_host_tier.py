"""Host tier: shared-memory slots with an LRU, and a second process reading them zero-copy."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from kvstore import codec
from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.host import HostTier, HostTierReader

NS = Namespace("tiny@host-test", "bs4-l1-h2-d8", "float16")
FP = NS.fingerprint()
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=2, head_dim=8)
SLOT = 4096


def make_blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(100, 100 + 4 * n))
    hashes = hash_blocks(NS, tokens, 4)
    blocks = [codec.encode(FP, h, LAYOUT, "float16", bytes([i + 1]) * LAYOUT.payload_bytes("float16"),
                           tokens=tokens[4 * i:4 * i + 4]) for i, h in enumerate(hashes)]
    return hashes, blocks


@pytest.fixture
def tier():
    t = HostTier(capacity_bytes=3 * SLOT, slot_bytes=SLOT)
    yield t
    t.close()


def test_round_trip_into_caller_buffers(tier):
    hashes, blocks = make_blocks(2)
    assert tier.put(list(zip(hashes, blocks))) == [True, True]
    bufs = [bytearray(SLOT) for _ in range(3)]
    missing = b"\x00" * 16
    assert tier.get(hashes + [missing], [memoryview(b) for b in bufs]) == [len(blocks[0]), len(blocks[1]), None]
    assert bytes(bufs[0][:len(blocks[0])]) == blocks[0] and bytes(bufs[1][:len(blocks[1])]) == blocks[1]
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.blocks, stats.bytes_written) == (2, 1, 2, 2 * len(blocks[0]))
    tier.check_integrity()


def test_put_of_a_present_key_is_a_no_op(tier):
    hashes, blocks = make_blocks(1)
    tier.put([(hashes[0], blocks[0])])
    assert tier.put([(hashes[0], blocks[0])]) == [True]
    assert tier.stats().bytes_written == len(blocks[0])


def test_lru_evicts_least_recently_used_first(tier):
    hashes, blocks = make_blocks(5)
    evicted = []
    tier.eviction_listener = lambda key, data: evicted.append(key)
    tier.put(list(zip(hashes[:3], blocks[:3])))
    tier.get([hashes[0]], [memoryview(bytearray(SLOT))])  # 0 becomes most recent: 1 is now the oldest
    tier.put([(hashes[3], blocks[3])])
    tier.put([(hashes[4], blocks[4])])
    assert evicted == [hashes[1], hashes[2]]
    assert tier.keys_lru_order() == [hashes[0], hashes[3], hashes[4]]
    assert tier.contains(hashes) == [True, False, False, True, True]
    assert tier.stats().evictions == 2
    tier.check_integrity()


def test_eviction_hands_the_listener_the_evicted_bytes(tier):
    hashes, blocks = make_blocks(4)
    seen = {}
    tier.eviction_wants_data = True
    tier.eviction_listener = lambda key, data: seen.setdefault(key, bytes(data))
    tier.put(list(zip(hashes, blocks)))
    assert seen == {hashes[0]: blocks[0]}


def test_capacity_is_never_exceeded(tier):
    hashes, blocks = make_blocks(10)
    for item in zip(hashes, blocks):
        tier.put([item])
        assert tier.stats().used_bytes <= 3 * SLOT
    assert tier.stats().blocks == 3 and tier.num_slots == 3
    tier.check_integrity()


def test_object_larger_than_a_slot_is_not_stored():
    t = HostTier(capacity_bytes=4 * 256, slot_bytes=256)
    try:
        hashes, blocks = make_blocks(1)
        assert len(blocks[0]) > 256
        assert t.put([(hashes[0], blocks[0])]) == [False]
        assert t.contains(hashes) == [False]
    finally:
        t.close()


def test_slots_are_sized_from_the_first_block_when_not_configured():
    t = HostTier(capacity_bytes=10 * 4096)
    try:
        hashes, blocks = make_blocks(2)
        t.put(list(zip(hashes, blocks)))
        assert t.slot_bytes == 4096 and t.num_slots == 10
    finally:
        t.close()


def test_buffer_too_small_is_a_caller_error(tier):
    hashes, blocks = make_blocks(1)
    tier.put([(hashes[0], blocks[0])])
    with pytest.raises(ValueError, match="buffer holds 10 bytes"):
        tier.get(hashes, [memoryview(bytearray(10))])


def test_delete_and_clear_free_slots(tier):
    hashes, blocks = make_blocks(3)
    tier.put(list(zip(hashes, blocks)))
    assert tier.delete([hashes[1], b"\x01" * 16]) == 1
    assert tier.contains(hashes) == [True, False, True]
    tier.clear()
    assert tier.contains(hashes) == [False, False, False] and tier.stats().blocks == 0
    tier.check_integrity()


def test_a_lent_block_is_read_in_place_and_its_slot_is_not_reused_until_released(tier):
    hashes, blocks = make_blocks(5)
    evicted = []
    tier.eviction_listener = lambda key, data: evicted.append(key)
    tier.put(list(zip(hashes[:3], blocks[:3])))
    loan = tier.borrow([hashes[0], b"\x00" * 16, hashes[1]])
    assert loan.views[1] is None and loan.slots[1] is None
    assert bytes(loan.views[0]) == blocks[0] and bytes(loan.views[2]) == blocks[1]
    rows, slot_bytes = tier.slot_rows()
    assert slot_bytes == SLOT and bytes(rows[loan.slots[2] * SLOT:][:len(blocks[1])]) == blocks[1]
    assert (tier.stats().hits, tier.stats().misses) == (2, 1)      # a hit as `get` counts one
    assert tier.put([(hashes[3], blocks[3])]) == [True]            # evicts the one block no loan holds
    assert tier.put([(hashes[4], blocks[4])]) == [True]
    assert evicted == [hashes[2], hashes[3]]
    other = tier.borrow([hashes[4]])
    assert tier.put([(hashes[2], blocks[2])]) == [False]           # every used slot is lent: no room
    assert tier.delete([hashes[0]]) == 1                           # gone from the index, its bytes stay lent
    assert tier.contains([hashes[0]]) == [False] and bytes(loan.views[0]) == blocks[0]
    assert tier.put([(hashes[2], blocks[2])]) == [False]           # its slot is not free before the release
    tier.check_integrity()
    loan.release()
    loan.release()                                                 # idempotent
    tier.check_integrity()
    assert tier.put([(hashes[2], blocks[2])]) == [True]            # hashes[0]'s slot, freed: no eviction
    assert evicted == [hashes[2], hashes[3]]
    assert tier.put([(hashes[3], blocks[3])]) == [True]            # hashes[1]: no longer lent, the oldest
    assert evicted[-1] == hashes[1] and bytes(other.views[0]) == blocks[4]
    other.release()
    tier.check_integrity()


def test_a_block_lent_twice_stays_until_both_loans_end(tier):
    hashes, blocks = make_blocks(4)
    tier.put(list(zip(hashes[:3], blocks[:3])))
    first, second = tier.borrow(hashes[:1]), tier.borrow(hashes[:1])
    tier.clear()
    first.release()
    assert tier.put(list(zip(hashes[1:4], blocks[1:4]))) == [True, True, True]
    assert tier.contains(hashes[1:4]) == [False, True, True]      # two slots for three: the lent one stays
    assert bytes(second.views[0]) == blocks[0]
    second.release()
    assert tier.put([(hashes[0], blocks[0])]) == [True]
    assert tier.contains(hashes) == [True, False, True, True]     # its freed slot: no eviction
    tier.check_integrity()


def test_reader_sees_blocks_and_never_a_rewritten_slot(tier):
    hashes, blocks = make_blocks(4)
    tier.put(list(zip(hashes[:3], blocks[:3])))
    reader = HostTierReader(tier.shm_name)
    try:
        view = reader.view(hashes[0])
        assert bytes(view.data) == blocks[0] and view.valid()
        tier.put([(hashes[3], blocks[3])])  # evicts block 0 and reuses its slot
        assert not view.valid()  # the bytes under the view changed: the caller must discard them
        view.release()
        assert reader.contains(hashes) == [False, True, True, True]
        buf = bytearray(SLOT)
        assert reader.get([hashes[0], hashes[3]], [memoryview(buf)] * 2) == [None, len(blocks[3])]
        assert bytes(buf[:len(blocks[3])]) == blocks[3]
    finally:
        reader.close()


def test_index_survives_many_evictions_and_tombstone_rebuilds(tier):
    hashes, blocks = make_blocks(40)
    reader = HostTierReader(tier.shm_name)
    try:
        for item in zip(hashes, blocks):
            tier.put([item])
            tier.check_integrity()
        assert reader.contains(hashes[-3:]) == [True, True, True]
        assert not any(reader.contains(hashes[:-3]))
    finally:
        reader.close()


def test_attaching_to_a_missing_segment_is_a_typed_error():
    from kvstore.tiers.base import TierUnavailable
    with pytest.raises(TierUnavailable):
        HostTierReader(f"strata-host-missing-{os.getpid()}")


def _peer_reads(shm_name: str, hashes: list[bytes], fingerprint: bytes, out: mp.Queue) -> None:
    """Runs in a spawned process: attach by name, decode straight from shared memory, copy one into a buffer."""
    import mmap

    from kvstore import codec as peer_codec
    from kvstore.tiers.host import HostTierReader as Reader

    reader = Reader(shm_name)
    view = reader.view(hashes[0])
    block = peer_codec.decode(view.data, fingerprint, hashes[0])
    zero_copy = isinstance(block.payload.obj, mmap.mmap)  # the payload is the shared mapping itself
    result = dict(zero_copy=zero_copy, payload_head=bytes(block.payload[:4]), tokens=list(block.tokens),
                  valid=view.valid())
    del block
    view.release()
    buf = bytearray(8192)
    sizes = reader.get(hashes, [memoryview(buf)] * len(hashes))
    result.update(sizes=sizes, copied=bytes(buf[:sizes[-1]]))
    reader.close()
    out.put(result)


def test_second_process_reads_a_block_zero_copy(tier):
    hashes, blocks = make_blocks(2)
    tier.put(list(zip(hashes, blocks)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    peer = ctx.Process(target=_peer_reads, args=(tier.shm_name, hashes, FP, out))
    peer.start()
    result = out.get(timeout=60)
    peer.join(timeout=30)
    assert peer.exitcode == 0
    assert result["zero_copy"] and result["valid"]
    assert result["payload_head"] == b"\x01" * 4 and result["tokens"] == [100, 101, 102, 103]
    assert result["sizes"] == [len(blocks[0]), len(blocks[1])] and result["copied"] == blocks[1]
    assert tier.contains(hashes) == [True, True]  # the peer's exit did not unlink the owner's segment


def test_an_owner_that_exits_without_close_leaves_no_segment():
    code = "from kvstore.tiers.host import HostTier; t = HostTier(1 << 20, 4096); print(t.shm_name)"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo,
                          timeout=60).stdout.strip()
    assert name.startswith("strata-host-") and not os.path.exists(f"/dev/shm/{name}")


def test_segments_of_killed_owners_are_swept_on_start():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/strata-host-{dead.pid}-deadbeef"
    with open(stale, "wb") as f:
        f.write(b"\0" * 64)  # what a SIGKILLed owner leaves behind
    HostTier(capacity_bytes=SLOT).close()
    assert not os.path.exists(stale)
