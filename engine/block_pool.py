"""The device tier's block ids (DESIGN §5, G1): ref counts, a prefix index of full blocks, an LRU of cached-free
blocks.

Every block is in exactly one of three states:

    free         ref 0, no hash      in `_free` (FIFO)           holds nothing worth keeping
    cached-free  ref 0, hash set     in `_lru` (oldest first)    KV reusable by a prefix hit until evicted
    used         ref > 0             in some request's table     hashed or not

A fresh block comes from `free` first and only then evicts the oldest `cached-free` block, so cached KV lives as long
as possible. Pure ints and hashes: no tensors.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterable

OnBlockRemoved = Callable[[bytes], None]


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate()` when every block is in use; callers check `num_free_blocks` first."""


class BlockPool:
    """Fixed `num_blocks` ids. Contracts:

    - `allocate()` never returns a block with ref > 0; it may evict (and report) the oldest cached-free block.
    - `touch(ids)` takes one reference on each id (a prefix hit), pulling cached-free blocks out of the LRU.
    - `release(ids)` drops one reference each, in the order given: the first id to reach ref 0 is the first to be
      evicted later. Callers pass a table reversed so that tail blocks go first.
    - `register(id, h)` indexes a used, full block under `h` once; it returns False (and changes nothing) if `h`
      already names another block.
    """

    def __init__(self, num_blocks: int, on_block_removed: OnBlockRemoved | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._index: dict[bytes, int] = {}
        self._on_block_removed = on_block_removed
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free + cached-free."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block indexed under `block_hash`, used or cached-free. Does not modify anything."""
        return self._index.get(block_hash)

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        elif self._lru:
            block_id, _ = self._lru.popitem(last=False)
            self._evict(block_id)
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self.ref_counts[block_id] = 1
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._lru[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            ref = self.ref_counts[block_id] - 1
            assert ref >= 0, f"block {block_id} released more often than taken"
            self.ref_counts[block_id] = ref
            if ref == 0:
                if self.block_hashes[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._lru[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> bool:
        assert self.ref_counts[block_id] > 0, f"block {block_id} registered while free"
        if block_hash in self._index:
            return False
        assert self.block_hashes[block_id] is None, f"block {block_id} already has a hash (a hash is set once)"
        self.block_hashes[block_id] = block_hash
        self._index[block_hash] = block_id
        return True

    def count_cached_free(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` a `touch` would pull out of the LRU (they stop counting as free)."""
        refs = self.ref_counts
        return sum(1 for b in block_ids if refs[b] == 0)

    def cached_free_blocks(self) -> list[int]:
        """Blocks that hold a cached prefix but no request uses, least recently used first."""
        return list(self._lru)

    def evict_cached(self, block_ids: Iterable[int]) -> list[bytes]:
        """Free the given cached-free blocks now (an operator's evict): their hashes leave the prefix cache (the
        `on_block_removed` hook fires) and they join the free list. Blocks in use or not cached are skipped.
        Returns the hashes evicted."""
        evicted = []
        for block_id in block_ids:
            if self.ref_counts[block_id] != 0 or block_id not in self._lru:
                continue
            evicted.append(self.block_hashes[block_id])
            del self._lru[block_id]
            self._evict(block_id)
            self._free.append(block_id)
        return evicted

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        assert block_hash is not None
        del self._index[block_hash]
        self.block_hashes[block_id] = None
        self.num_evictions += 1
        if self._on_block_removed is not None:
            self._on_block_removed(block_hash)

    def check_integrity(self) -> None:
        """free + cached-free + used == total; refs >= 0; the index and the hashes agree."""
        free, lru = set(self._free), set(self._lru)
        used = {b for b, r in enumerate(self.ref_counts) if r > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert all(r >= 0 for r in self.ref_counts), "negative ref count"
        assert not (free & lru) and not (free & used) and not (lru & used), "a block is in two states"
        assert len(free) + len(lru) + len(used) == self.num_blocks, "free + cached-free + used != total"
        assert all(self.block_hashes[b] is None for b in free), "a free block keeps a hash"
        assert all(self.block_hashes[b] is not None for b in lru), "a cached-free block has no hash"
        for block_hash, block_id in self._index.items():
            assert self.block_hashes[block_id] == block_hash, f"index and block {block_id} disagree"
        hashed = sum(1 for h in self.block_hashes if h is not None)
        assert hashed == len(self._index), "a hashed block is missing from the index"
