"""EvictCache with `demote`: move store blocks one tier down instead of dropping them.

    source tier --get (one batched copy)--> buffers --put--> the next configured tier below
                --delete--> source          events: BlockStored(below), then BlockRemoved(source)

A block that cannot be read or written below is still removed from the source, counted as dropped, never lost
silently. A key the source does not hold is neither (its `get` misses and its `delete` counts nothing), so callers
may pass keys without asking the source first. Keys move in chunks of about `CHUNK_BYTES` of buffers, so thousands of
blocks never sit in memory at once. The bytes are codec objects, so their header tells the events their parent hash
and token ids (as the store's own `EventSink` does for its writes).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from kvstore import codec
from kvstore.events import BlockStored
from kvstore.tiers.base import Tier
from worker_common.kv_events import WorkerEvents


CHUNK_BYTES = 64 << 20


class Moved(NamedTuple):
    demoted: int       # now in the tier below
    dropped: int       # removed from the source without landing below


def demote(source_name: str, source: Tier, below_name: str, below: Tier, keys: Sequence[bytes], buf_bytes: int,
           events: WorkerEvents) -> Moved:
    """Move `keys` into `below`; `buf_bytes` bounds one encoded block. Raises what the tiers raise
    (`TierUnavailable`), before anything of the failing chunk was deleted (earlier chunks stay moved)."""
    step = max(1, CHUNK_BYTES // max(1, buf_bytes))
    demoted = dropped = 0
    for start in range(0, len(keys), step):
        moved = _demote_chunk(source_name, source, below_name, below, keys[start:start + step], buf_bytes, events)
        demoted, dropped = demoted + moved.demoted, dropped + moved.dropped
    return Moved(demoted, dropped)


def _demote_chunk(source_name: str, source: Tier, below_name: str, below: Tier, keys: Sequence[bytes],
                  buf_bytes: int, events: WorkerEvents) -> Moved:
    bufs = [memoryview(bytearray(buf_bytes)) for _ in keys]
    sizes = source.get(list(keys), bufs)
    items = [(bytes(k), buf[:n]) for k, buf, n in zip(keys, bufs, sizes) if n is not None]
    stored = below.put(items) if items else []
    landed = [(k, data) for (k, data), ok in zip(items, stored) if ok]
    _announce(events, below_name, landed)
    removed = source.delete(list(keys))
    events.removed(source_name, list(keys))
    return Moved(len(landed), max(0, removed - len(landed)))


def _announce(events: WorkerEvents, medium: str, items: list[tuple[bytes, memoryview]]) -> None:
    stored = []
    for key, data in items:
        header = codec.peek_header(data)
        stored.append(BlockStored(block_hashes=[key], parent_block_hash=header.parent_hash,
                                  token_ids=codec.read_tokens(data, header), block_size=header.layout.block_size,
                                  medium=medium))
    events.publish(stored)
