"""The S3 tier's pack layout without I/O: the bytes of a pack object and of a tombstone, the `PackIndex` that
says which pack holds each block, and the plan of ranged GETs. The tier (kvstore/tiers/s3.py, `layout="pack"`)
makes the requests and feeds this module what it writes, lists and reads.

A pack is ONE object holding one `put` batch, so a long prefix is read with a few large ranged GETs:

    <key base>packs/<first block hash hex>-<block count>-<random hex>

    0                                                 data_end                              size
    |<- block 0 ->|<- block 1 ->| ... |<- block n-1 ->|<- index: n x 32 B ->|<- footer: 16 B ->|
                                                        hash (16 B)            magic "STRPACK1"
                                                        offset (u64 LE)        n (u32 LE)
                                                        length (u64 LE)        crc32 of the index (u32 LE)

- The index sits behind the blocks, so block offsets start at 0 and a reader that knows the object size (LIST
  gives it) and n (the name gives it, `pack_count`) reads the index with one ranged GET of the tail
  (`pack_tail_bytes`, `decode_pack_tail`, which rejects a bad footer, crc or overlapping spans).
- Packs are immutable. Deleted blocks of a pack that still holds live ones are named in a tombstone object,
  `<key base>tombstones/<unix ms>-<random hex>`, JSON `{"packs": {"packs/<name>": ["<hash hex>", ...]}}`.
- `PackIndex` maps block hash -> (pack, offset, length). A block is live in a pack unless a tombstone names it
  there; the same block may live in several packs (two writers stored it). Garbage is packs whose every block a
  tombstone names, and tombstones none of whose packs exist any more (the tier lists tombstones before packs, so a
  tombstone always names packs that existed before the packs were listed, and deletes packs before tombstones).
- `plan_ranges` coalesces the wanted blocks of one pack into runs, one ranged GET each.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

PACKS, TOMBSTONES = "packs/", "tombstones/"
_MAGIC = b"STRPACK1"
_ENTRY = struct.Struct("<16sQQ")  # block hash, offset, length
_FOOTER = struct.Struct("<8sII")  # magic, block count, crc32 of the index


# ------------------------------------------------------------------------------------------------- pack format

class PackEntry(NamedTuple):
    block_hash: bytes
    pack: str  # the pack's object key
    offset: int
    length: int


def encode_pack(items: Sequence[tuple[bytes, memoryview]]) -> tuple[bytes, list[tuple[bytes, int, int]]]:
    """The pack object of `items` (hash, byte view) and its (hash, offset, length) spans; see the module picture."""
    spans, offset = [], 0
    for key, data in items:
        spans.append((key, offset, data.nbytes))
        offset += data.nbytes
    index = b"".join(_ENTRY.pack(*span) for span in spans)
    footer = _FOOTER.pack(_MAGIC, len(spans), zlib.crc32(index))
    return b"".join([*(data for _, data in items), index, footer]), spans


def pack_tail_bytes(count: int) -> int:
    """Bytes of a pack's index and footer: what a reader fetches to learn a pack of `count` blocks."""
    return count * _ENTRY.size + _FOOTER.size


def decode_pack_tail(tail: bytes, count: int, size: int) -> list[tuple[bytes, int, int]]:
    """The spans in the tail of a pack of `size` bytes and `count` blocks; ValueError for anything malformed."""
    if len(tail) != pack_tail_bytes(count) or size < len(tail):
        raise ValueError(f"pack tail is {len(tail)} bytes of a {size}-byte object, expected {pack_tail_bytes(count)}")
    magic, n, crc = _FOOTER.unpack_from(tail, len(tail) - _FOOTER.size)
    index = tail[:count * _ENTRY.size]
    if magic != _MAGIC or n != count or zlib.crc32(index) != crc:
        raise ValueError(f"pack footer does not match (magic {magic!r}, {n} of {count} blocks, crc)")
    spans = [_ENTRY.unpack_from(index, i * _ENTRY.size) for i in range(count)]
    end = 0
    for _, offset, length in sorted(spans, key=lambda s: s[1]):
        if offset < end or offset + length > size - len(tail):
            raise ValueError(f"pack block at {offset} (+{length}) overlaps another or the index")
        end = offset + length
    return spans


def pack_count(key: str) -> int:
    """The block count a pack's name carries (`<hash hex>-<count>-<random hex>`); ValueError when it is not one."""
    _, count, _ = key.rsplit("/", 1)[-1].rsplit("-", 2)
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"not a pack name: {key!r}")
    return int(count)


def pack_first_hash(key: str) -> bytes | None:
    """The hash of the first block a pack's name carries (`<hash hex>-<count>-<random hex>`); None when it is not
    one."""
    first = key.rsplit("/", 1)[-1].split("-", 1)[0]
    try:
        return bytes.fromhex(first)
    except ValueError:
        return None


def encode_tombstone(named: dict[str, set[bytes]], key_base: str) -> bytes:
    packs = {pack[len(key_base):]: sorted(h.hex() for h in hashes) for pack, hashes in named.items()}
    return json.dumps({"packs": packs}, sort_keys=True).encode()


def decode_tombstone(body: bytes, key_base: str) -> dict[str, set[bytes]]:
    packs = json.loads(body)["packs"]
    if not all(name.startswith(PACKS) for name in packs):
        raise ValueError("a tombstone names an object outside packs/")
    return {key_base + name: {bytes.fromhex(h) for h in hashes} for name, hashes in packs.items()}


# ----------------------------------------------------------------------------------------------- pack index

@dataclass
class _Pack:
    size: int
    entries: list[PackEntry]
    born: float  # time.monotonic() when this process wrote it; -inf when it was listed


@dataclass
class PackIndex:
    """Which pack holds each block: bookkeeping only (no I/O); the tier feeds it what it writes, lists and reads.

    A block is live in a pack unless a tombstone names it there; the same block may live in several packs (two
    writers stored it): `find` returns one, `holders` all. While `suspended` (a refresh failed) it finds nothing.
    """

    packs: dict[str, _Pack] = field(default_factory=dict)
    where: dict[bytes, dict[str, PackEntry]] = field(default_factory=dict)  # hash -> {pack: entry}, live only
    dead: dict[str, set[bytes]] = field(default_factory=dict)  # pack -> blocks tombstones name there
    tombstones: dict[str, frozenset[str]] = field(default_factory=dict)  # tombstone key -> packs it names
    suspended: bool = False

    def add_pack(self, key: str, size: int, spans: Sequence[tuple[bytes, int, int]],
                 born: float = float("-inf")) -> None:
        self.packs[key] = _Pack(size, [PackEntry(h, key, off, n) for h, off, n in spans], born)
        dead = self.dead.get(key, set())
        for entry in self.packs[key].entries:
            if entry.block_hash not in dead:
                self.where.setdefault(entry.block_hash, {})[key] = entry

    def drop_pack(self, key: str) -> None:
        pack = self.packs.pop(key, None)
        self.dead.pop(key, None)
        for entry in pack.entries if pack else ():
            self._unlink(entry.block_hash, key)

    def add_tombstone(self, key: str, named: dict[str, set[bytes]]) -> None:
        self.tombstones[key] = frozenset(named)
        for pack, hashes in named.items():
            self.dead.setdefault(pack, set()).update(hashes)
            for h in hashes:
                self._unlink(h, pack)

    def find(self, block_hash: bytes) -> PackEntry | None:
        holders = None if self.suspended else self.where.get(block_hash)
        return next(iter(holders.values())) if holders else None

    def holders(self, block_hash: bytes) -> list[PackEntry]:
        return [] if self.suspended else list(self.where.get(block_hash, {}).values())

    def live(self, key: str) -> set[bytes]:
        dead = self.dead.get(key, set())
        return {e.block_hash for e in self.packs[key].entries if e.block_hash not in dead}

    def sync(self, packs: dict[str, int], tombstones: dict[str, int], started: float) -> None:
        """Forget what a listing begun at `started` no longer shows (packs this process wrote since then stay)."""
        for key in [k for k, p in self.packs.items() if k not in packs and p.born < started]:
            self.drop_pack(key)
        for key in [k for k in self.dead if k not in packs and k not in self.packs]:
            del self.dead[key]
        for key in [k for k in self.tombstones if k not in tombstones]:
            del self.tombstones[key]
        self.suspended = False

    def unread(self, packs: dict[str, int], tombstones: dict[str, int]) -> tuple[dict[str, int], list[str]]:
        """The listed packs (with sizes) and tombstones this index has not read yet."""
        return ({k: size for k, size in packs.items() if k not in self.packs},
                [k for k in tombstones if k not in self.tombstones])

    def garbage(self, packs: dict[str, int], tombstones: dict[str, int]) -> tuple[list[str], list[str]]:
        """Listed packs every block of which is tombstoned, and listed tombstones whose packs are all gone."""
        dead = [k for k, p in self.packs.items() if k in packs and p.entries and not self.live(k)]
        orphans = [k for k, named in self.tombstones.items() if k in tombstones and named and not named & packs.keys()]
        return dead, orphans

    def blocks_and_bytes(self) -> tuple[int, int]:
        """Distinct live blocks, and bytes of the pack objects (dead blocks count until their pack goes)."""
        return len(self.where), sum(p.size for p in self.packs.values())

    def check_integrity(self) -> None:
        """Every live entry of every pack is findable, and nothing else is."""
        live = {(e.block_hash, k) for k, p in self.packs.items() for e in p.entries
                if e.block_hash not in self.dead.get(k, set())}
        found = {(h, k) for h, holders in self.where.items() for k in holders}
        assert live == found, f"index lists {len(found - live)} dead or unknown and misses {len(live - found)} live"
        assert all(self.where.values()), "a block with no holder is still indexed"

    def _unlink(self, block_hash: bytes, pack: str) -> None:
        holders = self.where.get(block_hash)
        if holders is not None:
            holders.pop(pack, None)
            if not holders:
                del self.where[block_hash]


@dataclass
class PackRange:
    """One ranged GET: bytes [start, end) of a pack, holding `parts` (entry, caller index) sorted by offset."""

    pack: str
    start: int
    end: int
    parts: list[tuple[PackEntry, int]]


def plan_ranges(wanted: Sequence[tuple[PackEntry, int]], max_gap: int, max_span: int) -> list[PackRange]:
    """Coalesce block reads into ranged GETs: a run of blocks of one pack, each within `max_gap` bytes of the
    last, at most `max_span` bytes (a larger block gets a range of its own).

        pack:   |b0|b1|b2|b3|<------ gap > max_gap ------>|b9|
        reads:  [  range 1  ]                             [r2]
    """
    ranges: list[PackRange] = []
    for entry, i in sorted(wanted, key=lambda w: (w[0].pack, w[0].offset)):
        last, end = ranges[-1] if ranges else None, entry.offset + entry.length
        if (last is not None and last.pack == entry.pack and entry.offset - last.end <= max_gap
                and max(end, last.end) - last.start <= max_span):
            last.parts.append((entry, i))
            last.end = max(last.end, end)
        else:
            ranges.append(PackRange(entry.pack, entry.offset, end, [(entry, i)]))
    return ranges
