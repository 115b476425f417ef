"""Block identity (DESIGN §3): the one hash function every process uses.

    hash_0 = H(namespace_fingerprint, tokens_0)
    hash_i = H(hash_{i-1},             tokens_i)

`H` is xxh3-128 (seed-free) over `parent (16 bytes) || tokens as little-endian uint32`, so every process, host and
language computes the same value. A hash names the whole prefix up to and including its block. Only full blocks
are hashed.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import NewType, Sequence

import xxhash

BlockHash = NewType("BlockHash", bytes)  # 16 bytes
HASH_BYTES = 16
_MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True)
class Namespace:
    """What makes two blocks of the same tokens different: model, KV layout and dtype, tenant salt.

    `model_fingerprint` covers architecture, weights digest and quantization; `kv_layout` covers block size,
    layer count, kv heads and head dim. A salt-free namespace serves shared public prefixes.
    """

    model_fingerprint: str
    kv_layout: str
    kv_dtype: str
    cache_salt: str = ""

    def fingerprint(self) -> BlockHash:
        fields = ("strata-ns-v1", self.model_fingerprint, self.kv_layout, self.kv_dtype, self.cache_salt)
        # Length-prefixed UTF-8 so that no two field tuples share an encoding.
        encoded = b"".join(len(f.encode()).to_bytes(4, "little") + f.encode() for f in fields)
        return BlockHash(xxhash.xxh3_128_digest(encoded))

    def with_salt(self, cache_salt: str) -> "Namespace":
        return Namespace(self.model_fingerprint, self.kv_layout, self.kv_dtype, cache_salt)

    @classmethod
    def for_model(cls, model_fingerprint: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                  block_size: int, kv_dtype: str, cache_salt: str = "") -> "Namespace":
        """The namespace of a model's block-major paged KV (`[blocks, layers, 2, block_size, kv_heads, head_dim]`).

        The one definition the workers and the offline `LLM` (from a loaded model) and the router (from the
        checkpoint's config, without torch) share: plain numbers in, so the store needs no model code.
        """
        layout = f"block_major/L{num_layers}/H{num_kv_heads}/D{head_dim}/B{block_size}"
        return cls(model_fingerprint, layout, kv_dtype, cache_salt)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        arr = array("I", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN}]") from exc
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: bytes, tokens: Sequence[int]) -> BlockHash:
    """Hash one block given its parent hash (or the namespace fingerprint for the first block)."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    return BlockHash(xxhash.xxh3_128_digest(parent + _token_bytes(tokens)))


def hash_blocks(
    namespace: Namespace | bytes, token_ids: Sequence[int], block_size: int, parent: bytes | None = None
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block is not hashed).

    `parent` continues a chain (the hash of the block before `token_ids[0]`); by default the chain starts at the
    namespace fingerprint.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    prev = parent if parent is not None else (
        namespace.fingerprint() if isinstance(namespace, Namespace) else namespace)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[start:start + block_size])
        hashes.append(prev)
    return hashes


def hash_hex(h: bytes) -> str:
    return h.hex()
