"""The worker's KV-event stream (DESIGN §6): one ZeroMQ publisher per worker, on topic `kv-events/<worker id>`.

    block manager hooks (computed KV)  ─┐
    install_blocks (pulled/loaded KV)  ─┴─ DeviceEvents (engine thread; one flush per step) ─┐
    TieredStore (host, disk, redis, s3; its own EventSink) ──────────────────────────────────┼─> ZmqEventPublisher
    cache admin (EvictCache / FlushCache): WorkerEvents.removed / cleared / publish ─────────┘

Device events carry medium "device" (the tier name of DESIGN §5, the one `CacheTierStats.tier` and the store use;
vLLM's consumers and Strata's router both take any medium string, and Strata's router maps "GPU" to the same tier).
Buffering device events until the end of a step turns the block manager's one-call-per-block into one batch per
step, and coalesces the blocks a request commits in one step into one `BlockStored` (a chain, like vLLM's).
"""
from __future__ import annotations

import logging
from typing import Sequence

from kvstore.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, WireOptions, ZmqEventPublisher,
                            worker_topic)

log = logging.getLogger(__name__)

MEDIUM_DEVICE = "device"


class DeviceEvents:
    """Engine-thread buffer of the device tier's events; `flush()` publishes them as one batch.

    The hook signatures are the engine's (`OnBlockStored`, `OnBlockRemoved`). With no publisher every call is a no-op.
    """

    def __init__(self, publisher: ZmqEventPublisher | None, block_size: int) -> None:
        self._publisher, self._block_size = publisher, block_size
        self._events: list[KVEvent] = []

    def on_block_stored(self, block_id: int, block_hash: bytes, parent: bytes | None, tokens: list[int]) -> None:
        if self._publisher is None:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            # NOTE: a chain continues the previous event: extend it (the lists are ours until flush).
            last.block_hashes.append(bytes(block_hash))
            last.token_ids.extend(tokens)
            return
        self._events.append(BlockStored(block_hashes=[bytes(block_hash)], parent_block_hash=parent,
                                        token_ids=list(tokens), block_size=self._block_size, medium=MEDIUM_DEVICE))

    def on_block_removed(self, block_hash: bytes) -> None:
        if self._publisher is None:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(bytes(block_hash))
            return
        self._events.append(BlockRemoved(block_hashes=[bytes(block_hash)], medium=MEDIUM_DEVICE))

    def flush(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        try:
            self._publisher.publish(events)
        except Exception:  # noqa: BLE001 - events are advisory (the router resyncs); serving goes on
            log.exception("publishing %d device KV events failed", len(events))


class WorkerEvents:
    """Owns the worker's publisher. `endpoint` empty = no events (the router then sees no cached prefix here)."""

    def __init__(self, worker_id: str, endpoint: str, replay_endpoint: str, block_size: int,
                 wire: WireOptions = WireOptions()) -> None:
        self.publisher = (ZmqEventPublisher(endpoint, replay_endpoint or None, topic=worker_topic(worker_id),
                                            wire=wire) if endpoint else None)
        self.device = DeviceEvents(self.publisher, block_size)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint if self.publisher else ""

    @property
    def replay_endpoint(self) -> str:
        return (self.publisher.replay_endpoint or "") if self.publisher else ""

    @property
    def num_published(self) -> int:
        """Batches published so far, the next one's sequence number (HeartbeatRequest.kv_event_batches_published)."""
        return self.publisher.next_seq if self.publisher else 0

    def removed(self, medium: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.publish([BlockRemoved(block_hashes=[bytes(h) for h in hashes], medium=medium)])

    def cleared(self, medium: str | None = None) -> None:
        """Every block of this worker is gone; with `medium`, every block of that tier only."""
        self.publish([AllBlocksCleared(medium=medium)])

    def publish(self, events: list[KVEvent]) -> None:
        if self.publisher is None or not events:
            return
        try:
            self.publisher.publish(events)
        except Exception:  # noqa: BLE001 - see DeviceEvents.flush
            log.exception("publishing %d KV events failed", len(events))

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
