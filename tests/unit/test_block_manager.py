"""Block pool and block manager: exact block ids for allocation, prefix hits, LRU eviction and free order."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from engine.block_manager import BlockManager, FullBlock, PrefixMatch
from engine.block_pool import BlockPool
from engine.request import Request
from engine.sampling_params import SamplingParams
from kvstore.hashing import Namespace, hash_block, hash_blocks

BS = 4
ROOT = Namespace("test-model", "bs4", "float32").fingerprint()


def make_manager(num_blocks: int = 8, **kw) -> BlockManager:
    return BlockManager(num_blocks, BS, hash_block, ROOT, **kw)


def make_request(request_id: str, tokens: list[int], **kw) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=16), **kw)


def prefill(bm: BlockManager, request: Request) -> PrefixMatch:
    """Allocate the whole prompt at once, pretend the step ran, index full blocks."""
    prefix = bm.match_prefix(request)
    assert bm.allocate(request, prefix, request.num_tokens - prefix.num_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.commit(request)
    bm.check_integrity()
    return prefix


def decode(bm: BlockManager, request: Request, token_id: int) -> None:
    """Append a sampled token, then compute it (one decode step)."""
    request.append_output(token_id)
    assert bm.append_slots(request, 1)
    request.num_computed_tokens += 1
    bm.commit(request)
    bm.check_integrity()


def test_allocate_takes_fresh_blocks_in_id_order():
    bm = make_manager()
    a = make_request("a", list(range(10)))
    prefill(bm, a)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5


def test_prefix_hit_reuses_cached_full_blocks():
    bm = make_manager()
    a = make_request("a", list(range(10)))
    prefill(bm, a)
    bm.free(a)       # released tail first: 2 (partial, unhashed) -> free list; 1, 0 -> LRU
    b = make_request("b", list(range(8)) + [99, 98])
    prefix = prefill(bm, b)
    assert prefix == PrefixMatch([0, 1], 8)
    assert b.num_cached_tokens == 8
    assert bm.block_table("b") == [0, 1, 3]   # free list was [3, 4, 5, 6, 7, 2]


def test_prefix_hit_on_block_in_use_shares_it():
    bm = make_manager()
    a = make_request("a", list(range(9)))
    prefill(bm, a)
    b = make_request("b", list(range(9)))
    prefill(bm, b)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_full_prefix_hit_still_computes_the_last_token():
    """A prompt of exactly two cached blocks hits one: the last block is recomputed for the last token's logits."""
    bm = make_manager()
    prefill(bm, make_request("a", list(range(8))))
    b = make_request("b", list(range(8)))
    prefix = bm.match_prefix(b)
    assert prefix == PrefixMatch([0], 4)


def test_free_evicts_tail_blocks_first():
    removed: list[bytes] = []
    bm = make_manager(num_blocks=4, on_block_removed=removed.append)
    a = make_request("a", list(range(12)))          # three full blocks
    prefill(bm, a)
    bm.free(a)                                      # LRU, oldest first: 2, 1, 0; free list: 3
    hashes = hash_blocks(ROOT, list(range(12)), BS)
    c = make_request("c", [50, 51, 52, 53, 54])     # needs two fresh blocks: 3, then evicts 2
    prefill(bm, c)
    assert bm.block_table("c") == [3, 2]
    assert removed == [hashes[2]]
    b = make_request("b", list(range(12)) + [7])    # blocks 0 and 1 are still cached
    assert bm.match_prefix(b) == PrefixMatch([0, 1], 8)


def test_hit_moves_block_to_young_end_of_lru():
    removed: list[bytes] = []
    bm = make_manager(num_blocks=3, on_block_removed=removed.append)
    a = make_request("a", [1, 2, 3, 4, 9])
    prefill(bm, a)
    bm.free(a)                                      # LRU: 0; free: 2, 1
    b = make_request("b", [5, 6, 7, 8, 9])
    prefill(bm, b)                                  # takes 2, 1; block 2 indexed
    bm.free(b)                                      # free: 1; LRU: 0, 2
    a2 = make_request("a2", [1, 2, 3, 4, 10])
    prefill(bm, a2)                                 # hits 0, fresh 1
    bm.free(a2)                                     # free: 1; LRU: 2, 0 (0 is now the youngest)
    c = make_request("c", [11, 12, 13, 14, 15, 16, 17, 18, 19])   # three fresh: 1, then evict 2, then 0
    prefill(bm, c)
    assert bm.block_table("c") == [1, 2, 0]
    assert removed == hash_blocks(ROOT, [5, 6, 7, 8], BS) + hash_blocks(ROOT, [1, 2, 3, 4], BS)


def test_decode_indexes_block_when_it_becomes_full():
    stored: list[tuple] = []
    bm = make_manager(on_block_stored=lambda *event: stored.append(event))
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    prefill(bm, a)
    h0 = hash_block(ROOT, [1, 2, 3, 4])
    assert stored == [(0, h0, None, [1, 2, 3, 4])]
    decode(bm, a, 7)
    assert len(stored) == 1                          # block 1 holds 7 of 8 tokens... not yet full
    decode(bm, a, 8)
    assert stored[1] == (1, hash_block(h0, [5, 6, 7, 8]), h0, [5, 6, 7, 8])
    decode(bm, a, 9)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.full_blocks(a) == [FullBlock(0, h0), FullBlock(1, hash_block(h0, [5, 6, 7, 8]))]


def test_allocate_fails_without_changing_anything():
    bm = make_manager(num_blocks=4)
    a = make_request("a", list(range(8)) + [1])
    prefill(bm, a)
    bm.free(a)                                      # free: 3, 2; LRU: 1, 0
    big = make_request("big", list(range(8)) + list(range(100, 110)))   # hits 0, 1 and needs 3 fresh
    prefix = bm.match_prefix(big)
    assert prefix.block_ids == [0, 1]
    assert not bm.allocate(big, prefix, big.num_tokens - prefix.num_tokens)
    assert bm.block_table("big") == [] and bm.num_free_blocks == 4
    assert bm.match_prefix(big) == prefix
    bm.check_integrity()


def test_same_block_computed_twice_is_indexed_once():
    bm = make_manager()
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 6])
    for r in (a, b):                                # both allocated before either is computed
        assert bm.allocate(r, bm.match_prefix(r), 5)
    for r in (a, b):
        r.num_computed_tokens = 5
        bm.commit(r)
    assert bm.block_table("a") == [0, 1] and bm.block_table("b") == [2, 3]
    assert bm.pool.lookup(hash_block(ROOT, [1, 2, 3, 4])) == 0
    bm.free(b)                                      # block 2 was never indexed: plain free
    assert bm.pool.num_cached_free_blocks == 0
    assert bm.full_blocks(b) == []                  # holds no blocks any more
    bm.check_integrity()


def test_other_namespace_never_hits():
    bm = make_manager()
    prefill(bm, make_request("a", list(range(9))))
    tenant = Namespace("test-model", "bs4", "float32", cache_salt="tenant-1").fingerprint()
    b = make_request("b", list(range(9)), hash_root=tenant)
    assert bm.match_prefix(b) == PrefixMatch([], 0)


def test_prefix_caching_disabled_never_hits():
    bm = make_manager(enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    prefill(bm, a)
    bm.free(a)
    assert bm.pool.num_cached_free_blocks == 0
    assert bm.match_prefix(make_request("b", list(range(9)))) == PrefixMatch([], 0)


def test_hit_counters_count_blocks_and_tokens():
    bm = make_manager()
    prefill(bm, make_request("a", list(range(9))))
    prefill(bm, make_request("b", list(range(9))))
    s = bm.stats
    assert (s.num_queries, s.query_blocks, s.hit_blocks, s.query_tokens, s.hit_tokens) == (2, 4, 2, 18, 8)
    assert abs(s.token_hit_rate - 8 / 18) < 1e-12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "decode", "free"]), st.integers(0, 7),
                          st.lists(st.integers(0, 2), min_size=1, max_size=14)), max_size=40))
def test_integrity_holds_under_random_operations(ops):
    """Prompts over a 3-token alphabet make prefix hits, shared blocks and evictions frequent."""
    bm = make_manager(num_blocks=10)
    live: dict[int, Request] = {}
    for op, slot, tokens in ops:
        request = live.get(slot)
        if op == "new" and request is None:
            request = make_request(str(slot), tokens)
            prefix = bm.match_prefix(request)
            if bm.allocate(request, prefix, request.num_tokens - prefix.num_tokens):
                request.num_computed_tokens = request.num_tokens
                bm.commit(request)
                live[slot] = request
        elif op == "decode" and request is not None:
            request.append_output(tokens[0])
            if bm.append_slots(request, 1):
                request.num_computed_tokens += 1
                bm.commit(request)
            else:
                request.token_ids.pop()
                request.output_token_ids.pop()
        elif op == "free" and request is not None:
            bm.free(live.pop(slot))
        bm.check_integrity()
        for r in live.values():
            assert len(bm.block_table(r.request_id)) * BS >= r.num_computed_tokens
    for r in live.values():
        bm.free(r)
    bm.check_integrity()
    assert bm.num_free_blocks == 10


def make_pool(removed: list[bytes]) -> BlockPool:
    """6 blocks: 0, 1 used and hashed; 2, 3 cached-free (2 older); 4, 5 free."""
    pool = BlockPool(6, removed.append)
    ids = [pool.allocate() for _ in range(4)]
    for block_id in ids:
        pool.register(block_id, bytes([block_id]) * 16)
    pool.release([2, 3])
    return pool


def test_device_eviction_frees_only_cached_blocks_and_keeps_the_pool_consistent():
    removed: list[bytes] = []
    pool = make_pool(removed)
    assert pool.cached_free_blocks() == [2, 3]
    assert pool.evict_cached([0, 3, 5]) == [bytes([3]) * 16]     # 0 is in use, 5 holds nothing
    assert removed == [bytes([3]) * 16] and pool.lookup(bytes([3]) * 16) is None
    pool.check_integrity()
    assert pool.evict_cached(pool.cached_free_blocks()) == [bytes([2]) * 16]
    assert (pool.num_free_blocks, pool.num_cached_free_blocks, pool.num_used_blocks) == (4, 0, 2)
    pool.check_integrity()
