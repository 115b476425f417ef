"""Feeds the router's prefix index from every worker's KV-event stream (DESIGN §6).

One thread per worker owns a `ZmqEventSubscriber` (ZeroMQ sockets belong to one thread); batches go into the shared
index under its lock. The subscriber replays gaps from the worker's replay socket; a gap its buffer no longer covers
it fills with the worker's snapshot (`kvstore.events.snapshot`: what the worker holds as of a sequence number),
which replaces the worker's entries. Whatever it cannot recover (`lost_before`: no snapshot served, as from a vLLM
worker; a restarted publisher) makes the feed drop that worker's entries and start over from the batch in hand,
because a hole in the event history could hide a removal, and a stale hint is worse than none:

    snapshot(next_seq) ────────────────────────────────> index.load_snapshot(worker, blocks, next_seq)
    batch(seq) ──lost_before > 0 or publisher restarted──> index.load_snapshot(worker, [], next_seq=seq) ──┐
        │                                                                                                │
        └──────────────────────────────────────────────────────────> index.apply(worker, batch, seq) <───┘

Because the events follow vLLM's format, the same feed follows a vLLM worker's stream (`kv_events_endpoint`). A
subscription may re-key the hashes it receives (`subscribe(record, key=...)`): a vLLM worker's are folded to the
64-bit ints the router computes for it (`router.vllm_hashing.event_key`), whichever form the worker publishes. What
the feed does not understand (event types, fields, media of a later release) is skipped and counted in `FeedStats`;
a batch that still fails to apply drops that worker's entries (a resync, as for a gap), never the feed.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.events import BlockRemoved, BlockStored, KVEventBatch, ReceivedBatch, Snapshot, ZmqEventSubscriber
from router.index import ApplyResult, BlockKey, MatchResult, PrefixIndex, WorkerId
from router.registry import WorkerRecord

log = logging.getLogger(__name__)

_RECV_S = 0.2
_IDLE_CATCH_UP_S = 10.0

KeyFn = Callable[[BlockKey], BlockKey]  # a worker's published hash -> its key in the index


def rekeyed(item: ReceivedBatch, key: KeyFn) -> ReceivedBatch:
    """`item` with every block hash (stored, removed, parent, snapshot) passed through `key`."""
    def event(e):
        if isinstance(e, BlockStored):
            parent = None if e.parent_block_hash is None else key(e.parent_block_hash)
            return dataclasses.replace(e, block_hashes=[key(h) for h in e.block_hashes], parent_block_hash=parent)
        if isinstance(e, BlockRemoved):
            return dataclasses.replace(e, block_hashes=[key(h) for h in e.block_hashes])
        return e
    batch = KVEventBatch(item.batch.ts, [event(e) for e in item.batch.events], item.batch.data_parallel_rank)
    snapshot = item.snapshot
    if snapshot is not None:
        snapshot = Snapshot(snapshot.next_seq, tuple((m, tuple(key(h) for h in hs)) for m, hs in snapshot.tiers))
    return item._replace(batch=batch, snapshot=snapshot)


class SharedIndex:
    """`PrefixIndex` behind a lock: the feed threads write, request threads match."""

    def __init__(self, index: PrefixIndex | None = None) -> None:
        self._index = index or PrefixIndex()
        self._lock = threading.Lock()

    def match(self, hashes: Sequence[BlockKey]) -> MatchResult:
        with self._lock:
            return self._index.match(hashes)

    def resync(self, worker_id: WorkerId, next_seq: int) -> None:
        """Drop the worker's entries and expect `next_seq` next."""
        with self._lock:
            self._index.load_snapshot(worker_id, (), next_seq)

    def apply_received(self, worker_id: WorkerId, item: ReceivedBatch,
                       stopped: threading.Event | None = None) -> tuple[ApplyResult, bool] | None:
        """Apply one delivered batch, resyncing first when history was lost; (result, resynced). None when
        `stopped` is set: checked under the lock, so nothing lands after an unsubscribe's `remove_worker`."""
        with self._lock:
            if stopped is not None and stopped.is_set():
                return None
            if item.snapshot is not None:
                self._index.load_snapshot(worker_id, item.snapshot.blocks(), item.snapshot.next_seq)
                return ApplyResult("applied", worker_id, item.seq, item.seq), True
            resynced = bool(item.lost_before or item.publisher_restarted)
            if resynced:
                self._index.load_snapshot(worker_id, (), item.seq)
            result = self._index.apply(worker_id, item.batch, item.seq)
            if result.needs_resync:
                self._index.load_snapshot(worker_id, (), item.seq)
                result, resynced = self._index.apply(worker_id, item.batch, item.seq), True
            return result, resynced

    def remove_worker(self, worker_id: WorkerId) -> None:
        with self._lock:
            self._index.remove_worker(worker_id)

    def num_blocks(self, worker_id: WorkerId | None = None) -> int:
        with self._lock:
            return self._index.num_blocks(worker_id)

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()


@dataclass
class FeedStats:
    batches: int = 0
    events: int = 0
    resyncs: int = 0
    snapshots: int = 0  # resyncs that loaded the worker's snapshot (the others started from nothing)
    duplicates: int = 0
    last_seq: int = -1
    connected: bool = False
    unknown_media: int = 0    # events skipped: a medium the index does not know
    unknown_events: int = 0   # events skipped: a type the decoder does not know
    unknown_fields: int = 0   # fields ignored: names the decoder does not know
    apply_errors: int = 0     # batches that failed to apply (each a resync)


class _Subscription:
    def __init__(self, record: WorkerRecord, index: SharedIndex, replay_timeout_s: float,
                 key: KeyFn | None = None) -> None:
        self.record, self.index, self.replay_timeout_s, self.key = record, index, replay_timeout_s, key
        self.stats = FeedStats()
        self._stop = threading.Event()
        self._catch_up = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{record.id}", daemon=True)
        self._thread.start()

    def request_catch_up(self) -> None:
        self._catch_up.set()

    def stop(self, wait: bool = False) -> None:
        """The thread closes its socket itself; `wait` only at shutdown (a request thread that reports a dead
        worker must not wait out a replay timeout)."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=2 * _RECV_S + self.replay_timeout_s)

    def _run(self) -> None:
        r = self.record
        try:
            sub = ZmqEventSubscriber(r.kv_events_endpoint, r.kv_replay_endpoint or None, topic="", from_seq=0,
                                     replay_timeout_s=self.replay_timeout_s, snapshots=True)
        except Exception:  # a bad endpoint must not take the router down: no hints from this worker
            log.exception("cannot subscribe to %s's KV events at %s", r.id, r.kv_events_endpoint)
            return
        self.stats.connected = True
        last_activity = time.monotonic()
        self._catch_up.set()  # NOTE: a quiet publisher sends nothing live; ask for its buffered history once
        try:
            while not self._stop.is_set():
                if self._catch_up.is_set():
                    self._catch_up.clear()
                    sub.catch_up()
                item = sub.recv(timeout_s=_RECV_S)
                self._count_unknown(sub)
                if item is not None:
                    self._apply_or_resync(item)
                    last_activity = time.monotonic()
                elif time.monotonic() - last_activity > _IDLE_CATCH_UP_S:
                    self._catch_up.set()  # batches lost at the tail of a burst stay unseen while it is quiet
                    last_activity = time.monotonic()
        except Exception:
            log.exception("KV event feed of %s failed; its index entries are dropped", r.id)
            self.index.remove_worker(r.id)
        finally:
            sub.close()
            self.stats.connected = False

    def _count_unknown(self, sub: ZmqEventSubscriber) -> None:
        stats = sub.decode_stats
        self.stats.unknown_events = sum(stats.unknown_events.values())
        self.stats.unknown_fields = sum(stats.unknown_fields.values())

    def _apply_or_resync(self, item: ReceivedBatch) -> None:
        """Apply one batch; one that fails drops the worker's entries (the batch is a hole) and the feed goes on."""
        try:
            self._apply(rekeyed(item, self.key) if self.key is not None else item)
        except Exception:  # noqa: BLE001 - a publisher's odd batch must not end the feed (issue 18)
            log.exception("KV-event batch seq=%d of %s did not apply; its index entries are dropped", item.seq,
                          self.record.id)
            self.stats.apply_errors += 1
            if not self._stop.is_set():  # (after an unsubscribe the worker is gone from the index: leave it so)
                self.stats.resyncs += 1
                self.index.resync(self.record.id, item.seq + 1)

    def _apply(self, item: ReceivedBatch) -> None:
        applied = self.index.apply_received(self.record.id, item, self._stop)
        if applied is None:
            return
        result, resynced = applied
        self.stats.resyncs += int(resynced)
        self.stats.snapshots += int(item.snapshot is not None)
        self.stats.duplicates += int(result.status == "duplicate")
        self.stats.unknown_media += result.skipped
        if result.status == "applied":
            self.stats.batches += 1
            self.stats.events += result.num_events
            self.stats.last_seq = item.seq


class EventsFeed:
    """Subscriptions follow the registry: `subscribe` on a worker's (re)registration, `unsubscribe` when it goes."""

    def __init__(self, index: SharedIndex, replay_timeout_s: float = 2.0) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self._subs: dict[WorkerId, _Subscription] = {}
        self._lock = threading.Lock()

    def subscribe(self, record: WorkerRecord, key: KeyFn | None = None) -> None:
        """Follow the worker's events; `key` re-keys its hashes (a vLLM worker's: `vllm_hashing.event_key`)."""
        if not record.kv_events_endpoint:
            return  # the worker publishes no events: the policy sees no cached prefix there (safe: a recompute)
        self.unsubscribe(record.id)
        with self._lock:
            self._subs[record.id] = _Subscription(record, self.index, self.replay_timeout_s, key)

    def unsubscribe(self, worker_id: WorkerId) -> None:
        with self._lock:
            sub = self._subs.pop(worker_id, None)
        if sub is not None:
            sub.stop()  # NOTE: before remove_worker: a batch in flight then finds the flag set (see apply_received)
        self.index.remove_worker(worker_id)

    def note_published_seq(self, worker_id: WorkerId, seq: int) -> None:
        """A heartbeat said the worker published up to `seq`: catch up if the feed lags behind."""
        with self._lock:
            sub = self._subs.get(worker_id)
        if sub is not None and sub.stats.last_seq < seq:
            sub.request_catch_up()

    def stats(self) -> dict[WorkerId, FeedStats]:
        with self._lock:
            return {wid: sub.stats for wid, sub in self._subs.items()}

    def close(self) -> None:
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.stop(wait=True)
