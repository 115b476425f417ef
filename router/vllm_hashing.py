"""vLLM's prefix-cache block hashes, computed by the router for a vLLM worker's requests (issue 18 item 2).

A vLLM worker publishes its own block hashes, so the router matches its cached prefix only by hashing the request
the way that worker does, as llm-d's precise prefix-cache scorer does. vLLM (checked against 0.34,
`vllm/v1/core/kv_cache_utils.py`):

    NONE_HASH = H(seed)                                   seed = $PYTHONHASHSEED, else "vllm-none-hash"
    hash_i    = H((hash_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i))
    extra_keys_i = (("lora", name, path),)? + (("cache_salt", salt),)? (block 0 only), or None when empty

where H is `--hash-algo`: sha256 (SHA-256 of the pickled tuple, the default), sha256_cbor (SHA-256 of canonical
CBOR), xxhash / xxhash_cbor (xxh3-128; vLLM draws a random seed per process unless PYTHONHASHSEED is set, so those
need `hash_seed`). Only full blocks are hashed. Events carry the low 64 bits of each hash as an int by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), or the digest itself: the router keys a vLLM worker's blocks by the low
64 bits either way (`event_key`), so either publisher setting matches.

Not covered (the router then sees no cached prefix there; routing stays correct): multimodal and prompt-embeds
extra keys, and speculative lookahead hashing (`num_hash_lookahead_tokens`).
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import xxhash

from router.index import BlockKey

HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
# NOTE: vLLM pickles with pickle.HIGHEST_PROTOCOL, which is 5 on every Python through 3.14; pinned so a router on a
# newer Python still hashes as the workers do.
_PICKLE_PROTOCOL = 5
_LOW_64 = (1 << 64) - 1


def _cbor(value: Any) -> bytes:
    import cbor2  # NOTE: lazy: only the *_cbor algorithms need it
    return cbor2.dumps(value, canonical=True)


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=_PICKLE_PROTOCOL)


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda v: hashlib.sha256(_pickled(v)).digest(),
    "sha256_cbor": lambda v: hashlib.sha256(_cbor(v)).digest(),
    "xxhash": lambda v: xxhash.xxh3_128_digest(_pickled(v)),
    "xxhash_cbor": lambda v: xxhash.xxh3_128_digest(_cbor(v)),
}


@dataclass(frozen=True)
class VllmHashConfig:
    """How one vLLM worker hashes blocks: its `--block-size` (the hash block size), `--prefix-caching-hash-algo`
    and its PYTHONHASHSEED (None: unset, vLLM's fixed default seed for the sha256 algorithms)."""

    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    _none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (the vLLM worker's --block-size), got {self.block_size}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS} (vLLM's --prefix-caching-hash-algo), "
                             f"got {self.hash_algo!r}")
        if self.hash_algo.startswith("xxhash") and self.hash_seed is None:
            raise ValueError(f"hash_algo {self.hash_algo!r} needs hash_seed: vLLM seeds it at random per process "
                             f"unless the worker runs with PYTHONHASHSEED; give that value")
        object.__setattr__(self, "_none_hash", self.hash_fn(self.hash_seed if self.hash_seed is not None
                                                            else DEFAULT_NONE_HASH_SEED))

    @property
    def hash_fn(self) -> Callable[[Any], bytes]:
        return _HASH_FNS[self.hash_algo]

    @property
    def none_hash(self) -> bytes:
        """The parent of the first block (vLLM's NONE_HASH)."""
        return self._none_hash


@dataclass(frozen=True)
class VllmRequestKeys:
    """What besides the tokens goes into a request's block hashes: its cache salt (block 0) and its LoRA adapter
    (every block), as the vLLM worker knows it: (name, path)."""

    cache_salt: str = ""
    lora: tuple[str, str] | None = None

    def for_block(self, index: int) -> tuple[tuple[str, ...], ...] | None:
        keys: list[tuple[str, ...]] = []
        if self.lora is not None:
            keys.append(("lora", *self.lora))
        if index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None


def vllm_block_hashes(config: VllmHashConfig, token_ids: Sequence[int],
                      keys: VllmRequestKeys = VllmRequestKeys()) -> list[bytes]:
    """vLLM's hash (the digest) of every full block of `token_ids`."""
    hash_fn, parent = config.hash_fn, config.none_hash
    bs = config.block_size
    hashes: list[bytes] = []
    for i, start in enumerate(range(0, len(token_ids) - bs + 1, bs)):
        parent = hash_fn((parent, tuple(token_ids[start:start + bs]), keys.for_block(i)))
        hashes.append(parent)
    return hashes


def event_key(h: BlockKey) -> int:
    """A vLLM block hash as the router indexes it: the low 64 bits, as vLLM folds a digest into an int
    (`maybe_convert_block_hash`), whether the event carried the digest or the int."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h), "big") & _LOW_64
    return int(h) & _LOW_64


def vllm_block_keys(config: VllmHashConfig, token_ids: Sequence[int],
                    keys: VllmRequestKeys = VllmRequestKeys()) -> list[int]:
    """The index keys of a request's blocks on a vLLM worker with `config`."""
    return [event_key(h) for h in vllm_block_hashes(config, token_ids, keys)]
