"""The KV bridge between the engine's paged cache and the store / transfer bytes (DESIGN §1, §4).

    device cache --read_device_payloads--> raw payloads --codec.encode_into--> store / hand-off slots
    transfer / store bytes --codec.decode (verified)--> payload views --install_blocks--> device cache

Loading a prefix from the store (`load_prefix`): one lookup (fastest tier first), one batched read of every
block straight into the rows of one staging tensor `[n, slot_bytes]` (each tier writes its blocks into their rows,
the shared tiers concurrently), verified in place, then installed with one `index_copy_` of the rows' payload
columns into the paged cache (`StagedPayloads.gather`): no per-block copies in Python.

`install_blocks` makes pulled KV look computed: each block is written into a fresh device block, registered in the
block pool under its hash (the prefix index), and pinned by the worker until the request leaves, so the request's
own prefix match takes it and resumes right after it. It uses the pool's public API only (allocate, register,
touch, release); the pins are references no block table holds, so `BlockManager.check_integrity` counts them as
foreign while a request is being installed.
Engine-thread only (`install_blocks`, `read_device_payloads`); the rest is pure.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from kvstore import codec
from kvstore.hashing import hash_blocks
from kvstore.store import TieredStore
from worker_common.engine_setup import EngineBundle
from worker_common.staging import StagingPool


class InstallResult(NamedTuple):
    pinned: list[int]        # device block ids now referenced by the worker (release when the request leaves)
    num_blocks: int          # leading blocks of the request now in the device cache
    num_written: int         # of those, blocks written from payloads (the rest were already on the device)
    install_s: float = 0.0   # seconds writing them into the device cache


class StagedPayloads(Sequence):
    """Verified payloads of consecutive blocks held in the rows of one staging tensor: item i is None for the
    `lead` blocks already on the device, then the payload of row `i - lead`."""

    def __init__(self, bundle: EngineBundle, staging: torch.Tensor, offset: int, count: int, lead: int) -> None:
        self._bundle, self._staging, self._offset = bundle, staging, offset  # staging: uint8 [rows, slot_bytes]
        self._count, self._lead = count, lead

    def __len__(self) -> int:
        return self._lead + self._count

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        if i < self._lead:
            return None
        return memoryview(self._rows()[i - self._lead].numpy())

    def __iter__(self) -> Iterator[memoryview | None]:
        return (self[i] for i in range(len(self)))

    def _rows(self) -> torch.Tensor:
        size = self._bundle.layout.payload_bytes(self._bundle.kv_dtype)
        return self._staging[:self._count, self._offset:self._offset + size]  # uint8 [count, payload_bytes]

    def gather(self, indices: Sequence[int]) -> torch.Tensor:
        """Cache-shaped payloads `[n, layers, 2, block_size, kv_heads, head_dim]` of items `indices`: a view of the
        staging rows when they are consecutive (the usual case: no copy before the cache's own), else one copy."""
        rows = [i - self._lead for i in indices]
        start = rows[0] if rows else 0
        if rows == list(range(start, start + len(rows))):
            picked = self._rows()[start:start + len(rows)]  # uint8 [n, payload_bytes], rows strided by a slot
        else:
            picked = self._rows().index_select(0, torch.as_tensor(rows, dtype=torch.long))
        return picked.view(self._bundle.torch_dtype).view(len(indices), *self._bundle.block_shape)


class LoadedPrefix(NamedTuple):
    payloads: Sequence[memoryview | None]  # what `install_blocks` takes: None = on the device, else a payload
    by_tier: dict[str, int]                # blocks each tier served ("device" for those already there)
    lookup_s: float
    read_s: float
    verify_s: float
    release: Callable[[], None] = lambda: None  # call once installed: the payloads' staging serves the next load


STAGING = StagingPool()  # this worker's staging buffers for prefix loads


def slot_bytes(bundle: EngineBundle) -> int:
    """Bytes of one encoded block that carries its token ids."""
    return codec.encoded_size(bundle.layout.payload_bytes(bundle.kv_dtype), 0, bundle.block_size)


def read_device_payloads(bundle: EngineBundle, block_ids: Sequence[int]) -> np.ndarray:
    """Raw KV of device blocks, `[n, payload_bytes]` uint8 (one batched gather)."""
    data = bundle.runner.read_blocks(list(block_ids))  # [n, layers, 2, block_size, kv_heads, head_dim]
    return data.contiguous().view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()


def encode_block(out: memoryview, bundle: EngineBundle, fingerprint: bytes, block_hash: bytes,
                 parent_hash: bytes | None, tokens: Sequence[int], payload: np.ndarray) -> int:
    return codec.encode_into(out, fingerprint, block_hash, bundle.layout, bundle.kv_dtype, memoryview(payload),
                             tokens=tokens, parent_hash=parent_hash)


def verified_payload(bundle: EngineBundle, data: memoryview, fingerprint: bytes, block_hash: bytes) -> memoryview:
    """The payload of an encoded block after every codec check; raises `codec.CorruptBlock`."""
    block = codec.decode(data, fingerprint, block_hash, bundle.layout)
    if block.header.dtype != bundle.kv_dtype:
        raise codec.CorruptBlock("dtype", f"block is {block.header.dtype}, this worker's KV is {bundle.kv_dtype}")
    return block.payload


def device_prefix_blocks(bundle: EngineBundle, hashes: Sequence[bytes]) -> int:
    """Leading blocks the device prefix cache holds now (a hint from any thread: the answer may go stale)."""
    pool = bundle.engine.block_manager.pool
    for i, block_hash in enumerate(hashes):
        if pool.lookup(block_hash) is None:
            return i
    return len(hashes)


def install_blocks(bundle: EngineBundle, hashes: Sequence[bytes], payloads: Sequence[memoryview | None],
                   tokens: Sequence[int] | None = None) -> InstallResult:
    """Pin the leading blocks already on the device and write the given payloads for the others, in order,
    stopping at the first block that is neither (payload None and not on the device) or when no block is free.
    With the request's `tokens`, each newly written block is announced on `bundle.device_events`.
    Engine thread only."""
    started = time.perf_counter()
    pool = bundle.engine.block_manager.pool
    pinned: list[int] = []
    write_ids: list[int] = []
    write_at: list[int] = []  # which items of `payloads` the written blocks come from
    for i, (block_hash, payload) in enumerate(zip(hashes, payloads)):
        block_id = pool.lookup(block_hash)
        if block_id is not None:
            pool.touch([block_id])
        elif payload is None or pool.num_free_blocks == 0:
            break
        else:
            block_id = pool.allocate()  # NOTE: pinned blocks have ref > 0, so this never evicts one of them
            pool.register(block_id, block_hash)
            write_ids.append(block_id)
            write_at.append(i)
        pinned.append(block_id)
    if write_ids:
        data = (payloads.gather(write_at) if isinstance(payloads, StagedPayloads)
                else payload_tensor(bundle, [payloads[i] for i in write_at]))
        bundle.runner.write_blocks(write_ids, data)
        _announce(bundle, hashes, pinned, set(write_ids), tokens)
    return InstallResult(pinned, len(pinned), len(write_ids), time.perf_counter() - started)


def _announce(bundle: EngineBundle, hashes: Sequence[bytes], block_ids: Sequence[int], written: set[int],
              tokens: Sequence[int] | None) -> None:
    events, bs = bundle.device_events, bundle.block_size
    if events is None or tokens is None:
        return
    for i, block_id in enumerate(block_ids):
        if block_id in written:
            events.on_block_stored(block_id, hashes[i], hashes[i - 1] if i else None,
                                   list(tokens[i * bs:(i + 1) * bs]))


def payload_tensor(bundle: EngineBundle, payloads: Sequence[memoryview]) -> torch.Tensor:
    """Verified block payloads as one cache-shaped tensor `[n, layers, 2, block_size, kv_heads, head_dim]`."""
    size = bundle.layout.payload_bytes(bundle.kv_dtype)
    buf = bytearray(size * len(payloads))
    for i, payload in enumerate(payloads):
        buf[i * size:(i + 1) * size] = payload
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(bundle.torch_dtype).view(len(payloads), *bundle.block_shape)  # [n, layers, 2, bs, H, D]


def load_from_store(bundle: EngineBundle, store: TieredStore, hashes: Sequence[bytes],
                    fingerprint: bytes, lead: int = 0, expect: int = 0, pool: StagingPool | None = None) -> LoadedPrefix:
    """Verified payloads of the leading blocks any tier of `store` holds (possibly none), after `lead` Nones.
    `expect`: how many of `hashes` the router's index says some tier holds (`TieredStore.lookup`). With a `pool`,
    the payloads live in one of its buffers until the caller calls `release` (after installing them)."""
    started = time.perf_counter()
    found = store.lookup(list(hashes), expect=expect) if hashes else None
    lookup_s = time.perf_counter() - started
    if not found or not found.num_hit_blocks:
        return LoadedPrefix([None] * lead, {"device": lead} if lead else {}, lookup_s, 0.0, 0.0)
    n = found.num_hit_blocks
    if pool is not None:
        staging, release = pool.acquire(n, slot_bytes(bundle))  # one row per block
    else:
        staging, release = torch.empty((n, slot_bytes(bundle)), dtype=torch.uint8), (lambda: None)
    rows = staging.numpy()
    result = store.get(list(hashes[:n]), [memoryview(rows[i]) for i in range(n)], fingerprint, hint=found.tiers)
    count = result.num_hit_blocks
    blocks = result.blocks[:count]
    offsets = {_payload_offset(b, rows[i]) for i, b in enumerate(blocks)}
    dtype_ok = all(b.header.dtype == bundle.kv_dtype for b in blocks)
    if count and (len(offsets) != 1 or not dtype_ok):  # mixed encodings: rare; keep only what is uniform
        count = _uniform_run(bundle, blocks, rows)
    by_tier = {"device": lead} if lead else {}
    for tier in result.tiers[:count]:
        by_tier[tier] = by_tier.get(tier, 0) + 1
    offset = offsets.pop() if count else 0
    payloads = StagedPayloads(bundle, staging, offset, count, lead)
    return LoadedPrefix(payloads, by_tier, lookup_s, result.read_s, result.verify_s, release)


def _payload_offset(block: codec.DecodedBlock, row: np.ndarray) -> int:
    return np.frombuffer(block.payload, dtype=np.uint8).ctypes.data - row.ctypes.data


def _uniform_run(bundle: EngineBundle, blocks: list, rows: np.ndarray) -> int:
    """Leading blocks with this worker's dtype and the first block's payload offset."""
    first = _payload_offset(blocks[0], rows[0])
    for i, block in enumerate(blocks):
        if block.header.dtype != bundle.kv_dtype or _payload_offset(block, rows[i]) != first:
            return i
    return len(blocks)


def store_computed_blocks(bundle: EngineBundle, store: TieredStore, token_ids: Sequence[int],
                          fingerprint: bytes, start: int = 0) -> int:
    """Write the full, computed blocks of a just-finished request (prompt + outputs; the last sampled token has no
    KV) from block `start` on that the host tier lacks, so the next turn of the conversation hits (DESIGN §2 step
    5). Engine thread, right after the step that finished the request; blocks no longer on the device are skipped.
    Returns how many were written."""
    bs = bundle.block_size
    hashes = hash_blocks(fingerprint, token_ids, bs)[:cacheable_blocks(len(token_ids), bs)]
    held = store.host.contains(hashes[start:])
    missing = [start + i for i, present in enumerate(held) if not present]
    pool = bundle.engine.block_manager.pool
    present = [(i, pool.lookup(hashes[i])) for i in missing]
    present = [(i, block_id) for i, block_id in present if block_id is not None]
    if not present:
        return 0
    payloads = read_device_payloads(bundle, [block_id for _, block_id in present])
    items = []
    for (i, _), payload in zip(present, payloads):
        out = bytearray(slot_bytes(bundle))
        n = encode_block(memoryview(out), bundle, fingerprint, hashes[i], hashes[i - 1] if i else None,
                         token_ids[i * bs:(i + 1) * bs], payload)
        items.append((hashes[i], memoryview(out)[:n]))
    return store.put(items).stored


def load_prefix(bundle: EngineBundle, store: TieredStore, hashes: Sequence[bytes], fingerprint: bytes,
                plan: Any = None) -> LoadedPrefix:
    """What `install_blocks` needs for a prompt's cacheable blocks: None for the leading blocks the device holds,
    then verified payloads of the next ones any store tier holds, in a pooled staging buffer: call the result's
    `release` once they are installed (never before: the next load overwrites it). `plan`: the router's request
    (`PrefillRequest` / `WorkerGenerateRequest`): load at most `max_load_blocks` leading blocks when set (loading
    more was found slower than recomputing them; blocks already on the device cost nothing and are always used),
    and expect `expected_cached_blocks` to be stored somewhere (a shared tier's cached index that knows fewer is
    refreshed)."""
    on_device = device_prefix_blocks(bundle, hashes)
    expect = 0
    if plan is not None:
        if plan.HasField("max_load_blocks"):
            hashes = hashes[:max(plan.max_load_blocks, on_device)]
        expect = max(0, min(plan.expected_cached_blocks, len(hashes)) - on_device)
    return load_from_store(bundle, store, hashes[on_device:], fingerprint, lead=on_device, expect=expect,
                           pool=STAGING)


def fill_load_timings(timings, loaded: LoadedPrefix, installed: InstallResult) -> None:
    """The onboarding breakdown of a `common_pb2.Timings`: lookup, read, verify, install, blocks per tier."""
    timings.load_lookup_ms = loaded.lookup_s * 1e3
    timings.load_read_ms = loaded.read_s * 1e3
    timings.load_verify_ms = loaded.verify_s * 1e3
    timings.load_install_ms = installed.install_s * 1e3
    for tier, n in loaded.by_tier.items():
        timings.blocks_by_tier[tier] = n


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks a request of `num_tokens` can take from a cache: the last token is always computed."""
    return (num_tokens - 1) // block_size
