"""The prefill worker's hand-off region: fixed slots of codec-encoded blocks in one registered transfer region.

Each slot holds one block object (header + tokens + payload, DESIGN §4) keyed by its block hash, so a prefix shared
by many requests is encoded once. Slots are reference-counted by the leases that pin them; an unpinned slot keeps
its block (a later handle reuses it) until a new block needs the room, least recently used first.

    region: | slot 0 | slot 1 | slot 2 | ... |      slot i at offset i * slot_bytes, object length <= slot_bytes

Thread-safe: the engine thread pins, ReleaseKv handlers and the lease reaper unpin.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import NamedTuple, Sequence

from kvstore.transfer import Descriptor, MemoryRegion, TransferAgent

REGION_ID = "kv-handoff"


class PinnedSlot(NamedTuple):
    slot: int
    view: memoryview | None      # writable view of the slot for a freshly taken one (the caller encodes into it)


class HandoffPool:
    def __init__(self, agent: TransferAgent, slot_bytes: int, capacity_bytes: int) -> None:
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"handoff capacity {capacity_bytes} B holds no {slot_bytes}-byte slot")
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self._region = MemoryRegion.shared(REGION_ID, num_slots * slot_bytes, populate=True)
        self._agent = agent
        self.handle = agent.register(self._region)
        self._lock = threading.Lock()
        self._slot_of: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * num_slots
        self._length: list[int] = [0] * num_slots
        self._refs: list[int] = [0] * num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._lru: OrderedDict[int, None] = OrderedDict()   # unpinned slots that still hold a block

    def pin(self, block_hash: bytes) -> PinnedSlot | None:
        """Pin the slot holding `block_hash` (view None), or take a fresh slot for it (view set; the caller must
        `commit` or `unpin` it). None when every slot is pinned."""
        with self._lock:
            slot = self._slot_of.get(block_hash)
            if slot is not None:
                self._take(slot)
                return PinnedSlot(slot, None)
            slot = self._fresh_slot()
            if slot is None:
                return None
            self._refs[slot] = 1
        start = slot * self.slot_bytes
        return PinnedSlot(slot, self._region.buffer[start:start + self.slot_bytes])

    def commit(self, slot: int, block_hash: bytes, length: int) -> None:
        """Index a freshly written slot under its hash (a later `pin` of the hash finds it)."""
        with self._lock:
            self._length[slot] = length
            if block_hash not in self._slot_of:
                self._slot_of[block_hash] = slot
                self._hash_of[slot] = block_hash

    def unpin(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                assert self._refs[slot] > 0, f"handoff slot {slot} unpinned more often than pinned"
                self._refs[slot] -= 1
                if self._refs[slot] == 0:
                    if self._hash_of[slot] is None:
                        self._free.append(slot)
                    else:
                        self._lru[slot] = None

    def descriptor(self, slot: int) -> Descriptor:
        return self.handle.descriptor(slot * self.slot_bytes, self._length[slot])

    def range_of(self, slot: int) -> tuple[int, int]:
        return slot * self.slot_bytes, self._length[slot]

    @property
    def num_pinned(self) -> int:
        with self._lock:
            return sum(1 for r in self._refs if r)

    def _take(self, slot: int) -> None:
        if self._refs[slot] == 0:
            self._lru.pop(slot, None)
        self._refs[slot] += 1

    def _fresh_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        del self._slot_of[self._hash_of[slot]]
        self._hash_of[slot] = None
        return slot

    def check_integrity(self) -> None:
        """free + cached + pinned == total; the index and the slots agree."""
        with self._lock:
            pinned = {s for s, r in enumerate(self._refs) if r > 0}
            free, lru = set(self._free), set(self._lru)
            assert not (free & lru) and not (free & pinned) and not (lru & pinned), "a slot is in two states"
            assert len(free) + len(lru) + len(pinned) == self.num_slots, "free + cached + pinned != total"
            for block_hash, slot in self._slot_of.items():
                assert self._hash_of[slot] == block_hash, f"slot {slot} and the index disagree"

    def close(self) -> None:
        try:
            self._agent.unregister(REGION_ID)
        except Exception:  # noqa: BLE001 - the agent may already be closed
            pass
        self._region.close()
