"""Which rank of an expert-parallel group holds which KV blocks, and the group's one KV-event stream.

Each rank caches its own requests' KV (attention is data-parallel) and publishes its own events. Rank 0 subscribes
to every rank's stream (its own included) and keeps `RankHoldings`: block hash -> the ranks holding it, per tier. Two
uses:

- the front sends a request to the rank holding the longest prefix of its prompt (`EPFront.pick`), so a conversation's
  next turn meets its own KV, as a data-parallel router does;
- the router sees one worker, so rank 0 republishes ranks 1..N-1's events on its own stream as the group's union,
  with vLLM's `data_parallel_rank` set to the rank: a block is announced when the first rank stores it and removed
  when the last one drops it. (Rank 0's own events go out directly and unfiltered: a removal there may hide a copy
  another rank still holds, an under-estimate the router recovers from, never a wrong hit.)
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.events.subscriber import ReceivedBatch, ZmqEventSubscriber
from kvstore.events.publisher import worker_topic
from kvstore.events.types import KVEventBatch

log = logging.getLogger(__name__)

RANK_TIERS = ("device", "host", "disk")  # a rank's own tiers (redis and s3 are shared by every rank)
# vLLM's and Strata's names of a tier (`medium`; None is vLLM's device tier) -> the one name kept here
_TIER_OF = {"gpu": "device", "cuda": "device", "g1": "device", "cpu": "host", "g2": "host", "g3": "disk"}


def tier_of(medium: str | None) -> str:
    name = (medium or "device").lower()
    return _TIER_OF.get(name, name)
_CATCH_UP_S = 1.0                         # how often the relay asks each rank's replay socket for a quiet tail


class RankHoldings:
    """Bookkeeping only (hashes and ints). Not thread-safe: callers hold `lock`."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self._held: dict[tuple[str, bytes], set[int]] = {}     # (medium, hash) -> ranks
        self._by_rank: list[set[tuple[str, bytes]]] = [set() for _ in range(world_size)]

    def stored(self, rank: int, medium: str, hashes: Sequence[bytes]) -> list[bytes]:
        """Record; returns the hashes no rank held in `medium` before."""
        first = []
        for h in hashes:
            ranks = self._held.setdefault((medium, h), set())
            if not ranks:
                first.append(h)
            ranks.add(rank)
            self._by_rank[rank].add((medium, h))
        return first

    def removed(self, rank: int, medium: str, hashes: Sequence[bytes]) -> list[bytes]:
        """Record; returns the hashes no rank holds in `medium` any more."""
        gone = []
        for h in hashes:
            ranks = self._held.get((medium, h))
            if ranks is None or rank not in ranks:
                continue
            ranks.discard(rank)
            self._by_rank[rank].discard((medium, h))
            if not ranks:
                del self._held[(medium, h)]
                gone.append(h)
        return gone

    def cleared(self, rank: int, medium: str | None) -> dict[str, list[bytes]]:
        """Every block of `rank` (in `medium`, or every tier) dropped; per tier, the hashes no rank holds now."""
        mine = [key for key in self._by_rank[rank] if medium is None or key[0] == tier_of(medium)]
        gone: dict[str, list[bytes]] = {}
        for tier, h in mine:
            gone.setdefault(tier, []).extend(self.removed(rank, tier, [h]))
        return {tier: hashes for tier, hashes in gone.items() if hashes}

    def prefix_lengths(self, hashes: Sequence[bytes]) -> list[int]:
        """Per rank, how many leading blocks of `hashes` it holds in any of its tiers."""
        lengths = []
        for held in self._by_rank:
            n = 0
            while n < len(hashes) and any((medium, hashes[n]) in held for medium in RANK_TIERS):
                n += 1
            lengths.append(n)
        return lengths

    def apply(self, rank: int, events: Sequence[KVEvent]) -> list[KVEvent]:
        """Record a rank's events; returns what the group's union stream must announce for them."""
        out: list[KVEvent] = []
        for ev in events:
            medium = tier_of(ev.medium)
            if isinstance(ev, BlockStored):
                if self.stored(rank, medium, ev.block_hashes):
                    out.append(ev)        # NOTE: the whole chain (its token ids describe every block)
            elif isinstance(ev, BlockRemoved):
                if gone := self.removed(rank, medium, ev.block_hashes):
                    out.append(BlockRemoved(gone, ev.medium))
            elif isinstance(ev, AllBlocksCleared):
                out.extend(BlockRemoved(hashes, tier) for tier, hashes in self.cleared(rank, ev.medium).items())
        return out


class EventRelay:
    """Rank 0's subscriber to every rank's KV events: keeps `holdings`, republishes ranks 1..N-1's through
    `publish` (rank 0's publisher) as the union. One daemon thread; `close` stops it."""

    def __init__(self, holdings: RankHoldings, streams: Sequence[tuple[int, str, str, str]],
                 publish: Callable[[KVEventBatch], None]) -> None:
        """`streams`: (rank, worker id, events endpoint, replay endpoint) of every rank, rank 0 included."""
        self.holdings, self._publish = holdings, publish
        self._streams = [s for s in streams if s[2]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ep-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        subs = [(rank, ZmqEventSubscriber(endpoint, replay or None, topic=worker_topic(worker_id), from_seq=0))
                for rank, worker_id, endpoint, replay in self._streams]
        last_catch_up = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() - last_catch_up > _CATCH_UP_S:
                    # NOTE: a gap shows only when a later batch arrives: ask for what a quiet stream may hold back
                    # (on start: everything published before we connected)
                    for _, sub in subs:
                        sub.catch_up()
                    last_catch_up = time.monotonic()
                for rank, sub in subs:
                    received = sub.recv(timeout_s=0.02)
                    while received is not None:
                        self._on_batch(rank, received)
                        received = sub.recv(timeout_s=0)
        except Exception:  # noqa: BLE001 - the relay is advisory: serving goes on without it
            log.exception("the expert-parallel group's KV-event relay stopped")
        finally:
            for _, sub in subs:
                sub.close()

    def _on_batch(self, rank: int, received: ReceivedBatch) -> None:
        if rank == 0 and received.batch.data_parallel_rank not in (None, 0):
            return                  # NOTE: rank 0's stream carries what we relayed for the others: not rank 0's
        with self.holdings.lock:
            union: list[KVEvent] = []
            if received.lost_before or received.publisher_restarted:
                # NOTE: a hole in what we know of that rank: forget it all (the union announces the loss)
                union += [BlockRemoved(hashes, tier) for tier, hashes in self.holdings.cleared(rank, None).items()]
            union += self.holdings.apply(rank, received.batch.events)
        if rank != 0 and union:
            try:
                self._publish(KVEventBatch(received.batch.ts, union, data_parallel_rank=rank))
            except Exception:  # noqa: BLE001 - the relay must outlive one bad batch
                log.exception("republishing rank %d's KV events failed", rank)
