"""Per-request block tables over a `BlockPool`, with prefix caching by chained block hashes (DESIGN §3, §8).

The block hash function and the namespace root are injected (`engine` never imports `kvstore`):
`hasher(parent, tokens) -> hash`, chained from `hash_root` (or `request.hash_root`, e.g. a tenant's salted
namespace). Only full, computed blocks are indexed:

    token_ids:  | block 0 | block 1 | block 2 |  blk 3 (partial)  |
    computed:   |<------------ indexed -------->|<- never indexed ->|

A prefix hit is capped so that at least the last token is computed (its logits are needed):
`num_hit_tokens <= (num_tokens - 1) // block_size * block_size`. Pure ints and hashes: no tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from engine.block_pool import BlockPool, OnBlockRemoved
from engine.request import Request

Hasher = Callable[[bytes, Sequence[int]], bytes]
# (block_id, block_hash, parent_hash or None for a first block, the block's token ids)
OnBlockStored = Callable[[int, bytes, "bytes | None", list[int]], None]


class PrefixMatch(NamedTuple):
    block_ids: list[int]     # cached blocks holding the request's leading full blocks, in order
    num_tokens: int          # len(block_ids) * block_size


class FullBlock(NamedTuple):
    block_id: int
    block_hash: bytes


@dataclass
class PrefixCacheStats:
    """Counted when a request is allocated (a re-allocation after preemption counts again)."""

    num_queries: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Contracts:

    - `match_prefix` does not modify anything (it may fill `request.block_hashes`, which are pure content).
    - `allocate` / `append_slots` either succeed completely or change nothing and return False.
    - `commit` indexes the blocks that became full and computed since the last call; call it after each step.
    - `free` releases a table tail first, so a request's last blocks are the first evicted.
    """

    def __init__(self, num_blocks: int, block_size: int, hasher: Hasher, hash_root: bytes,
                 enable_prefix_caching: bool = True, on_block_stored: OnBlockStored | None = None,
                 on_block_removed: OnBlockRemoved | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, on_block_removed)
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._hasher = hasher
        self._hash_root = hash_root
        self._on_block_stored = on_block_stored
        self._tables: dict[str, list[int]] = {}
        self._snapshots: dict[str, list[int]] = {}   # a copy of each table as it last grew (see table_snapshot)
        self._num_committed: dict[str, int] = {}     # leading full blocks already indexed (or hit)

    def salted_root(self, root: bytes | None, salt: str) -> bytes:
        """A hash root that also covers `salt` (chained like a block of its UTF-8 bytes), for blocks whose KV
        depends on more than their tokens."""
        return self._hasher(root or self._hash_root, list(salt.encode()))

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The live table (do not mutate); empty for a request that holds no blocks."""
        return self._tables.get(request_id, [])

    def table_snapshot(self, request_id: str) -> list[int]:
        """A copy of the table that later changes do not touch (do not mutate it). A table only grows while its
        request holds it, so the copy is made again only when it grew: O(1) per decode step, not O(blocks)."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        snapshot = self._snapshots.get(request_id)
        if snapshot is None or len(snapshot) != len(table):
            snapshot = self._snapshots[request_id] = list(table)
        return snapshot

    def match_prefix(self, request: Request) -> PrefixMatch:
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return PrefixMatch([], 0)  # NOTE: prompt logprobs need the logits of every prompt position (as vLLM)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes_upto(request, max_blocks)
        block_ids: list[int] = []
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes[i])
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixMatch(block_ids, len(block_ids) * self.block_size)

    def allocate(self, request: Request, prefix: PrefixMatch, num_new_tokens: int) -> bool:
        """First allocation of a waiting request: take the hit blocks, add fresh ones for `num_new_tokens`.

        On success `request.num_computed_tokens` becomes `prefix.num_tokens`.
        """
        assert request.request_id not in self._tables, f"{request.request_id} already holds blocks"
        num_fresh = cdiv(prefix.num_tokens + num_new_tokens, self.block_size) - len(prefix.block_ids)
        if num_fresh + self.pool.count_cached_free(prefix.block_ids) > self.pool.num_free_blocks:
            return False
        self.pool.touch(prefix.block_ids)  # NOTE: before allocating, so eviction cannot take a hit block
        table = prefix.block_ids + [self.pool.allocate() for _ in range(num_fresh)]
        self._tables[request.request_id] = table
        self._snapshots.pop(request.request_id, None)
        self._num_committed[request.request_id] = len(prefix.block_ids)
        request.num_computed_tokens = prefix.num_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = prefix.num_tokens
        self._count(request, prefix)
        return True

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make the table cover `num_computed_tokens + num_new_tokens` positions."""
        table = self._tables[request.request_id]
        num_fresh = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if num_fresh <= 0:
            return True
        if num_fresh > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate() for _ in range(num_fresh))
        return True

    def commit(self, request: Request) -> None:
        """Index every full block that `num_computed_tokens` now covers."""
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_committed[request.request_id]
        if num_full <= done:
            return
        self._num_committed[request.request_id] = num_full
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes_upto(request, num_full)
        table = self._tables[request.request_id]
        for i in range(done, num_full):
            if self.pool.register(table[i], hashes[i]) and self._on_block_stored is not None:
                bs = self.block_size
                self._on_block_stored(table[i], hashes[i], hashes[i - 1] if i else None,
                                      request.token_ids[i * bs:(i + 1) * bs])

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first). Safe to call for a request that holds none."""
        table = self._tables.pop(request.request_id, None)
        self._num_committed.pop(request.request_id, None)
        self._snapshots.pop(request.request_id, None)
        if table:
            request.freed_block_ids = table  # NOTE: the KV stays readable until the next allocation (a hand-off)
            self.pool.release(reversed(table))

    def full_blocks(self, request: Request) -> list[FullBlock]:
        """(block_id, hash) of the request's full, computed blocks: what a worker writes to the store."""
        table = self.block_table(request.request_id)
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        hashes = self._hashes_upto(request, num_full)
        return [FullBlock(b, h) for b, h in zip(table[:num_full], hashes)]

    def _hashes_upto(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            bs, tokens = self.block_size, request.token_ids
            parent = hashes[-1] if hashes else (request.hash_root or self._hash_root)
            for i in range(len(hashes), num_blocks):
                parent = self._hasher(parent, tokens[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes

    def _count(self, request: Request, prefix: PrefixMatch) -> None:
        s = self.stats
        s.num_queries += 1
        s.query_blocks += request.num_tokens // self.block_size
        s.hit_blocks += len(prefix.block_ids)
        s.query_tokens += request.num_tokens
        s.hit_tokens += prefix.num_tokens

    def check_integrity(self) -> None:
        """The pool's invariants, plus: every reference comes from a table, every table id is used."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        assert refs == self.pool.ref_counts, "ref counts differ from the references the tables hold"
        for rid, table in self._tables.items():
            assert self._num_committed[rid] <= len(table), f"{rid}: more committed blocks than blocks"
