"""Write-behind of the tiered store: every block owes a write to some lower tiers, and none is dropped silently.

    put (engine thread) --submit(key, tiers)-------------> pending: key -> Entry(tiers still owed, data or None)
    eviction (tier lock) --submit(key, tiers, data)------>            (FIFO, coalesced per key)
                                                                 |
    writer thread <-- batch of ready entries --------------------+
      bytes: entry.data, else read back from the host tier at write time (`read_back`)
      write: one batched call per target tier (`write`) -> per key: stored, or None = tier unavailable
      unavailable -> the entry waits `retry_s` (doubling) and is tried again, up to `max_attempts`
      no bytes anywhere, attempts used up, or the bound below reached -> `on_drop(tier, n)`: counted, visible

Memory is bounded: a write-through entry holds no bytes (the host tier has them); entries that must carry bytes (a
demotion out of a tier that evicts) are bounded by `max_data_entries`; keys by `max_entries`. A full bound drops
the NEW submission and counts it, so the producer (the engine thread) never blocks on a slow tier.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from itertools import islice
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger(__name__)

ReadBack = Callable[[list[bytes]], list[bytes | None]]
# write(tier, [(key, data, demotion)]) -> per item stored?, or None when the tier is unavailable (retry later)
Write = Callable[[str, list[tuple[bytes, bytes, bool]]], "list[bool] | None"]
Drop = Callable[[str, int], None]


@dataclass
class Entry:
    tiers: set[str]             # tiers this block still owes a write to
    data: bytes | None          # None: read back from the host tier when written
    demotion: bool = False      # the block left a faster tier (counted as a demotion where it lands)
    attempts: int = 0
    ready_at: float = 0.0


class WriteBehind:
    """One background thread draining a coalesced, bounded map of owed writes. Thread-safe."""

    def __init__(self, read_back: ReadBack, write: Write, on_drop: Drop, *, max_entries: int = 1 << 20,
                 max_data_entries: int = 256, max_batch: int = 128, retry_s: float = 0.5, max_attempts: int = 6,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read_back, self._write, self._on_drop = read_back, write, on_drop
        self._max_entries, self._max_data = max_entries, max_data_entries
        self._max_batch, self._retry_s, self._max_attempts, self._clock = max_batch, retry_s, max_attempts, clock
        self._pending: OrderedDict[bytes, Entry] = OrderedDict()
        self._data_entries = 0
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="strata-store-writer", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, tiers: Sequence[str], data: bytes | None = None, demotion: bool = False) -> bool:
        """Owe a write of `key` to `tiers`; False when a bound refused it (the caller counts the drop)."""
        return self.submit_many([(key, tiers, data, demotion)])[0]

    def submit_many(self, owed: Sequence[tuple[bytes, Sequence[str], bytes | None, bool]]) -> list[bool]:
        """`submit` of each (key, tiers, data, demotion), at once: the writer wakes once they are all owed, so a
        prompt's blocks go out in as few batches as `max_batch` allows (one S3 pack, not a first batch of the
        blocks owed before it woke and then the rest)."""
        with self._cond:
            accepted = [self._owe(key, tiers, data, demotion) for key, tiers, data, demotion in owed]
            self._cond.notify()
        return accepted

    def _owe(self, key: bytes, tiers: Sequence[str], data: bytes | None, demotion: bool) -> bool:
        """`submit`'s bookkeeping; the caller holds `_cond`."""
        if not tiers:
            return True
        entry = self._pending.get(key)
        if entry is not None:  # coalesce: one entry per block, whatever asked for it
            entry.tiers.update(tiers)
            if data is not None and entry.data is None and self._data_entries < self._max_data:
                entry.data, self._data_entries = data, self._data_entries + 1
            entry.demotion = entry.demotion or demotion
            return True
        if len(self._pending) >= self._max_entries or (data is not None and self._data_entries >= self._max_data):
            return False
        self._pending[key] = Entry(set(tiers), data, demotion)
        self._data_entries += data is not None
        return True

    def owes(self, key: bytes) -> bool:
        """Whether `key` still owes a write and carries no bytes (they would be read back from host)."""
        with self._cond:
            entry = self._pending.get(key)
            return entry is not None and entry.data is None

    def attach(self, key: bytes, data: bytes) -> bool:
        """Give an owed write its bytes (host is letting them go); False when the bound refused them."""
        with self._cond:
            entry = self._pending.get(key)
            if entry is None or entry.data is not None:
                return entry is not None
            if self._data_entries >= self._max_data:
                return False
            entry.data, self._data_entries = data, self._data_entries + 1
            return True

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + self._in_flight

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every owed write has been tried: none in flight and none due now (writes waiting out a
        tier's backoff for a retry stay owed, see `pending`); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight or any(e.ready_at <= self._clock() for e in self._pending.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # Writer thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._write_batch(batch)
            except Exception:  # noqa: BLE001 - the writer must outlive one bad batch; its blocks are counted dropped
                log.exception("background store write failed")
                for _, entry in batch:
                    self._drop(entry)
            finally:
                with self._cond:
                    self._in_flight -= len(batch)
                    self._cond.notify_all()

    def _next_batch(self) -> list[tuple[bytes, Entry]] | None:
        """Up to `max_batch` entries due now (oldest first); None when stopping with nothing owed."""
        with self._cond:
            while True:
                if self._stopping and not self._pending:
                    return None
                now = self._clock()
                due = list(islice((k for k, e in self._pending.items() if e.ready_at <= now), self._max_batch))
                if due:
                    batch = [(k, self._pending.pop(k)) for k in due]
                    self._in_flight += len(batch)
                    return batch
                if self._stopping:  # only retries left: give them up rather than hold shutdown
                    for entry in self._pending.values():
                        self._drop(entry)
                    self._pending.clear()
                    self._data_entries = 0
                    return None
                wait = min((e.ready_at for e in self._pending.values()), default=now + 1.0) - now
                self._cond.wait(max(0.001, min(wait, 1.0)))

    def _write_batch(self, batch: list[tuple[bytes, Entry]]) -> None:
        with self._cond:
            self._data_entries -= sum(e.data is not None for _, e in batch)
        missing = [k for k, e in batch if e.data is None]
        read = dict(zip(missing, self._read_back(missing))) if missing else {}
        by_tier: dict[str, list[tuple[bytes, bytes, bool]]] = {}
        for key, entry in batch:
            data = entry.data if entry.data is not None else read.get(key)
            if data is None:  # the host tier let it go before we got to it, and nothing else holds the bytes
                self._drop(entry)
                continue
            for tier in entry.tiers:
                by_tier.setdefault(tier, []).append((key, data, entry.demotion))
        owed: dict[bytes, set[str]] = {}
        for tier, items in by_tier.items():
            stored = self._write(tier, items)
            if stored is None:  # unavailable: owe it again
                for key, _, _ in items:
                    owed.setdefault(key, set()).add(tier)
            else:
                failed = sum(not ok for ok in stored)
                if failed:
                    self._on_drop(tier, failed)
        for key, entry in batch:
            if key in owed:
                self._retry(key, entry, owed[key])

    def _retry(self, key: bytes, entry: Entry, tiers: set[str]) -> None:
        entry.tiers, entry.attempts = tiers, entry.attempts + 1
        if entry.attempts >= self._max_attempts:
            self._drop(entry)
            return
        # NOTE: bytes it carries are kept (host no longer holds them: a demotion, a block host could not take or
        # let go of); one without bytes reads them back from host again.
        entry.ready_at = self._clock() + self._retry_s * 2 ** (entry.attempts - 1)
        with self._cond:
            current = self._pending.get(key)
            if current is not None:  # submitted again meanwhile: merge
                current.tiers.update(tiers)
                return
            self._pending[key] = entry
            self._data_entries += entry.data is not None
            self._cond.notify()

    def _drop(self, entry: Entry) -> None:
        for tier in entry.tiers:
            self._on_drop(tier, 1)
