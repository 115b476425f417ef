"""Host tier (DESIGN §5, G2): fixed slots in POSIX shared memory with an LRU, readable zero-copy by peer processes.

The owning process keeps the LRU and the free list in Python and mirrors the key → slot index into the segment
(`host_segment.py`), so a peer that attaches with `HostTierReader` finds and reads blocks without asking the owner.
"""
from __future__ import annotations

import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable, NamedTuple, Sequence

from kvstore.hashing import BlockHash
from kvstore.tiers.base import Tier, TierStats, TierUnavailable, register_tier
from kvstore.tiers.host_segment import Segment, split_key, sweep_stale

_PAGE = 4096
_AUTO_PREFIX = "strata-host-"


class HostLoan(NamedTuple):
    """Blocks of the host tier lent in place (`HostTier.borrow`): no copy, and no put, eviction or delete reuses
    their slots until `release()` (call it once)."""

    views: list[memoryview | None]  # per key: the object's bytes in shared memory, None for a miss
    slots: list[int | None]         # per key: its slot (a row of `HostTier.slot_rows()`), None for a miss
    release: Callable[[], None]


@register_tier("host")
class HostTier(Tier):
    """LRU of fixed-size slots in shared memory.

    `slot_bytes=0` sizes the slots from the first object stored (rounded up to 4 KiB). An object larger than a slot
    is not stored (`put` returns False for it). Eviction is least-recently-used over `get` and `put` hits of this
    process; reads by peers do not refresh a block.
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int = 0, shm_name: str = "", populate: bool = False) -> None:
        """`populate`: fault the segment's pages in when it is created (on a background thread, contents untouched:
        `kvstore.transfer.segment.populate`), so that storing a block does not pay a page fault per 4 KiB. It
        commits `capacity_bytes` of memory at start, as a pinned host buffer would."""
        super().__init__()
        self._populate = populate
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes, self._slot_bytes = capacity_bytes, slot_bytes
        if not shm_name:
            sweep_stale(_AUTO_PREFIX)  # segments of owners that were killed before they could unlink them
        self.shm_name = shm_name or f"{_AUTO_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recent first
        self._free: list[int] = []
        self._lent: dict[int, int] = {}   # slot -> loans holding it (`borrow`)
        self._lent_gone: set[int] = set()  # lent slots whose key was deleted: freed when the last loan ends
        self._tombstones = 0
        self._segment: Segment | None = None
        if slot_bytes:
            self._create(slot_bytes)

    def _create(self, slot_bytes: int) -> None:
        num_slots = self.capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"capacity_bytes {self.capacity_bytes} is smaller than one {slot_bytes}-byte slot")
        try:
            self._segment = Segment.create(self.shm_name, slot_bytes, num_slots)
        except OSError as exc:  # /dev/shm full or too small
            raise self._failed(f"create of {num_slots} x {slot_bytes} B shared memory", exc) from exc
        if self._populate:
            self._segment.populate_async()
        # Unlinks the segment when the tier is collected or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, self._segment.close)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_bytes = slot_bytes

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        return self._segment.shape.num_slots if self._segment else 0

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return [bytes(k) in self._lru for k in keys]

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        started, out, hits, nbytes = time.perf_counter(), [], 0, 0
        with self._lock:
            for key, buf in zip(keys, bufs, strict=True):
                slot = self._lru.get(bytes(key))
                if slot is None:
                    out.append(None)
                    continue
                n = self._segment.length(slot)
                if n > len(buf):
                    raise ValueError(f"buffer holds {len(buf)} bytes, block {bytes(key).hex()} needs {n}")
                buf[:n] = self._segment.slot_data(slot, n)  # the one copy
                self._lru.move_to_end(bytes(key))
                out.append(n)
                hits, nbytes = hits + 1, nbytes + n
        self._observe("get", started, hits=hits, misses=len(out) - hits, bytes_read=nbytes)
        return out

    def borrow(self, keys: Sequence[BlockHash]) -> HostLoan:
        """The blocks held, in place (a hit, as `get` counts it, without its copy): each slot stays as it is, kept
        from eviction and reuse, until the loan's `release()`. For an owner that reads a prefix and installs it
        right away (a peer process reads with `HostTierReader.view`)."""
        started, views, slots, nbytes = time.perf_counter(), [], [], 0
        with self._lock:
            for key in keys:
                slot = self._lru.get(bytes(key))
                if slot is not None:
                    n = self._segment.length(slot)
                    self._lent[slot] = self._lent.get(slot, 0) + 1
                    self._lru.move_to_end(bytes(key))
                    views.append(self._segment.slot_data(slot, n))
                    nbytes += n
                else:
                    views.append(None)
                slots.append(slot)
        hits = sum(slot is not None for slot in slots)
        self._observe("get", started, hits=hits, misses=len(slots) - hits, bytes_read=nbytes)
        lent, released = [slot for slot in slots if slot is not None], []

        def release() -> None:
            if released:
                return
            released.append(True)
            with self._lock:
                for slot in lent:
                    left = self._lent.pop(slot) - 1
                    if left:
                        self._lent[slot] = left
                    elif slot in self._lent_gone:
                        self._lent_gone.discard(slot)
                        self._free.append(slot)
        return HostLoan(views, slots, release)

    def slot_rows(self) -> tuple[memoryview, int] | None:
        """The slots' bytes as one buffer and the bytes of a slot (slot i is `[i * slot_bytes, (i + 1) * slot_bytes)`;
        an object starts at its slot's start), or None before the first put sized them. The buffer stays valid while
        this tier is open."""
        with self._lock:
            if self._segment is None:
                return None
            shape = self._segment.shape
            return self._segment.buf[shape.data_off:shape.data_off + shape.num_slots * shape.slot_bytes], \
                shape.slot_bytes

    def peek(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """Copies of the objects, or None for a miss; not a cache hit (no counters, no LRU refresh). The store's
        write-behind reads blocks back with it to write them to the lower tiers."""
        with self._lock:
            out = []
            for key in keys:
                slot = self._lru.get(bytes(key))
                out.append(None if slot is None else bytes(self._segment.slot_data(slot, self._segment.length(slot))))
            return out

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        started, out, nbytes = time.perf_counter(), [], 0
        with self._lock:
            for key, data in items:
                data = memoryview(data).cast("B")
                stored = self._put_one(bytes(key), data)
                nbytes += len(data) if stored == "new" else 0
                out.append(stored is not None)
        self._observe("put", started, bytes_written=nbytes)
        return out

    def _put_one(self, key: bytes, data: memoryview) -> str | None:
        """'new', 'present', or None when the object does not fit a slot (or every slot is lent out)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return "present"
        if self._segment is None:
            self._create(-(-len(data) // _PAGE) * _PAGE)
        if len(data) > self._slot_bytes:
            return None
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is None:
            return None  # every slot is lent out: no room until a loan ends
        k0, k1 = split_key(key)
        self._segment.write_slot(slot, k0, k1, data)
        self._segment.table_insert(k0, slot)
        self._lru[key] = slot
        return "new"

    def _evict_lru(self) -> int | None:
        """The least recently used slot no loan holds, its block evicted; None when every used slot is lent."""
        victim = next(((k, s) for k, s in self._lru.items() if s not in self._lent), None)
        if victim is None:
            return None
        key, slot = victim
        del self._lru[key]
        data = self._segment.slot_data(slot, self._segment.length(slot)) if self.eviction_wants_data else None
        try:
            self._evicted(BlockHash(key), data)  # the listener copies what it keeps: the slot is reused next
        finally:
            if data is not None:
                data.release()
            self._unindex(key, slot)
        return slot

    def _unindex(self, key: bytes, slot: int) -> None:
        k0, _ = split_key(key)
        self._segment.table_remove(k0, slot)
        self._segment.clear_slot(slot)
        self._tombstones += 1
        if self._tombstones > self._segment.shape.table_size // 4:
            self._segment.table_rebuild([(split_key(k)[0], s) for k, s in self._lru.items()])
            self._tombstones = 0

    def delete(self, keys: Sequence[BlockHash]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                slot = self._lru.pop(bytes(key), None)
                if slot is not None:
                    self._unindex(bytes(key), slot)
                    self._free_slot(slot)
                    removed += 1
        return removed

    def clear(self) -> None:
        with self._lock:
            for slot in self._lru.values():
                self._segment.clear_slot(slot)
                self._free_slot(slot)
            self._lru.clear()
            self._free.sort(reverse=True)  # handed out in ascending order: blocks stored in order lie in order
            if self._segment is not None:
                self._segment.table_rebuild([])
            self._tombstones = 0

    def _free_slot(self, slot: int) -> None:
        """Lock held. A slot whose key is gone: free now, or when its last loan ends (its bytes stay until then)."""
        if slot in self._lent:
            self._lent_gone.add(slot)
        else:
            self._free.append(slot)

    def keys_lru_order(self) -> list[BlockHash]:
        """Keys from least to most recently used (for tests and admin tools)."""
        with self._lock:
            return [BlockHash(k) for k in self._lru]

    def check_integrity(self) -> None:
        """free + used == total, every used slot indexed under its key, no slot used twice."""
        with self._lock:
            if self._segment is None:
                return
            used = list(self._lru.values())
            assert len(set(used)) == len(used), "a slot is used twice"
            assert not set(used) & set(self._free), "a slot is both used and free"
            assert not self._lent_gone & set(self._free) and not self._lent_gone & set(used), \
                "a lent slot whose key is gone is free or used"
            assert len(used) + len(self._free) + len(self._lent_gone) == self.num_slots, "free + used != total"
            for key, slot in self._lru.items():
                assert self._segment.find(*split_key(key)) == slot, f"slot {slot} not indexed under its key"

    def stats(self) -> TierStats:
        stats = super().stats()
        with self._lock:
            stats.capacity_bytes = self.capacity_bytes
            stats.blocks = len(self._lru)
            stats.used_bytes = len(self._lru) * self._slot_bytes
        return stats

    def close(self) -> None:
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()  # runs Segment.close once
            self._segment = None
            self._lru.clear()


class HostTierReader:
    """A peer process's read-only view of another process's host tier, attached by its `shm_name`.

    `get` copies into caller buffers (one memcpy); `view` returns the bytes in shared memory without a copy, with a
    check that they were not rewritten while the caller used them.
    """

    def __init__(self, shm_name: str) -> None:
        try:
            self._segment = Segment.attach(shm_name)
        except FileNotFoundError as exc:
            raise TierUnavailable(f"no host tier segment named {shm_name!r}") from exc

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [self._segment.find(*split_key(bytes(k))) is not None for k in keys]

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        out: list[int | None] = []
        for key, buf in zip(keys, bufs, strict=True):
            k0, k1 = split_key(bytes(key))
            slot = self._segment.find(k0, k1)
            out.append(None if slot is None else self._segment.read_into(slot, k0, k1, buf))
        return out

    def view(self, key: BlockHash) -> "SlotView | None":
        """Zero-copy view of a block; call `SlotView.valid()` after using the bytes and discard them if False."""
        k0, k1 = split_key(bytes(key))
        slot = self._segment.find(k0, k1)
        if slot is None:
            return None
        seq = self._segment.seq(slot)
        if seq & 1 or not self._segment.slot_key_matches(slot, k0, k1):
            return None
        return SlotView(self._segment, slot, seq, self._segment.slot_data(slot, self._segment.length(slot)))

    def close(self) -> None:
        self._segment.close()


class SlotView:
    """Bytes of one slot in shared memory, valid while the owner has not rewritten the slot."""

    def __init__(self, segment: Segment, slot: int, seq: int, data: memoryview) -> None:
        self._segment, self._slot, self._seq, self.data = segment, slot, seq, data

    def valid(self) -> bool:
        return self._segment.seq(self._slot) == self._seq

    def release(self) -> None:
        self.data.release()
