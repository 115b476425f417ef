"""Block codec (DESIGN §4): one self-describing, verifiable byte object per KV block, for every tier and transfer.

    0               HEADER_SIZE      +4*num_tokens (if present)   +scales_len            +payload_len
    | fixed header  | token ids u32  | quantization scales         | payload (raw KV, block-major) |
      magic, version, flags, namespace fingerprint, block hash, parent hash, layout, dtype, token count,
      section lengths, checksum (xxh3-64 over tokens + scales + payload), header checksum (xxh3-64 of the header);
      128 bytes in all

A quantized block (dtype float8_e4m3fn or int8) carries its scales, float32 `[num_layers, 2, kv_heads]` (one per
layer, K/V and head), in the scales section; any other dtype carries none. The engine keeps a quantized block as
one span `scales | values` (engine/kv_cache.py), so the scales and payload sections together are exactly that
span, back to back. Blocks without scales encode exactly as before (scales length 0, same version).

The token ids and parent hash are optional; carrying them makes a stored block self-describing, so a tier that
demotes or rebuilds blocks can still publish complete `BlockStored` events (DESIGN §6).
Reading verifies everything and raises `CorruptBlock` naming what failed, so a bad copy becomes a counted miss and
never wrong KV. No pickle: the header is a fixed little-endian struct and the sections raw bytes.
"""
from __future__ import annotations

import functools
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import xxhash

from kvstore.hashing import HASH_BYTES

MAGIC = b"SKVB"
VERSION = 1
CHECKSUM_XXH3_64 = 1
FLAG_TOKENS, FLAG_PARENT = 1, 2

# magic, version, checksum algo, layout id, dtype code, flags, fingerprint, hash, parent hash, num_layers,
# block_size, kv_heads, head_dim, token count, scales length, payload length, checksum, reserved (pads the header
# to 128 bytes so the sections after it stay aligned)
_BODY = struct.Struct("<4sHBBBB2x16s16s16sIIIIIIQQ20x")
_HEADER_CHECKSUM = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _HEADER_CHECKSUM.size
# The same header as a numpy record, to check many blocks' headers at once (`decode_many`).
_HEADER_RECORD = np.dtype([("magic", "S4"), ("version", "<u2"), ("algo", "u1"), ("layout_id", "u1"), ("dtype", "u1"),
                           ("flags", "u1"), ("_pad", "V2"), ("fingerprint", "V16"), ("hash", "V16"),
                           ("parent", "V16"), ("layers", "<u4"), ("block_size", "<u4"), ("heads", "<u4"),
                           ("head_dim", "<u4"), ("num_tokens", "<u4"), ("scales_len", "<u4"), ("payload_len", "<u8"),
                           ("checksum", "<u8"), ("_reserved", "V20"), ("header_checksum", "<u8")])
assert _HEADER_RECORD.itemsize == HEADER_SIZE
# Fields every block of a uniform run shares with the first (`decode_many`'s fast path; and the flags but the
# parent's: a prefix's first block has no parent).
_SHAPE_FIELDS = ("version", "algo", "layout_id", "dtype", "layers", "block_size", "heads", "head_dim",
                 "num_tokens", "scales_len", "payload_len")

# Stable wire codes: never renumber, only append.
DTYPE_CODES: dict[str, int] = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5, "int8": 6, "uint8": 7,
}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}

# KV stored quantized with float32 scales per (layer, K/V, kv head) in the scales section.
QUANTIZED_DTYPES = ("float8_e4m3fn", "int8")
SCALE_SIZE = 4

# Layout ids: 0 is the engine's block-major span `[num_layers, 2, block_size, kv_heads, head_dim]`.
LAYOUT_BLOCK_MAJOR = 0


class CorruptBlock(ValueError):
    """A stored block failed verification. `reason` is one of the `REASONS` (what failed)."""

    REASONS = ("truncated", "magic", "version", "header_checksum", "checksum_algo", "dtype", "flags",
               "fingerprint", "hash", "layout", "length", "payload_checksum")

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(f"corrupt block ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one block's KV: `[num_layers, 2, block_size, kv_heads, head_dim]` for `LAYOUT_BLOCK_MAJOR`."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    layout_id: int = LAYOUT_BLOCK_MAJOR

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not 1 <= value < 2**32:
                raise ValueError(f"layout {name} must be in [1, 2**32), got {value}")
        if not 0 <= self.layout_id < 256:
            raise ValueError(f"layout_id must be in [0, 255], got {self.layout_id}")

    def payload_bytes(self, dtype: str) -> int:
        """Bytes of K and V across all layers of one block in `dtype`."""
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.head_dim * _dtype_size(dtype)

    def scale_bytes(self, dtype: str) -> int:
        """Bytes of one block's scales in `dtype`: float32 `[num_layers, 2, kv_heads]` when quantized, else 0."""
        _dtype_size(dtype)
        return self.num_layers * 2 * self.kv_heads * SCALE_SIZE if dtype in QUANTIZED_DTYPES else 0

    def span_bytes(self, dtype: str) -> int:
        """Bytes of the scales and payload sections together (the engine's block span)."""
        return self.scale_bytes(dtype) + self.payload_bytes(dtype)


class BlockHeader(NamedTuple):
    fingerprint: bytes
    block_hash: bytes
    parent_hash: bytes | None
    layout: BlockLayout
    dtype: str
    num_tokens: int
    has_tokens: bool
    scales_len: int
    payload_len: int
    checksum: int

    @property
    def tokens_len(self) -> int:
        return 4 * self.num_tokens if self.has_tokens else 0

    @property
    def span_start(self) -> int:
        """Where the span (scales, then payload) starts in the encoded block."""
        return HEADER_SIZE + self.tokens_len

    @property
    def encoded_len(self) -> int:
        return HEADER_SIZE + self.tokens_len + self.scales_len + self.payload_len


class DecodedBlock:
    """A verified block; `tokens`, `scales`, `payload` and `span` are zero-copy views into the decoded buffer, made
    when asked for (a prefix load reads only the headers of hundreds of blocks).

    `tokens` is empty when the block was encoded without token ids, `scales` when it is not quantized; `span` is
    the scales and payload together (adjacent): a quantized block's span, else the payload.
    """

    __slots__ = ("header", "_buf")

    def __init__(self, header: BlockHeader, buf: memoryview) -> None:
        self.header, self._buf = header, buf  # buf: the encoded block's bytes (format "B"), at least encoded_len

    @property
    def tokens(self) -> memoryview:
        return self._buf[HEADER_SIZE:self.header.span_start].cast("I")

    @property
    def scales(self) -> memoryview:
        start = self.header.span_start
        return self._buf[start:start + self.header.scales_len]

    @property
    def payload(self) -> memoryview:
        return self._buf[self.header.span_start + self.header.scales_len:self.header.encoded_len]

    @property
    def span(self) -> memoryview:
        return self._buf[self.header.span_start:self.header.encoded_len]

    def __repr__(self) -> str:
        return f"DecodedBlock({self.header!r})"


def _dtype_size(dtype: str) -> int:
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {dtype!r}")
    return DTYPE_SIZES[dtype]


def encoded_size(payload_len: int, scales_len: int = 0, num_tokens: int = 0) -> int:
    """Bytes of an encoded block; pass `num_tokens` when token ids are carried."""
    return HEADER_SIZE + 4 * num_tokens + scales_len + payload_len


def _checksum(sections: memoryview) -> int:
    """xxh3-64 over tokens + scales + payload, which lie back to back: one pass, no streaming state."""
    return xxhash.xxh3_64_intdigest(sections)


def _token_bytes(tokens: Sequence[int]) -> memoryview:
    arr = array("I", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return memoryview(arr).cast("B")


def encode_into(out: memoryview | bytearray, fingerprint: bytes, block_hash: bytes, layout: BlockLayout,
                dtype: str, payload: bytes | memoryview, *, num_tokens: int | None = None,
                tokens: Sequence[int] | None = None, parent_hash: bytes | None = None,
                scales: bytes | memoryview = b"") -> int:
    """Write the encoded block into `out` (one copy of the payload); returns the encoded length.

    Give `tokens` (the block's token ids) or just `num_tokens`; `parent_hash` is the hash of the previous block.
    """
    payload, scales = memoryview(payload).cast("B"), memoryview(scales).cast("B")
    token_section = _token_bytes(tokens) if tokens is not None else memoryview(b"")
    num_tokens = len(tokens) if tokens is not None else (layout.block_size if num_tokens is None else num_tokens)
    _check_encode_args(fingerprint, block_hash, parent_hash, layout, dtype, num_tokens, len(payload), len(scales))
    flags = (FLAG_TOKENS if tokens is not None else 0) | (FLAG_PARENT if parent_hash is not None else 0)
    total = HEADER_SIZE + len(token_section) + len(scales) + len(payload)
    out = memoryview(out).cast("B")
    if len(out) < total:
        raise ValueError(f"output buffer holds {len(out)} bytes, the block needs {total}")
    offset = HEADER_SIZE
    for section in (token_section, scales, payload):
        out[offset:offset + len(section)] = section
        offset += len(section)
    _BODY.pack_into(out, 0, MAGIC, VERSION, CHECKSUM_XXH3_64, layout.layout_id, DTYPE_CODES[dtype], flags,
                    fingerprint, block_hash, parent_hash or bytes(HASH_BYTES), layout.num_layers, layout.block_size,
                    layout.kv_heads, layout.head_dim, num_tokens, len(scales), len(payload),
                    _checksum(out[HEADER_SIZE:total]))
    _HEADER_CHECKSUM.pack_into(out, _BODY.size, xxhash.xxh3_64_intdigest(out[:_BODY.size]))
    return total


def encode(fingerprint: bytes, block_hash: bytes, layout: BlockLayout, dtype: str, payload: bytes | memoryview,
           **options) -> bytes:
    """Encode one block into a new bytes object; `options` as for `encode_into`."""
    tokens, scales = options.get("tokens"), options.get("scales", b"")
    size = encoded_size(memoryview(payload).nbytes, memoryview(scales).nbytes, len(tokens) if tokens else 0)
    out = bytearray(size)
    encode_into(out, fingerprint, block_hash, layout, dtype, payload, **options)
    return bytes(out)


def _check_encode_args(fingerprint: bytes, block_hash: bytes, parent_hash: bytes | None, layout: BlockLayout,
                       dtype: str, num_tokens: int, payload_len: int, scales_len: int) -> None:
    for name, value in (("fingerprint", fingerprint), ("block_hash", block_hash), ("parent_hash", parent_hash)):
        if value is not None and len(value) != HASH_BYTES:
            raise ValueError(f"{name} must be {HASH_BYTES} bytes, got {len(value)}")
    if payload_len != layout.payload_bytes(dtype):
        raise ValueError(f"payload is {payload_len} bytes, layout {layout} in {dtype} needs "
                         f"{layout.payload_bytes(dtype)}")
    if scales_len != layout.scale_bytes(dtype):
        raise ValueError(f"scales are {scales_len} bytes, layout {layout} in {dtype} needs {layout.scale_bytes(dtype)}"
                         f" (float32 per layer, K/V and kv head when quantized, none otherwise)")
    if not 0 <= num_tokens <= layout.block_size:
        raise ValueError(f"num_tokens must be in [0, {layout.block_size}], got {num_tokens}")


def peek_header(buf: bytes | memoryview) -> BlockHeader:
    """Parse and check the header only (magic, version, header checksum, codes); the sections are not read."""
    buf = memoryview(buf).cast("B")
    if len(buf) < HEADER_SIZE:
        raise CorruptBlock("truncated", f"{len(buf)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (magic, version, algo, layout_id, dtype_code, flags, fingerprint, block_hash, parent, layers, block_size, heads,
     head_dim, num_tokens, scales_len, payload_len, checksum) = _BODY.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlock("magic", f"expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptBlock("version", f"expected {VERSION}, got {version}")
    (stored_header_sum,) = _HEADER_CHECKSUM.unpack_from(buf, _BODY.size)
    if stored_header_sum != xxhash.xxh3_64_intdigest(buf[:_BODY.size]):
        raise CorruptBlock("header_checksum", "header bytes do not match their checksum")
    if algo != CHECKSUM_XXH3_64:
        raise CorruptBlock("checksum_algo", f"unknown checksum algorithm {algo}")
    if dtype_code not in DTYPE_NAMES:
        raise CorruptBlock("dtype", f"unknown dtype code {dtype_code}")
    if flags & ~(FLAG_TOKENS | FLAG_PARENT):
        raise CorruptBlock("flags", f"unknown flags {flags:#x}")
    try:
        layout = _layout(layers, block_size, heads, head_dim, layout_id)
    except ValueError as exc:
        raise CorruptBlock("layout", str(exc)) from None
    return BlockHeader(bytes(fingerprint), bytes(block_hash), bytes(parent) if flags & FLAG_PARENT else None,
                       layout, DTYPE_NAMES[dtype_code], num_tokens, bool(flags & FLAG_TOKENS), scales_len,
                       payload_len, checksum)


def decode(buf: bytes | memoryview, expected_fingerprint: bytes, expected_hash: bytes,
           expected_layout: BlockLayout | None = None) -> DecodedBlock:
    """Verify every field of an encoded block and return zero-copy views of its sections.

    Raises `CorruptBlock` for any mismatch: wrong namespace, wrong hash, bad lengths or a bad checksum.
    """
    buf = memoryview(buf).cast("B")
    header = peek_header(buf)
    if header.fingerprint != bytes(expected_fingerprint):
        raise CorruptBlock("fingerprint", "block belongs to another namespace")
    if header.block_hash != bytes(expected_hash):
        raise CorruptBlock("hash", f"expected {bytes(expected_hash).hex()}, got {header.block_hash.hex()}")
    if expected_layout is not None and header.layout != expected_layout:
        raise CorruptBlock("layout", f"expected {expected_layout}, got {header.layout}")
    _check_lengths(header, len(buf))
    if _checksum(buf[HEADER_SIZE:header.encoded_len]) != header.checksum:
        raise CorruptBlock("payload_checksum", "token, scale or payload bytes do not match their checksum")
    return DecodedBlock(header, buf)


verify = decode


def decode_many(views: Sequence[memoryview], expected_fingerprint: bytes, expected_hashes: Sequence[bytes],
                expected_layout: BlockLayout | None = None) -> list[DecodedBlock | CorruptBlock]:
    """`decode` of many blocks: item i is `decode(views[i], expected_fingerprint, expected_hashes[i],
    expected_layout)`, or the `CorruptBlock` it raises. The same checks, the headers checked together: every block
    whose header has the first block's shape (layout, dtype, flags, token count, section lengths) is checked with
    array operations and its checksums computed in one pass over the views; any other block (another shape, a short
    view, any mismatch) goes through `decode` itself, which names what failed."""
    n = len(views)
    if n == 0:
        return []
    views = [v if isinstance(v, memoryview) and v.format == "B" and v.ndim == 1 else memoryview(v).cast("B")
             for v in views]
    if any(len(v) < HEADER_SIZE for v in views):
        return [_decode_or_error(v, expected_fingerprint, h, expected_layout) for v, h in zip(views, expected_hashes)]
    raw = b"".join([v[:HEADER_SIZE] for v in views])
    rec = np.frombuffer(raw, dtype=_HEADER_RECORD)
    first = _decode_or_error(views[0], expected_fingerprint, expected_hashes[0], expected_layout)
    if isinstance(first, CorruptBlock):
        return [first] + decode_many(views[1:], expected_fingerprint, expected_hashes[1:], expected_layout)
    header = first.header
    encoded_len = header.encoded_len
    ok = (rec["magic"] == MAGIC) & (rec["fingerprint"] == np.void(bytes(expected_fingerprint)))
    ok &= rec["hash"] == np.frombuffer(b"".join([bytes(h) for h in expected_hashes]), dtype="V16")
    for field in _SHAPE_FIELDS:
        ok &= rec[field] == rec[field][0]
    ok &= (rec["flags"] | FLAG_PARENT) == (rec["flags"][0] | FLAG_PARENT)
    ok &= np.fromiter(map(len, views), dtype=np.int64, count=n) >= encoded_len
    sums = np.fromiter((xxhash.xxh3_64_intdigest(raw[i * HEADER_SIZE:i * HEADER_SIZE + _BODY.size])
                        for i in range(n)), dtype=np.uint64, count=n)
    ok &= sums == rec["header_checksum"]
    fast = np.flatnonzero(ok).tolist()
    sums = np.fromiter((xxhash.xxh3_64_intdigest(views[i][HEADER_SIZE:encoded_len]) for i in fast), dtype=np.uint64,
                       count=len(fast))
    good = set(np.asarray(fast, dtype=np.int64)[sums == rec["checksum"][fast]].tolist())
    good.add(0)
    parents = [p if f & FLAG_PARENT else None for p, f in zip(rec["parent"].tolist(), rec["flags"].tolist())]
    checksums = rec["checksum"].tolist()
    fingerprint, layout, dtype, num_tokens, has_tokens, scales_len, payload_len = (
        header.fingerprint, header.layout, header.dtype, header.num_tokens, header.has_tokens, header.scales_len,
        header.payload_len)
    out: list[DecodedBlock | CorruptBlock] = []
    for i, (view, block_hash) in enumerate(zip(views, expected_hashes)):
        if i not in good:
            out.append(_decode_or_error(view, expected_fingerprint, block_hash, expected_layout))
            continue
        head = BlockHeader(fingerprint, bytes(block_hash), parents[i], layout, dtype, num_tokens, has_tokens,
                           scales_len, payload_len, checksums[i])
        out.append(DecodedBlock(head, view))
    return out


def _decode_or_error(buf: memoryview, expected_fingerprint: bytes, expected_hash: bytes,
                     expected_layout: BlockLayout | None) -> DecodedBlock | CorruptBlock:
    try:
        return decode(buf, expected_fingerprint, expected_hash, expected_layout)
    except CorruptBlock as exc:
        return exc


def read_tokens(buf: bytes | memoryview, header: BlockHeader) -> list[int]:
    """Token ids carried by an encoded block (empty if none); not verified, for event metadata only."""
    if not header.has_tokens or len(buf) < HEADER_SIZE + header.tokens_len:
        return []
    return list(memoryview(buf)[HEADER_SIZE:HEADER_SIZE + header.tokens_len].cast("I"))


@functools.lru_cache(maxsize=64)
def _layout(layers: int, block_size: int, heads: int, head_dim: int, layout_id: int) -> BlockLayout:
    """The header's layout, checked once per distinct one (a worker reads one or two): decoding a block is ~6 us of
    Python, and a prefix is hundreds of blocks. Raises ValueError as BlockLayout does (not cached)."""
    return BlockLayout(layers, block_size, heads, head_dim, layout_id)


@functools.lru_cache(maxsize=64)
def _section_bytes(layout: BlockLayout, dtype: str) -> tuple[int, int]:
    """(payload bytes, scale bytes) of a block of `layout` in `dtype`."""
    return layout.payload_bytes(dtype), layout.scale_bytes(dtype)


def _check_lengths(header: BlockHeader, available: int) -> None:
    payload_bytes, scale_bytes = _section_bytes(header.layout, header.dtype)
    if header.payload_len != payload_bytes:
        raise CorruptBlock("length", f"payload length {header.payload_len} does not fit layout {header.layout}")
    if header.scales_len != scale_bytes:
        raise CorruptBlock("length", f"scales length {header.scales_len} does not fit layout {header.layout} in "
                                     f"{header.dtype} ({scale_bytes} bytes)")
    if header.num_tokens > header.layout.block_size:
        raise CorruptBlock("length", f"token count {header.num_tokens} exceeds block size")
    if available < header.encoded_len:
        raise CorruptBlock("truncated", f"{available} bytes available, header promises {header.encoded_len}")
