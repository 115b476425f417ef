"""The publisher's holdings book and the snapshot codec (DESIGN §6: a router loads a snapshot on a replay gap)."""
from __future__ import annotations

import msgpack
import pytest

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, Holdings, Snapshot
from kvstore.events.snapshot import SNAPSHOT_REQUEST, decode_snapshot, encode_snapshot
from kvstore.events.wire import SEQ_BYTES, WireError
from router.index import PrefixIndex


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(ids: list[int], medium: str | None) -> BlockStored:
    return BlockStored(block_hashes=[h(i) for i in ids], parent_block_hash=None, token_ids=[0] * 2 * len(ids),
                       block_size=2, medium=medium)


def removed(ids: list[int], medium: str | None) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h(i) for i in ids], medium=medium)


def test_stored_blocks_are_held_per_medium():
    book = Holdings()
    book.apply([stored([1, 2], "device"), stored([2, 3], "host")])
    assert book.items() == [("device", [h(1), h(2)]), ("host", [h(2), h(3)])]
    assert len(book) == 4 and (h(2), "host") in book and (h(1), "host") not in book
    book.check_integrity()


def test_removed_blocks_leave_only_their_medium():
    book = Holdings()
    book.apply([stored([1, 2], "device"), stored([1], "host"), removed([1, 9], "device"), removed([5], "disk")])
    assert book.items() == [("device", [h(2)]), ("host", [h(1)])]
    book.check_integrity()


def test_restoring_a_block_moves_it_to_the_newest_without_counting_it_twice():
    book = Holdings()
    book.apply([stored([1, 2, 3], "host"), stored([1], "host")])
    assert book.items() == [("host", [h(2), h(3), h(1)])] and len(book) == 3


def test_all_blocks_cleared_with_a_medium_empties_that_medium_only():
    book = Holdings()
    book.apply([stored([1], "device"), stored([2], "redis"), AllBlocksCleared(medium="redis")])
    assert book.items() == [("device", [h(1)])] and len(book) == 1


def test_all_blocks_cleared_without_a_medium_empties_every_medium():
    book = Holdings()
    book.apply([stored([1], "device"), stored([2], None), stored([3], "disk"), AllBlocksCleared()])
    assert book.items() == [] and len(book) == 0
    book.check_integrity()


def test_max_blocks_drops_the_oldest_entries_of_the_medium_being_filled():
    book = Holdings(max_blocks=3)
    book.apply([stored([1], "device"), stored([2, 3], "host"), stored([4, 5], "host")])
    assert book.items() == [("device", [h(1)]), ("host", [h(4), h(5)])]
    assert (len(book), book.num_dropped) == (3, 2)
    book.check_integrity()


def test_max_blocks_must_be_positive():
    with pytest.raises(ValueError, match="max_blocks must be >= 1"):
        Holdings(max_blocks=0)


def test_snapshot_round_trips_with_its_sequence_number():
    payload = encode_snapshot(42, [("device", [h(1), h(2)]), (None, [h(3)])])
    snap = decode_snapshot(payload)
    assert snap == Snapshot(42, (("device", (h(1), h(2))), (None, (h(3),))))
    assert list(snap.blocks()) == [(h(1), "device"), (h(2), "device"), (h(3), None)] and len(snap) == 3


def test_snapshot_hashes_follow_the_publishers_int_hash_encoding():
    snap = decode_snapshot(encode_snapshot(0, [("host", [h(7)])], hash_encoding="int"))
    assert snap.tiers == (("host", (7,)),)  # the low 64 bits, as the batches carry them


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb([1]), msgpack.packb([-1, []]), msgpack.packb(["1", []]), msgpack.packb([True, []]),
    msgpack.packb([1, [["host"]]]), msgpack.packb([1, [[3, []]]]), msgpack.packb([1, [["host", [1.5]]]]),
    msgpack.packb({"next_seq": 1}),
])
def test_malformed_snapshots_are_a_wire_error(payload):
    with pytest.raises(WireError):
        decode_snapshot(payload)


def test_a_snapshot_request_is_never_read_as_a_replay_request():
    assert len(SNAPSHOT_REQUEST) != SEQ_BYTES


def test_the_index_loaded_from_a_snapshot_holds_what_the_book_holds():
    """Holdings -> snapshot -> `PrefixIndex.load_snapshot` is the path a resync takes (media normalised there)."""
    book = Holdings()
    book.apply([stored([1, 2, 3], "device"), stored([2], "host"), removed([3], "device")])
    index = PrefixIndex()
    index.add_blocks("w", [h(9)], "disk")  # stale: the snapshot replaces it
    snap = decode_snapshot(encode_snapshot(17, book.items()))
    index.load_snapshot("w", snap.blocks(), snap.next_seq)
    assert index.blocks_of("w") == {h(1): ("device",), h(2): ("device", "host")}
    assert index.expected_seq("w") == 17
    index.check_integrity()
