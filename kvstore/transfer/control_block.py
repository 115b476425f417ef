"""The shm owner's control block: a region directory and a lease table in one shared-memory segment.

Readers map it and check regions and leases themselves, so a one-sided read needs nothing from the owner process,
yet cannot pass an expired lease: the owner writes, readers only read. Every entry is guarded by a sequence word
(a seqlock: odd while the owner writes it), and readers re-check a lease's sequence after copying, so a lease
released or expired during a copy fails the read instead of returning bytes the owner may have reused.

Layout, in little-endian int64 words:

    [0 .. 8)                      header: magic, version, pid, state, max_regions, max_leases, max_ranges, 0
    [8 .. 8 + R*RW)               regions: seq, generation, length, id_len, name_len, id[64 B], shm name[32 B]
    [.. + L*LW)                   leases:  seq, lease_id, region_generation, expires_ns, n_ranges, 0, 0, 0
    [.. + L*M*2)                  ranges:  per lease slot, M merged (start, end) pairs
"""
from __future__ import annotations

import os
import threading
from typing import NamedTuple

from kvstore.transfer.base import MAX_REGION_ID_BYTES, LeaseId
from kvstore.transfer.segment import SharedSegment

MAGIC = 0x53545241544B5631  # "STRATKV1"
VERSION = 1
STATE_OPEN, STATE_CLOSED = 1, 2
HEADER_WORDS = 8
REGION_WORDS = 5 + MAX_REGION_ID_BYTES // 8 + 4
LEASE_WORDS = 8
NAME_BYTES = 32


class RegionEntry(NamedTuple):
    slot: int
    generation: int
    length: int
    shm_name: str


class LeaseEntry(NamedTuple):
    seq: int
    region_generation: int
    expires_ns: int
    starts: list[int]
    ends: list[int]


class ControlBlock:
    """One agent's directory and lease table. `create` (owner) or `attach` (reader)."""

    def __init__(self, seg: SharedSegment) -> None:
        self.seg = seg
        self.words = seg.buf.cast("q")
        self.max_regions, self.max_leases, self.max_ranges = (int(w) for w in self.words[4:7])
        self._region_base = HEADER_WORDS
        self._lease_base = self._region_base + self.max_regions * REGION_WORDS
        self._range_base = self._lease_base + self.max_leases * LEASE_WORDS
        self._lock = threading.Lock()
        self._next_generation = 1
        self._free_lease_slots: list[int] = []

    # ---- owner side -------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, max_regions: int, max_leases: int, max_ranges: int) -> ControlBlock:
        words = HEADER_WORDS + max_regions * REGION_WORDS + max_leases * (LEASE_WORDS + 2 * max_ranges)
        seg = SharedSegment.create(words * 8)  # NOTE: tmpfs is sparse: untouched lease slots cost no memory
        header = seg.buf.cast("q")
        header[1], header[2] = VERSION, os.getpid()
        header[4], header[5], header[6] = max_regions, max_leases, max_ranges
        header[3] = STATE_OPEN
        header[0] = MAGIC  # last: a reader that sees the magic sees a complete header
        header.release()
        block = cls(seg)
        block._free_lease_slots = list(range(max_leases - 1, -1, -1))
        return block

    def add_region(self, region_id: str, shm_name: str, length: int) -> int:
        """Publish a region; returns its generation (unique per registration in this agent)."""
        rid, name = region_id.encode(), shm_name.encode()
        assert len(name) <= NAME_BYTES, shm_name
        with self._lock:
            slot = next((s for s in range(self.max_regions) if self.words[self._region(s) + 1] == 0), None)
            if slot is None:
                raise ValueError(f"at most max_regions={self.max_regions} regions per agent")
            generation, self._next_generation = self._next_generation, self._next_generation + 1
            base = self._region(slot)
            self._begin(base)
            self.words[base + 2], self.words[base + 3], self.words[base + 4] = length, len(rid), len(name)
            self._put_bytes(base + 5, rid)
            self._put_bytes(base + 5 + MAX_REGION_ID_BYTES // 8, name)
            self.words[base + 1] = generation
            self._end(base)
        return generation

    def remove_region(self, generation: int) -> None:
        with self._lock:
            for slot in range(self.max_regions):
                base = self._region(slot)
                if self.words[base + 1] == generation:
                    self._begin(base)
                    self.words[base + 1] = 0
                    self._end(base)
            for slot in range(self.max_leases):
                base = self._lease(slot)
                if self.words[base + 1] != 0 and self.words[base + 2] == generation:
                    self._clear_lease(slot)

    def grant(self, region_generation: int, starts: list[int], ends: list[int], expires_ns: int, now: int) -> LeaseId:
        if len(starts) > self.max_ranges:
            raise ValueError(f"a lease covers at most max_ranges_per_lease={self.max_ranges} merged ranges, "
                             f"got {len(starts)}")
        with self._lock:
            slot = self._take_slot(now)
            base, ranges = self._lease(slot), self._range_base + slot * self.max_ranges * 2
            lease_id = self._next_generation * self.max_leases + slot
            self._next_generation += 1
            self._begin(base)
            for i, (start, end) in enumerate(zip(starts, ends)):
                self.words[ranges + 2 * i], self.words[ranges + 2 * i + 1] = start, end
            self.words[base + 2], self.words[base + 3] = region_generation, expires_ns
            self.words[base + 4] = len(starts)
            self.words[base + 1] = lease_id
            self._end(base)
        return LeaseId(lease_id)

    def release(self, lease_id: int, now: int) -> bool:
        slot = lease_id % self.max_leases
        with self._lock:
            base = self._lease(slot)
            if self.words[base + 1] != lease_id:
                return False
            live = self.words[base + 3] > now
            self._clear_lease(slot)
        return live

    def close(self) -> None:
        """Owner: mark closed (readers now fail with PeerUnavailable) and unlink."""
        self.words[3] = STATE_CLOSED
        self.detach(unlink=True)

    def detach(self, unlink: bool = False) -> None:
        self.words.release()
        self.seg.close(unlink=unlink)

    def _take_slot(self, now: int) -> int:
        if not self._free_lease_slots:  # reclaim slots whose leases ran out
            for slot in range(self.max_leases):
                base = self._lease(slot)
                if self.words[base + 1] != 0 and self.words[base + 3] <= now:
                    self._clear_lease(slot)
        if not self._free_lease_slots:
            raise ValueError(f"all max_leases={self.max_leases} lease slots are live; release some or raise it")
        return self._free_lease_slots.pop()

    def _clear_lease(self, slot: int) -> None:
        base = self._lease(slot)
        self._begin(base)
        self.words[base + 1] = 0
        self._end(base)
        self._free_lease_slots.append(slot)

    def _begin(self, base: int) -> None:
        self.words[base] += 1  # odd: being written

    def _end(self, base: int) -> None:
        self.words[base] += 1  # even: stable

    def _put_bytes(self, word: int, data: bytes) -> None:
        self.seg.buf[word * 8:word * 8 + len(data)] = data

    # ---- reader side ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, shm_name: str) -> ControlBlock:
        """Map a peer's block; FileNotFoundError if it is gone, ValueError if it is not a control block."""
        seg = SharedSegment.attach(shm_name)
        if seg.size < HEADER_WORDS * 8 or seg.buf.cast("q")[0] != MAGIC:
            seg.close()
            raise ValueError(f"{shm_name} is not a Strata transfer control block")
        return cls(seg)

    @property
    def pid(self) -> int:
        return int(self.words[2])

    @property
    def is_open(self) -> bool:
        return self.words[3] == STATE_OPEN

    def find_region(self, region_id: str) -> RegionEntry | None:
        rid = region_id.encode()
        for slot in range(self.max_regions):
            base = self._region(slot)
            while True:
                seq = self.words[base]
                if seq & 1:
                    continue
                generation, length, id_len, name_len = (int(w) for w in self.words[base + 1:base + 5])
                found = generation != 0 and id_len == len(rid) and self._get_bytes(base + 5, id_len) == rid
                name = self._get_bytes(base + 5 + MAX_REGION_ID_BYTES // 8, name_len).decode() if found else ""
                if self.words[base] == seq:
                    break
            if found:
                return RegionEntry(slot, generation, length, name)
        return None

    def generation_word(self, slot: int) -> int:
        """Index into `words` of a region slot's generation (readers compare it to spot unregistration)."""
        return self._region(slot) + 1

    def lease_seq(self, lease_id: int) -> int:
        """The sequence word of the lease's slot (a change means released, renewed or reused)."""
        return self.words[self._lease(lease_id % self.max_leases)]

    def read_lease(self, lease_id: int) -> LeaseEntry | None:
        """A consistent snapshot of a lease, or None when its slot no longer holds it."""
        slot = lease_id % self.max_leases
        base, ranges = self._lease(slot), self._range_base + slot * self.max_ranges * 2
        while True:
            seq = self.words[base]
            if seq & 1:
                continue
            current, generation, expires_ns, n = (int(w) for w in self.words[base + 1:base + 5])
            pairs = self.words[ranges:ranges + 2 * min(n, self.max_ranges)].tolist() if current == lease_id else []
            if self.words[base] == seq:
                break
        if current != lease_id:
            return None
        return LeaseEntry(seq, generation, expires_ns, pairs[0::2], pairs[1::2])

    def _get_bytes(self, word: int, n: int) -> bytes:
        return bytes(self.seg.buf[word * 8:word * 8 + n])

    def _region(self, slot: int) -> int:
        return self._region_base + slot * REGION_WORDS

    def _lease(self, slot: int) -> int:
        return self._lease_base + slot * LEASE_WORDS
