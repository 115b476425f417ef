"""What a publisher currently holds, per medium, kept from the events it publishes (DESIGN §6: snapshots).

A router whose subscriber meets a gap the replay buffer no longer covers asks the publisher for a snapshot instead
of forgetting the worker. The publisher answers from this book, which its own events keep up to date:

    BlockStored(hashes, medium)        medium's set += hashes
    BlockRemoved(hashes, medium)       medium's set -= hashes
    AllBlocksCleared(medium)           medium's set emptied         (no medium: every set emptied)

Bookkeeping only: hashes and medium names, no sockets. Bounded by what the tiers hold (every eviction publishes a
removal) and, as a guard against a publisher whose removals never come (another worker evicting a shared redis
key), by `max_blocks`: past it the oldest entries go. A dropped entry only makes a snapshot under-report, which
costs a recompute, never wrong KV (workers verify every block they read).

NOTE: media are matched by the exact string published ("GPU" and "device" are two keys here): a publisher names
each tier one way, and the router normalises the names when it loads the snapshot.
"""
from __future__ import annotations

from typing import Iterable

from kvstore.events.types import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEvent

DEFAULT_MAX_BLOCKS = 4_000_000


class Holdings:
    """Block hashes per medium (None = vLLM's default medium, the device). Not thread-safe: the publisher's thread
    owns it, so what it answers is consistent with the sequence numbers that thread has sent."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._media: dict[str | None, dict[ExternalBlockHash, None]] = {}  # insertion ordered: oldest first
        self._count = 0
        self.num_dropped = 0

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.add(event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self.remove(event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.clear(event.medium)

    def add(self, hashes: Iterable[ExternalBlockHash], medium: str | None) -> None:
        blocks = self._media.setdefault(medium, {})
        for h in hashes:
            if h in blocks:
                del blocks[h]  # re-inserted below: a re-stored block becomes the newest
            else:
                self._count += 1
            blocks[h] = None
        while self._count > self.max_blocks:
            self._drop_oldest(blocks)  # NOTE: holds what was just added, so it is never empty here

    def remove(self, hashes: Iterable[ExternalBlockHash], medium: str | None) -> None:
        blocks = self._media.get(medium)
        if blocks is None:
            return
        for h in hashes:
            if h in blocks:
                del blocks[h]
                self._count -= 1

    def clear(self, medium: str | None = None) -> None:
        """Empty one medium's set; every set when `medium` is None (AllBlocksCleared without a medium)."""
        if medium is None:
            self._media.clear()
            self._count = 0
        else:
            self._count -= len(self._media.pop(medium, {}))

    def items(self) -> list[tuple[str | None, list[ExternalBlockHash]]]:
        """(medium, hashes oldest first) for every non-empty medium."""
        return [(medium, list(blocks)) for medium, blocks in self._media.items() if blocks]

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: tuple[ExternalBlockHash, str | None]) -> bool:
        h, medium = key
        return h in self._media.get(medium, {})

    def check_integrity(self) -> None:
        """The running count is the sum of the sets, within the bound."""
        assert self._count == sum(len(b) for b in self._media.values()), "holdings count drifted"
        assert self._count <= self.max_blocks, "holdings exceed max_blocks"

    def _drop_oldest(self, blocks: dict[ExternalBlockHash, None]) -> None:
        del blocks[next(iter(blocks))]
        self._count -= 1
        self.num_dropped += 1
