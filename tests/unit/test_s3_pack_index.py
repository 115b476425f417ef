"""The S3 tier's pack layout without S3: the pack bytes, the tombstone body, the read plan and the index
bookkeeping (tombstones, listings, garbage), with exact values."""
from __future__ import annotations

import struct
import zlib

import pytest

from kvstore.tiers.s3_pack import (PackEntry, PackIndex, decode_pack_tail, decode_tombstone, encode_pack,
                                   encode_tombstone, pack_count, pack_tail_bytes, plan_ranges)

BASE = "strata/kv/ns/"
H = [bytes([i]) * 16 for i in range(8)]


def make_pack(*sizes: int) -> tuple[bytes, list[tuple[bytes, int, int]]]:
    return encode_pack([(H[i], memoryview(bytes([i]) * n)) for i, n in enumerate(sizes)])


def pack_key(name: str, count: int) -> str:
    return f"{BASE}packs/{H[0].hex()}-{count}-{name}"


def entry(pack: str, offset: int, length: int, i: int = 0) -> PackEntry:
    return PackEntry(H[i], pack, offset, length)


# ------------------------------------------------------------------------------------------- pack format

def test_pack_holds_blocks_from_offset_zero_then_index_then_footer():
    body, spans = make_pack(3, 5)
    assert spans == [(H[0], 0, 3), (H[1], 3, 5)]
    assert body[:8] == b"\x00" * 3 + b"\x01" * 5
    assert len(body) == 8 + pack_tail_bytes(2) == 8 + 2 * 32 + 16
    assert decode_pack_tail(body[8:], 2, len(body)) == spans


@pytest.mark.parametrize("damage, match", [
    (lambda tail: tail[:-4] + b"\0\0\0\0", "footer"),  # crc
    (lambda tail: tail[:-16] + b"NOTAPACK" + tail[-8:], "footer"),  # magic
    (lambda tail: tail[:-1], "tail is"),  # length
])
def test_a_damaged_pack_tail_is_a_value_error(damage, match):
    body, _ = make_pack(3, 5)
    with pytest.raises(ValueError, match=match):
        decode_pack_tail(damage(body[8:]), 2, len(body))


def forged_tail(*spans: tuple[bytes, int, int]) -> bytes:
    """A tail written by hand from the module's picture: 32-byte entries, then magic, count and crc32."""
    index = b"".join(struct.pack("<16sQQ", *span) for span in spans)
    return index + b"STRPACK1" + struct.pack("<II", len(spans), zlib.crc32(index))


@pytest.mark.parametrize("spans", [[(H[0], 0, 3), (H[1], 2, 3)],  # blocks overlap
                                   [(H[0], 0, 3), (H[1], 3, 3)]])  # the last one runs into the index
def test_a_pack_tail_whose_blocks_overlap_is_a_value_error(spans):
    assert decode_pack_tail(forged_tail((H[0], 0, 3), (H[1], 3, 2)), 2, 5 + 80) == [(H[0], 0, 3), (H[1], 3, 2)]
    with pytest.raises(ValueError, match="overlaps"):
        decode_pack_tail(forged_tail(*spans), 2, 5 + 80)


def test_pack_count_comes_from_the_name():
    assert pack_count(pack_key("00ff", 124)) == 124
    for bad in (f"{BASE}packs/junk", f"{BASE}packs/a-0-b", f"{BASE}packs/a-x-b"):
        with pytest.raises(ValueError):
            pack_count(bad)


def test_tombstone_round_trips_and_names_only_packs():
    named = {pack_key("aa", 2): {H[1], H[0]}}
    body = encode_tombstone(named, BASE)
    assert body == b'{"packs": {"packs/' + H[0].hex().encode() + b'-2-aa": ["' + H[0].hex().encode() + b'", "' + \
        H[1].hex().encode() + b'"]}}'
    assert decode_tombstone(body, BASE) == named
    with pytest.raises(ValueError):
        decode_tombstone(b'{"packs": {"elsewhere/x": []}}', BASE)


# --------------------------------------------------------------------------------------------- read plan

def test_plan_coalesces_nearby_blocks_and_splits_far_or_long_runs():
    a, b = "pack-a", "pack-b"
    wanted = [(entry(a, 0, 10), 0), (entry(a, 15, 10), 1), (entry(a, 100, 10), 2), (entry(b, 0, 10), 3),
              (entry(a, 25, 10), 4)]
    plan = plan_ranges(wanted, max_gap=20, max_span=40)
    assert [(r.pack, r.start, r.end, [i for _, i in r.parts]) for r in plan] == [
        (a, 0, 35, [0, 1, 4]),  # gaps of 5 and 0
        (a, 100, 110, [2]),  # 65 bytes past the last: a request of its own
        (b, 0, 10, [3]),
    ]
    long_run = plan_ranges([(entry(a, 10 * i, 10), i) for i in range(6)], max_gap=0, max_span=40)
    assert [(r.start, r.end) for r in long_run] == [(0, 40), (40, 60)]


def test_plan_keeps_the_same_block_asked_twice_in_one_range():
    plan = plan_ranges([(entry("p", 5, 10), 0), (entry("p", 5, 10), 1)], max_gap=0, max_span=10)
    assert [(r.start, r.end, [i for _, i in r.parts]) for r in plan] == [(5, 15, [0, 1])]


# ------------------------------------------------------------------------------------------------- index

def make_index(*packs: tuple[str, list[int]]) -> PackIndex:
    index = PackIndex()
    for key, blocks in packs:
        index.add_pack(key, 100, [(H[i], 10 * n, 10) for n, i in enumerate(blocks)])
    return index


def test_index_finds_each_block_in_any_pack_that_holds_it():
    index = make_index(("p1", [0, 1]), ("p2", [1, 2]))
    assert index.find(H[0]) == PackEntry(H[0], "p1", 0, 10)
    assert sorted(e.pack for e in index.holders(H[1])) == ["p1", "p2"]
    assert index.find(H[5]) is None
    assert index.blocks_and_bytes() == (3, 200)
    index.check_integrity()


def test_a_tombstone_hides_a_block_in_the_pack_it_names_only():
    index = make_index(("p1", [0, 1]), ("p2", [1]))
    index.add_tombstone("t1", {"p1": {H[1]}})
    assert [e.pack for e in index.holders(H[1])] == ["p2"]
    assert index.live("p1") == {H[0]}
    index.check_integrity()


def test_a_tombstone_read_before_its_pack_applies_when_the_pack_arrives():
    index = PackIndex()
    index.add_tombstone("t1", {"p1": {H[0]}})
    index.add_pack("p1", 100, [(H[0], 0, 10), (H[1], 10, 10)])
    assert index.find(H[0]) is None and index.find(H[1]) is not None
    index.check_integrity()


def test_sync_forgets_unlisted_packs_but_keeps_ones_written_since_the_listing_began():
    index = make_index(("listed", [0]), ("gone", [1]))
    index.add_pack("mine", 100, [(H[2], 0, 10)], born=5.0)
    index.suspended = True
    index.sync({"listed": 100}, {}, started=4.0)
    assert (index.find(H[0]) is not None, index.find(H[1]), index.find(H[2]) is not None) == (True, None, True)
    assert not index.suspended
    index.check_integrity()


def test_a_suspended_index_finds_nothing():
    index = make_index(("p1", [0]))
    index.suspended = True
    assert (index.find(H[0]), index.holders(H[0])) == (None, [])


def test_garbage_is_fully_tombstoned_packs_and_tombstones_of_vanished_packs():
    index = make_index(("p1", [0, 1]), ("p2", [2]), ("p3", [3]))
    index.add_tombstone("t1", {"p1": {H[0]}, "gone": {H[5]}})
    index.add_tombstone("t2", {"p1": {H[1]}})
    index.add_tombstone("t3", {"gone": {H[6]}})
    index.add_tombstone("unlisted", {"gone": {H[7]}})
    index.add_tombstone("malformed", {})
    packs = {"p1": 100, "p2": 100, "p3": 100}
    tombstones = dict.fromkeys(["t1", "t2", "t3", "malformed"], 50)
    assert index.garbage(packs, tombstones) == (["p1"], ["t3"])


def test_unread_lists_what_the_index_has_not_seen():
    index = make_index(("p1", [0]))
    index.add_tombstone("t1", {})
    assert index.unread({"p1": 100, "p2": 7}, {"t1": 1, "t2": 2}) == ({"p2": 7}, ["t2"])


def test_drop_pack_forgets_its_blocks_and_tombstones():
    index = make_index(("p1", [0, 1]), ("p2", [1]))
    index.add_tombstone("t1", {"p1": {H[0]}})
    index.drop_pack("p1")
    assert [e.pack for e in index.holders(H[1])] == ["p2"] and index.find(H[0]) is None
    assert "p1" not in index.dead
    index.check_integrity()
