"""What the tiered store tells routers (DESIGN §6): `BlockStored` / `BlockRemoved` / `AllBlocksCleared` per tier.

The store hands events to any object with `publish(list_of_events)` (normally `kvstore.events.ZmqEventPublisher`).
Token ids, parent hash and block size come from the codec header of the stored bytes, so a block demoted long after
it was computed is still described completely. Without a publisher nothing is parsed or built.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from kvstore import codec

log = logging.getLogger(__name__)


class EventSink:
    """Builds events for one store and publishes them; a failing publisher is logged, never raised to callers."""

    def __init__(self, publisher: Any | None) -> None:
        self._publisher = publisher
        self._types = None
        if publisher is not None:
            try:
                from kvstore import events as types  # lazy: the store works without the events package
                self._types = types
            except ImportError:
                log.warning("kvstore.events is not importable; KV events are disabled")
        self._lock = threading.Lock()
        self.failures = 0

    @property
    def enabled(self) -> bool:
        return self._types is not None

    def stored(self, medium: str, items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        if not self.enabled or not items:
            return
        events = []
        for key, data in items:
            try:
                header = codec.peek_header(data)
            except codec.CorruptBlock:
                continue
            events.append(self._types.BlockStored(
                block_hashes=[bytes(key)], parent_block_hash=header.parent_hash,
                token_ids=codec.read_tokens(data, header), block_size=header.layout.block_size, medium=medium))
        self._publish(events)

    def removed(self, medium: str, keys: Sequence[bytes]) -> None:
        if self.enabled and keys:
            self._publish([self._types.BlockRemoved(block_hashes=[bytes(k) for k in keys], medium=medium)])

    def cleared(self, medium: str | None = None) -> None:
        """Every block the store published is gone; with `medium`, every block of that tier only."""
        if self.enabled:
            self._publish([self._types.AllBlocksCleared(medium=medium)])

    def _publish(self, events: list) -> None:
        if not events:
            return
        try:
            with self._lock:
                self._publisher.publish(events)
        except Exception:  # noqa: BLE001 - events are advisory; serving must go on
            self.failures += 1
            log.exception("publishing %d KV events failed", len(events))
