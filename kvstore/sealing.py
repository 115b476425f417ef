"""Encryption at rest (AES-256-GCM) of the blocks the disk, Redis and S3 tiers hold; host stays plaintext.

A sealed object wraps one codec-encoded block (kvstore/codec.py):

    0      4        6          12                 28          40                       40+n     40+n+16
    | magic | version | reserved | namespace fingerprint | nonce | ciphertext of the block | GCM tag |
      "SKVS"  u16 LE    zeros      (16 B, also at offset 12 of a plain codec block)   (n = the block's length)

- The key is 32 bytes (`load_key`: a file of 32 raw bytes or 64 hex characters). Every seal draws a fresh random
  96-bit nonce, so one key should seal fewer than ~2**32 objects (NIST SP 800-38D) before it is rotated.
- Associated data: bytes [0, 28) (magic, version, fingerprint) and the block hash the object is stored under, so an
  object copied to another key, or relabelled with another namespace, fails to open.
- The fingerprint sits at offset 12 in both a sealed object and a plain block, so a tier can charge a namespace's
  quota (`fingerprint_of`) without knowing whether its objects are sealed.

`SealedTier` applies this to one tier: `put` seals, `get` opens into the caller's buffers (reading the sealed bytes
into scratch buffers first, so every fast path of the inner tier - the Redis MGET received into buffers, the S3
pack ranged GETs - still runs, on the sealed bytes), and an object that does not open is a miss: counted in the
tier's `checksum_failures`, deleted, and reported to `bad_copy_listener` (the store publishes its removal), just as
the store treats a block whose checksum does not match. Evicted bytes are opened before the eviction listener sees
them, so the store only ever handles plaintext blocks.
"""
from __future__ import annotations

import logging
import os
import struct
from typing import Any, Callable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.tiers.base import Tier, TierStats, TierUnavailable

log = logging.getLogger(__name__)

MAGIC = b"SKVS"
VERSION = 1
KEY_BYTES, NONCE_BYTES, TAG_BYTES = 32, 12, 16
FINGERPRINT_OFFSET = 12  # in a sealed object and in a plain codec block alike
_PREFIX = struct.Struct("<4sH6x16s")  # magic, version, reserved, fingerprint: the authenticated prefix
HEADER_BYTES = _PREFIX.size + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES  # bytes a sealed object adds to its block


class SealError(ValueError):
    """A sealed object is malformed or does not authenticate (wrong key, wrong block, flipped bits)."""


def load_key(path: str) -> bytes:
    """The 32-byte key in `path`: 32 raw bytes, or 64 hex characters (surrounding whitespace ignored)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError as exc:
        raise ValueError(f"kv encryption key file {path!r} cannot be read: {exc}") from None
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ValueError(f"kv encryption key file {path!r} must hold 32 raw bytes or 64 hex characters, "
                     f"got {len(raw)} bytes")


def fingerprint_of(data: bytes | memoryview) -> bytes:
    """The namespace fingerprint of a stored object, sealed or plain (offset 12, 16 bytes)."""
    return bytes(memoryview(data)[FINGERPRINT_OFFSET:FINGERPRINT_OFFSET + HASH_BYTES])


def is_sealed(data: bytes | memoryview) -> bool:
    return bytes(memoryview(data)[:4]) == MAGIC


class Sealer:
    """Seals and opens block objects under one key. Thread-safe (AESGCM holds no per-call state)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the kv encryption key must be {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)

    def seal(self, block_hash: bytes, block: bytes | memoryview) -> memoryview:
        """The sealed object of one encoded block stored under `block_hash`."""
        block = memoryview(block).cast("B")
        prefix = _PREFIX.pack(MAGIC, VERSION, fingerprint_of(block))
        nonce = os.urandom(NONCE_BYTES)
        out = memoryview(bytearray(len(block) + OVERHEAD))
        out[:_PREFIX.size], out[_PREFIX.size:HEADER_BYTES] = prefix, nonce
        associated = prefix + bytes(block_hash)
        if hasattr(self._aead, "encrypt_into"):  # cryptography >= 47: straight into the object
            self._aead.encrypt_into(nonce, block, associated, out[HEADER_BYTES:])
        else:
            out[HEADER_BYTES:] = self._aead.encrypt(nonce, bytes(block), associated)
        return out

    def open_into(self, block_hash: bytes, sealed: bytes | memoryview, out: memoryview) -> int:
        """Authenticate `sealed` (stored under `block_hash`) and write its block into `out`; the block's length.
        Raises `SealError` for anything that does not open; `ValueError` when `out` is too small."""
        sealed = memoryview(sealed).cast("B")
        if len(sealed) < OVERHEAD:
            raise SealError(f"sealed object of {len(sealed)} bytes is shorter than the {OVERHEAD}-byte overhead")
        magic, version, _ = _PREFIX.unpack_from(sealed, 0)
        if magic != MAGIC or version != VERSION:
            raise SealError(f"not a sealed object (magic {bytes(magic)!r}, version {version})")
        n = len(sealed) - OVERHEAD
        if n > len(out):
            raise ValueError(f"buffer of {len(out)} bytes is too small for a block of {n} bytes")
        nonce = sealed[_PREFIX.size:HEADER_BYTES]
        associated = bytes(sealed[:_PREFIX.size]) + bytes(block_hash)
        try:
            if hasattr(self._aead, "decrypt_into"):  # cryptography >= 47: no intermediate copy
                self._aead.decrypt_into(nonce, sealed[HEADER_BYTES:], associated, out[:n])
            else:
                out[:n] = self._aead.decrypt(bytes(nonce), bytes(sealed[HEADER_BYTES:]), associated)
        except InvalidTag:
            raise SealError(f"block {bytes(block_hash).hex()} does not authenticate (wrong key, moved or "
                            "corrupted)") from None
        return n

    def open(self, block_hash: bytes, sealed: bytes | memoryview) -> bytes:
        out = bytearray(max(0, len(memoryview(sealed)) - OVERHEAD))
        self.open_into(block_hash, sealed, memoryview(out))
        return bytes(out)


class SealedTier(Tier):
    """One tier whose objects are sealed: see the module docstring. Everything else is the inner tier's."""

    def __init__(self, inner: Tier, sealer: Sealer) -> None:
        self.name = inner.name
        self._inner, self._sealer = inner, sealer
        self._listener: Callable[[BlockHash, Any], None] | None = None
        self.bad_copy_listener: Callable[[BlockHash], None] | None = None
        super().__init__()
        inner.eviction_listener = self._on_inner_evict

    @property
    def inner(self) -> Tier:
        return self._inner

    # The store sets these on the tier it holds; they belong to the inner tier, which evicts.
    @property
    def eviction_wants_data(self) -> bool:
        return self._inner.eviction_wants_data

    @eviction_wants_data.setter
    def eviction_wants_data(self, value: bool) -> None:
        self._inner.eviction_wants_data = value

    @property
    def eviction_listener(self) -> Callable[[BlockHash, Any], None] | None:
        return self._listener

    @eviction_listener.setter
    def eviction_listener(self, listener: Callable[[BlockHash, Any], None] | None) -> None:
        self._listener = listener

    def __getattr__(self, name: str) -> Any:  # keys_lru_order, refresh_index, scan_usage, check_integrity, ...
        if name.startswith("__") or name in ("_inner", "_sealer"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return self._inner.contains(keys)

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        outs = [memoryview(b).cast("B") if memoryview(b).format != "B" else memoryview(b) for b in bufs]
        scratch = [memoryview(bytearray(len(out) + OVERHEAD)) for out in outs]
        sizes = self._inner.get(keys, scratch)
        result: list[int | None] = [None] * len(keys)
        bad: list[BlockHash] = []
        for i, size in enumerate(sizes):
            if size is None:
                continue
            try:
                result[i] = self._sealer.open_into(bytes(keys[i]), scratch[i][:size], outs[i])
            except SealError as exc:
                log.warning("%s tier: dropping bad copy of %s: %s", self.name, bytes(keys[i]).hex(), exc)
                bad.append(keys[i])
        if bad:
            self._drop_bad(bad)
        return result

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        return self._inner.put([(k, self._sealer.seal(bytes(k), d)) for k, d in items])

    def delete(self, keys: Sequence[BlockHash]) -> int:
        return self._inner.delete(keys)

    def clear(self) -> Any:
        return self._inner.clear()

    def close(self) -> None:
        self._inner.close()

    def stats(self) -> TierStats:
        stats = self._inner.stats()
        with self._stats_lock:
            stats.checksum_failures += self._stats.checksum_failures
        return stats

    def _drop_bad(self, keys: list[BlockHash]) -> None:
        """Count and delete copies that did not open; a failed delete leaves them (the next read counts again)."""
        self._count(checksum_failures=len(keys))
        try:
            self._inner.delete(keys)
        except TierUnavailable as exc:
            log.warning("%s tier: could not delete %d bad copies: %s", self.name, len(keys), exc)
            return
        if self.bad_copy_listener is not None:
            for key in keys:
                self.bad_copy_listener(key)

    def _on_inner_evict(self, key: BlockHash, data: bytes | memoryview | None) -> None:
        """The inner tier evicted `key`: hand its plaintext (None when it does not open) to the store's listener."""
        if self._listener is None:
            return
        plain = None
        if data is not None:
            try:
                plain = self._sealer.open(bytes(key), data)
            except SealError as exc:
                log.warning("%s tier: evicted copy of %s does not open: %s", self.name, bytes(key).hex(), exc)
        self._listener(key, plain)
