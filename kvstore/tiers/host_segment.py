"""The shared-memory segment behind the host tier: fixed slots plus an shm-resident index that peers read.

    0          64                      table_off                 data_off (4 KiB aligned)
    | header   | slot meta [num_slots] | hash table [table_size] | slot data [num_slots x slot_bytes] |
      header: magic, version, slot_bytes, num_slots, table_size
      slot meta: seq, length, key (2 x u64)  (seq is a seqlock: odd while the slot is being rewritten)
      table: int32 per bucket, EMPTY, TOMBSTONE or a slot index (open addressing, linear probing)

One process owns and writes the segment; any process on the host may attach and read. The table is only a hint: a
reader trusts a slot after checking its key and that `seq` was even and unchanged across the copy, so a concurrent
rewrite gives a miss, never another block's bytes.
NOTE: this relies on stores and loads not being reordered across the seq updates, which holds on x86-64 (TSO). On
weakly ordered CPUs a reader may more often see a torn slot as a miss only if the key check also fails; the payload
checksum of the codec is the final guard there.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import NamedTuple

from kvstore.transfer.segment import populate_in_background

_SHM_DIR = "/dev/shm"
_MAGIC = 0x3174736F48727453  # b"StrHost1" little-endian
_VERSION = 1
_HEADER_WORDS = 8
_META_WORDS = 4  # seq, length, k0, k1
EMPTY, TOMBSTONE = -1, -2
_KEY = struct.Struct("<QQ")


class SegmentShape(NamedTuple):
    slot_bytes: int
    num_slots: int
    table_size: int
    meta_off: int
    table_off: int
    data_off: int
    total: int


def segment_shape(slot_bytes: int, num_slots: int) -> SegmentShape:
    table_size = 1 << max(2, (2 * num_slots - 1).bit_length())  # load factor <= 1/2
    meta_off = _HEADER_WORDS * 8
    table_off = meta_off + num_slots * _META_WORDS * 8
    data_off = -(-(table_off + table_size * 4) // 4096) * 4096
    return SegmentShape(slot_bytes, num_slots, table_size, meta_off, table_off, data_off,
                        data_off + num_slots * slot_bytes)


def sweep_stale(prefix: str) -> int:
    """Unlink segments named `<prefix><pid>-...` whose owner pid is gone (a killed owner cannot clean up)."""
    removed = 0
    for name in os.listdir(_SHM_DIR):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def split_key(key: bytes) -> tuple[int, int]:
    return _KEY.unpack(key)


class Segment:
    """A mapped segment with typed views over its regions. `create` makes one; `attach` opens an existing one."""

    def __init__(self, name: str, mapping: mmap.mmap, shape: SegmentShape, owner: bool) -> None:
        self.name, self.shape, self.owner = name, shape, owner
        self._mmap = mapping
        self.buf = memoryview(mapping)
        self.meta = self.buf[shape.meta_off:shape.table_off].cast("Q")
        self.table = self.buf[shape.table_off:shape.table_off + shape.table_size * 4].cast("i")
        self.mask = shape.table_size - 1

    def populate_async(self) -> threading.Thread:
        """Fault the slots' pages in on a background thread (`kvstore.transfer.segment.populate`)."""
        return populate_in_background(self._mmap, self.name)

    @classmethod
    def create(cls, name: str, slot_bytes: int, num_slots: int) -> "Segment":
        shape = segment_shape(slot_bytes, num_slots)
        path = os.path.join(_SHM_DIR, name)
        if os.path.exists(path):  # a stale segment of a crashed owner with the same configured name
            os.unlink(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, shape.total)
            mapping = mmap.mmap(fd, shape.total)
        finally:
            os.close(fd)
        header = memoryview(mapping)[:_HEADER_WORDS * 8].cast("Q")
        header[1:5] = memoryview(struct.pack("<4Q", _VERSION, slot_bytes, num_slots, shape.table_size)).cast("Q")
        header[0] = _MAGIC  # last: an attacher that sees the magic sees a complete header
        header.release()
        segment = cls(name, mapping, shape, owner=True)
        segment.table[:] = memoryview(struct.pack(f"<{shape.table_size}i", *[EMPTY] * shape.table_size)).cast("i")
        return segment

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment read-only. Raises FileNotFoundError if no owner created it."""
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, slot_bytes, num_slots, _ = struct.unpack_from("<5Q", mapping, 0)
        if magic != _MAGIC or version != _VERSION:
            mapping.close()
            raise ValueError(f"shared memory {name!r} is not a Strata host tier (v{_VERSION}) segment")
        return cls(name, mapping, segment_shape(slot_bytes, num_slots), owner=False)

    # Slot access ------------------------------------------------------------------------------------------------

    def slot_data(self, slot: int, length: int) -> memoryview:
        off = self.shape.data_off + slot * self.shape.slot_bytes
        return self.buf[off:off + length]

    def slot_key_matches(self, slot: int, k0: int, k1: int) -> bool:
        base = slot * _META_WORDS
        return self.meta[base + 2] == k0 and self.meta[base + 3] == k1

    def seq(self, slot: int) -> int:
        return self.meta[slot * _META_WORDS]

    def length(self, slot: int) -> int:
        return self.meta[slot * _META_WORDS + 1]

    def find(self, k0: int, k1: int) -> int | None:
        """The slot whose key is (k0, k1) according to the table, or None. Readers must still validate it."""
        table, bucket = self.table, k0 & self.mask
        for _ in range(self.shape.table_size):
            entry = table[bucket]
            if entry == EMPTY:
                return None
            if entry >= 0 and self.slot_key_matches(entry, k0, k1):
                return entry
            bucket = (bucket + 1) & self.mask
        return None

    def read_into(self, slot: int, k0: int, k1: int, out: memoryview) -> int | None:
        """Seqlocked copy of a slot into `out`: its length, or None if the slot changed or holds another key."""
        for _ in range(3):
            seq = self.seq(slot)
            if seq & 1:
                continue
            if not self.slot_key_matches(slot, k0, k1):
                return None
            n = self.length(slot)
            if n > len(out):
                raise ValueError(f"buffer holds {len(out)} bytes, the block needs {n}")
            out[:n] = self.slot_data(slot, n)
            if self.seq(slot) == seq:
                return n
        return None

    # Owner-only writes --------------------------------------------------------------------------------------------

    def write_slot(self, slot: int, k0: int, k1: int, data: memoryview) -> None:
        base = slot * _META_WORDS
        self.meta[base] += 1  # odd: readers back off
        self.meta[base + 1], self.meta[base + 2], self.meta[base + 3] = len(data), k0, k1
        self.slot_data(slot, len(data))[:] = data
        self.meta[base] += 1

    def clear_slot(self, slot: int) -> None:
        base = slot * _META_WORDS
        self.meta[base] += 1
        self.meta[base + 1] = self.meta[base + 2] = self.meta[base + 3] = 0
        self.meta[base] += 1

    def table_insert(self, k0: int, slot: int) -> None:
        bucket = k0 & self.mask
        while self.table[bucket] >= 0:
            bucket = (bucket + 1) & self.mask
        self.table[bucket] = slot

    def table_remove(self, k0: int, slot: int) -> None:
        bucket = k0 & self.mask
        while self.table[bucket] != EMPTY:
            if self.table[bucket] == slot:
                self.table[bucket] = TOMBSTONE
                return
            bucket = (bucket + 1) & self.mask
        raise AssertionError(f"slot {slot} missing from the host tier index")

    def table_rebuild(self, live: list[tuple[int, int]]) -> None:
        """Drop tombstones: refill the table from (k0, slot) pairs. Readers racing this see misses only."""
        for i in range(self.shape.table_size):
            self.table[i] = EMPTY
        for k0, slot in live:
            self.table_insert(k0, slot)

    def close(self) -> None:
        for view in (self.meta, self.table, self.buf):
            view.release()
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a zero-copy view; the mapping goes when that view does
            pass
        if self.owner:
            try:
                os.unlink(os.path.join(_SHM_DIR, self.name))
            except FileNotFoundError:
                pass
