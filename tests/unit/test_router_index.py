"""The router's global prefix index: events in, per-worker per-tier leading runs out (DESIGN §6)."""
from __future__ import annotations

import pytest

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index import (
    TIER_BIT,
    IndexConfig,
    PrefixIndex,
    WorkerId,
    fastest_tier,
    normalize_medium,
    tiers_of,
)

W1, W2, STORE = WorkerId("w1"), WorkerId("w2"), WorkerId("store")
DEV, HOST, REDIS = TIER_BIT["device"], TIER_BIT["host"], TIER_BIT["redis"]
DISK, S3 = TIER_BIT["disk"], TIER_BIT["s3"]


def h(i: int) -> bytes:
    """The i-th block hash of one chain (16 bytes, like kvstore.hashing)."""
    return i.to_bytes(16, "big")


def chain(n: int) -> list[bytes]:
    return [h(i) for i in range(n)]


def stored(ids, medium: str | None = "GPU") -> BlockStored:
    return BlockStored([h(i) for i in ids], h(ids[0] - 1) if ids[0] else None, [], 4, None, medium)


def removed(ids, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved([h(i) for i in ids], medium)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


def make_index(**feeds) -> PrefixIndex:
    """`make_index(w1=[events...])`: each worker's events applied as one batch with seq 0."""
    index = PrefixIndex()
    for worker, events in feeds.items():
        assert index.apply(WorkerId(worker), batch(*events), 0).status == "applied"
    return index


# ---------------------------------------------------------------------------------------------------- match

def test_match_gives_exact_leading_run_per_worker_and_tier():
    index = make_index(w1=[stored([0, 1, 2])], w2=[stored([0, 1], "CPU")])
    m = index.match(chain(4))
    assert (m.num_query_blocks, m.pooled_blocks) == (4, 3)
    w1, w2 = m.for_worker(W1), m.for_worker(W2)
    assert w1.num_blocks == 3 and w1.tier_runs() == {"device": 3, "host": 0, "disk": 0, "redis": 0, "s3": 0}
    assert w2.num_blocks == 2 and w2.tier_run("host") == 2 and w2.tier_run("device") == 0
    assert m.workers() == (W1, W2)
    index.check_integrity()


def test_match_combines_tiers_block_by_block():
    """Block 0 in device and host, block 1 in host only: a run of 2 across tiers, device run 1, host run 2."""
    index = make_index(w1=[stored([0]), stored([0, 1], "host")])
    w1 = index.match(chain(3)).for_worker(W1)
    assert w1.block_masks == (DEV | HOST, HOST)
    assert (w1.num_blocks, w1.tier_run("device"), w1.tier_run("host")) == (2, 1, 2)


def test_match_stops_at_first_block_nobody_holds():
    index = make_index(w1=[stored([0, 1]), stored([3, 4])])
    m = index.match(chain(5))
    assert m.pooled_blocks == 2 and m.for_worker(W1).num_blocks == 2


def test_match_marks_blocks_only_a_peer_holds_inside_the_pooled_run():
    index = make_index(w1=[stored([0]), stored([2])], w2=[stored([0, 1])])
    m = index.match(chain(3))
    assert m.pooled_blocks == 3
    assert m.for_worker(W1).block_masks == (DEV, 0, DEV) and m.for_worker(W1).num_blocks == 1
    assert m.for_worker(W2).block_masks == (DEV, DEV)


def test_match_of_unknown_worker_or_empty_query_is_empty():
    index = make_index(w1=[stored([0, 1])])
    assert index.match(chain(2)).for_worker(WorkerId("nobody")).num_blocks == 0
    assert index.match([]).pooled_blocks == 0


def test_shared_tier_block_counts_for_every_worker():
    index = make_index(store=[stored([0, 1, 2], "redis")], w1=[stored([0])])
    m = index.match(chain(4))
    assert m.for_worker(WorkerId("w9")).block_masks == (REDIS, REDIS, REDIS)
    assert m.for_worker(W1).block_masks == (DEV | REDIS, REDIS, REDIS)
    assert m.for_worker(W1).tier_run("redis") == 3 and m.for_worker(W1).tier_run("device") == 1
    assert m.workers() == (W1,)  # the store holds only shared tiers: it is not a worker to route to


def test_int_hashes_from_a_vllm_publisher_are_indexed_as_they_come():
    index = PrefixIndex()
    index.apply(W1, batch(BlockStored([11, 12], None, [], 16, None, None)), 0)
    assert index.match([11, 12, 13]).for_worker(W1).tier_run("device") == 2


# -------------------------------------------------------------------------------------------------- updates

def test_removed_drops_only_that_tier():
    index = make_index(w1=[stored([0, 1, 2]), stored([1], "host"), removed([1]), removed([2])])
    assert index.match(chain(3)).for_worker(W1).block_masks == (DEV, HOST)
    index.check_integrity()


def test_removed_from_a_shared_tier_is_gone_for_every_worker():
    """One redis backend: a block one worker saw leave it (an eviction) is no longer there for the others either;
    their local tiers keep theirs."""
    index = make_index(w1=[stored([0, 1], "redis"), stored([0, 1], "host")], w2=[stored([0, 1], "redis")])
    assert index.apply(W2, batch(removed([1], "redis")), 1).status == "applied"
    m = index.match(chain(2))
    assert m.shared_masks == (REDIS, 0)
    assert m.for_worker(W1).block_masks == (HOST | REDIS, HOST)
    assert m.for_worker(W2).block_masks == (REDIS,)
    index.check_integrity()


def test_removed_of_unknown_blocks_or_workers_is_harmless():
    index = make_index(w1=[stored([0]), removed([5])], w2=[removed([0])])
    assert index.match(chain(1)).for_worker(W1).num_blocks == 1
    index.check_integrity()


def test_all_blocks_cleared_drops_only_that_worker():
    index = make_index(w1=[stored([0, 1])], w2=[stored([0])])
    assert index.apply(W1, batch(AllBlocksCleared()), 1).status == "applied"
    m = index.match(chain(2))
    assert m.for_worker(W1).num_blocks == 0 and m.for_worker(W2).num_blocks == 1
    assert index.expected_seq(W1) == 2  # sequence tracking survives a clear
    index.check_integrity()


def test_clear_of_a_local_tier_drops_only_that_tier_of_that_worker():
    """A flush of w1's host tier: w1 keeps its device and disk entries, w2 its host entries."""
    index = make_index(w1=[stored([0, 1]), stored([0, 1, 2], "host"), stored([0, 1, 2, 3], "disk")],
                       w2=[stored([0, 1], "host")])
    assert index.apply(W1, batch(AllBlocksCleared(medium="host")), 1).status == "applied"
    m = index.match(chain(4))
    assert m.for_worker(W1).block_masks == (DEV | DISK, DEV | DISK, DISK, DISK)
    assert m.for_worker(W2).block_masks == (HOST, HOST)
    assert index.num_blocks(W1) == 4  # every block is still held in another tier
    index.check_integrity()


def test_clear_of_a_shared_tier_drops_it_for_every_worker_and_keeps_host_and_disk():
    """`strata cache flush --tier redis` empties the one backend every worker shares: the redis entries go, whoever
    reported them, and no worker's host or disk entry goes with them."""
    index = make_index(w1=[stored([0, 1, 2], "host"), stored([0, 1], "redis")],
                       w2=[stored([0], "disk"), stored([0, 1, 2], "redis"), stored([0, 1, 2], "s3")])
    assert index.apply(W1, batch(AllBlocksCleared(medium="redis")), 1).status == "applied"
    m = index.match(chain(3))
    assert m.shared_masks == (S3, S3, S3)
    assert m.for_worker(W1).block_masks == (HOST | S3, HOST | S3, HOST | S3)
    assert m.for_worker(W2).block_masks == (DISK | S3, S3, S3)
    assert index.blocks_of(W2) == {h(0): ("disk", "s3"), h(1): ("s3",), h(2): ("s3",)}
    index.check_integrity()


def test_clear_of_a_tier_nobody_uses_and_clear_without_medium():
    index = make_index(w1=[stored([0, 1], "host")], w2=[stored([0], "host")])
    assert index.apply(W1, batch(AllBlocksCleared(medium="s3")), 1).status == "applied"
    assert index.num_blocks(W1) == 2 and index.num_blocks(W2) == 1
    assert index.apply(W1, batch(AllBlocksCleared()), 2).status == "applied"  # vLLM's form: every tier of w1
    assert index.num_blocks(W1) == 0 and index.num_blocks(W2) == 1
    index.check_integrity()


def test_clear_of_an_unknown_medium_is_rejected_with_the_allowed_names():
    index = make_index(w1=[stored([0])])
    with pytest.raises(ValueError, match="medium must be one of"):
        index.clear_tier(W1, "tape")


def test_remove_worker_forgets_entries_and_sequence():
    index = make_index(w1=[stored([0, 1])], w2=[stored([0])])
    index.remove_worker(W1)
    assert index.match(chain(2)).for_worker(W1).num_blocks == 0
    assert index.expected_seq(W1) is None and index.worker_ids() == (W2,)
    assert index.apply(W1, batch(stored([0])), 7).status == "applied"  # a returning worker starts afresh
    index.check_integrity()


def test_unknown_event_type_is_rejected():
    with pytest.raises(TypeError, match="BlockStored"):
        PrefixIndex().apply(W1, batch("not an event"), 0)


# ------------------------------------------------------------------------------------------------ sequences

def test_gap_is_reported_and_not_applied_until_replayed():
    index = PrefixIndex()
    assert index.apply(W1, batch(stored([0])), 0).status == "applied"
    gap = index.apply(W1, batch(stored([1])), 2)
    assert (gap.status, gap.expected_seq, gap.received_seq, gap.needs_resync) == ("gap", 1, 2, True)
    assert index.match(chain(2)).for_worker(W1).num_blocks == 1  # seq 2 was not applied
    # The replay brings 1 and 2 in order.
    assert index.apply(W1, batch(stored([1])), 1).status == "applied"
    assert index.apply(W1, batch(stored([2])), 2).status == "applied"
    assert index.match(chain(3)).for_worker(W1).num_blocks == 3


def test_old_sequence_is_a_duplicate_and_ignored():
    index = PrefixIndex()
    index.apply(W1, batch(stored([0])), 4)  # the first batch seen is accepted whatever its number
    dup = index.apply(W1, batch(removed([0])), 4)
    assert (dup.status, dup.expected_seq) == ("duplicate", 5)
    assert index.match(chain(1)).for_worker(W1).num_blocks == 1


def test_sequences_are_tracked_per_worker():
    index = PrefixIndex()
    index.apply(W1, batch(stored([0])), 0)
    assert index.apply(W2, batch(stored([0])), 100).status == "applied"
    assert index.apply(W1, batch(stored([1])), 1).status == "applied"


def test_load_snapshot_replaces_entries_and_resets_sequence():
    index = make_index(w1=[stored([5, 6])])
    index.load_snapshot(W1, [(h(0), "GPU"), (h(1), "CPU")], next_seq=40)
    assert index.match(chain(2)).for_worker(W1).block_masks == (DEV, HOST)
    assert index.num_blocks(W1) == 2 and index.expected_seq(W1) == 40
    index.check_integrity()


# ------------------------------------------------------------------------------------------- memory, tiers

def test_memory_bound_drops_a_workers_oldest_entries():
    index = PrefixIndex(IndexConfig(max_blocks_per_worker=3))
    index.apply(W1, batch(stored([0, 1, 2]), stored([0]), stored([3, 4])), 0)  # re-storing 0 makes it newest
    assert set(index.blocks_of(W1)) == {h(0), h(3), h(4)} and index.num_dropped == 2
    index.check_integrity()


def test_index_config_rejects_a_zero_bound():
    with pytest.raises(ValueError, match="max_blocks_per_worker"):
        IndexConfig(max_blocks_per_worker=0)


@pytest.mark.parametrize("medium, tier", [("GPU", "device"), ("gpu", "device"), (None, "device"), ("CPU", "host"),
                                          ("host", "host"), ("disk", "disk"), ("redis", "redis"), ("S3", "s3")])
def test_medium_names_are_normalised(medium, tier):
    assert normalize_medium(medium) == tier


def test_unknown_medium_is_rejected_with_the_allowed_names():
    with pytest.raises(ValueError, match="medium must be one of"):
        normalize_medium("tape")


def test_tier_masks_read_fastest_first():
    assert tiers_of(HOST | REDIS | DEV) == ("device", "host", "redis")
    assert fastest_tier(HOST | REDIS) == "host" and fastest_tier(0) is None
