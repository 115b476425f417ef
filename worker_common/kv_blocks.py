"""The KV bridge between the engine's paged cache and the store / transfer bytes (DESIGN §1, §4).

    device cache --read_device_payloads--> raw payloads --codec.encode_into--> store / hand-off slots
    transfer / store bytes --codec.decode (verified)--> payload views --install_blocks--> device cache

A "payload" here is one block's span as the engine keeps it: the K/V values in the model dtype, or for a quantized
(fp8/int8) cache `scales | values` (engine/kv_cache.py), which the codec carries as its scales section followed by
its payload section, adjacent in the encoded block; so the span is one view of a verified block, never a copy.

Loading a cached prefix from the store tiers into the device cache is `worker_common/prefix_load.py`.

`install_blocks` makes pulled KV look computed: each block is written into a fresh device block, registered in the
block pool under its hash (the prefix index), and pinned by the worker until the request leaves, so the request's
own prefix match takes it and resumes right after it. It uses the pool's public API only (allocate, register,
touch, release); the pins are references no block table holds, so `BlockManager.check_integrity` counts them as
foreign while a request is being installed.
Engine-thread only (`install_blocks`, `read_device_payloads`); the rest is pure.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import numpy as np
import torch

from kvstore import codec
from kvstore.hashing import hash_blocks
from kvstore.store import TieredStore
from worker_common.engine_setup import EngineBundle


class InstallResult(NamedTuple):
    pinned: list[int]        # device block ids now referenced by the worker (release when the request leaves)
    num_blocks: int          # leading blocks of the request now in the device cache
    num_written: int         # of those, blocks written from payloads (the rest were already on the device)
    install_s: float = 0.0   # seconds writing them into the device cache


def slot_bytes(bundle: EngineBundle) -> int:
    """Bytes of one encoded block that carries its token ids."""
    layout, dtype = bundle.layout, bundle.kv_dtype
    return codec.encoded_size(layout.payload_bytes(dtype), layout.scale_bytes(dtype), bundle.block_size)


def read_device_payloads(bundle: EngineBundle, block_ids: Sequence[int]) -> np.ndarray:
    """Raw KV spans of device blocks, `[n, span_bytes]` uint8 (one batched gather)."""
    data = bundle.runner.read_blocks(list(block_ids))  # [n, layers, 2, block_size, kv_heads, head_dim] or [n, span]
    return data.contiguous().view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()


def encode_block(out: memoryview, bundle: EngineBundle, fingerprint: bytes, block_hash: bytes,
                 parent_hash: bytes | None, tokens: Sequence[int], payload: np.ndarray) -> int:
    """Encode one block span (`payload`, uint8 `[span_bytes]`): its scales, if any, go in the scales section."""
    span = memoryview(np.ascontiguousarray(payload)).cast("B")
    cut = bundle.layout.scale_bytes(bundle.kv_dtype)
    return codec.encode_into(out, fingerprint, block_hash, bundle.layout, bundle.kv_dtype, span[cut:],
                             scales=span[:cut], tokens=tokens, parent_hash=parent_hash)


def verified_payload(bundle: EngineBundle, data: memoryview, fingerprint: bytes, block_hash: bytes) -> memoryview:
    """The span (scales and payload sections) of an encoded block after every codec check, a view of `data`;
    raises `codec.CorruptBlock` (a block of another KV dtype is one: it is never installed)."""
    spans, failure = verified_payloads(bundle, [data], fingerprint, [block_hash])
    if failure is not None:
        raise failure
    return spans[0]


def verified_payloads(bundle: EngineBundle, views: Sequence[memoryview], fingerprint: bytes,
                      hashes: Sequence[bytes]) -> tuple[list[memoryview], codec.CorruptBlock | None]:
    """`verified_payload` of each block in turn, checked together (`codec.decode_many`): the spans of the leading
    blocks that pass, and why the next one failed (None when all passed)."""
    spans: list[memoryview] = []
    for block in codec.decode_many(views, fingerprint, hashes, bundle.layout):
        if isinstance(block, codec.CorruptBlock):
            return spans, block
        if block.header.dtype != bundle.kv_dtype:
            return spans, codec.CorruptBlock("dtype", f"block is {block.header.dtype}, this worker's KV is "
                                                      f"{bundle.kv_dtype}")
        spans.append(block.span)
    return spans, None


def zero_unused_slots(bundle: EngineBundle, payload: np.ndarray, num_tokens: int) -> None:
    """Zero the K/V values of slots `num_tokens..block_size-1` of one block span (uint8 `[span_bytes]`), in place:
    a partial block must not carry whatever request held the device block before. (A quantized block's scales
    stay: they cover only rows its own writes put there, and a fresh block's other slots are zeros already.)"""
    layers, bs = bundle.layout.num_layers, bundle.block_size
    values = payload[bundle.layout.scale_bytes(bundle.kv_dtype):]
    values.reshape(layers, 2, bs, -1)[:, :, num_tokens:] = 0


def device_prefix_blocks(bundle: EngineBundle, hashes: Sequence[bytes]) -> int:
    """Leading blocks the device prefix cache holds now (a hint from any thread: the answer may go stale)."""
    pool = bundle.engine.block_manager.pool
    for i, block_hash in enumerate(hashes):
        if pool.lookup(block_hash) is None:
            return i
    return len(hashes)


def install_blocks(bundle: EngineBundle, hashes: Sequence[bytes], payloads: Sequence[memoryview | None],
                   tokens: Sequence[int] | None = None, start: int = 0) -> InstallResult:
    """Pin the blocks `hashes[start:start + len(payloads)]` already on the device and write the given payloads for
    the others, in order, stopping at the first block that is neither (payload None and not on the device) or when
    no block is free. With the request's `tokens`, each newly written block is announced on `bundle.device_events`.
    Engine thread only."""
    started = time.perf_counter()
    pool = bundle.engine.block_manager.pool
    pinned: list[int] = []
    write_ids: list[int] = []
    write_at: list[int] = []  # which items of `payloads` the written blocks come from
    # NOTE: staged payloads say which items they hold without making a view of each (~4 us a block)
    present = getattr(payloads, "present", None) or (lambda i: payloads[i] is not None)
    for i in range(len(payloads)):
        block_hash = hashes[start + i]
        block_id = pool.lookup(block_hash)
        if block_id is not None:
            pool.touch([block_id])
        elif not present(i) or pool.num_free_blocks == 0:
            break
        else:
            block_id = pool.allocate()  # NOTE: pinned blocks have ref > 0, so this never evicts one of them
            write_ids.append(block_id)
            write_at.append(i)
        pinned.append(block_id)
    if write_ids:
        # NOTE: which free block takes which payload is free to choose: in ascending order, blocks freed together
        # (a flush, a finished request) come back as runs the cache copies as slices (`KVCache.write_blocks`)
        ascending = sorted(write_ids)
        if ascending != write_ids:
            for block_id, i in zip(ascending, write_at):
                pinned[i] = block_id
            write_ids = ascending
        gather = getattr(payloads, "gather", None)  # staged payloads: one strided view, no copy of their own
        try:
            data = gather(write_at) if gather else payload_tensor(bundle, [payloads[i] for i in write_at])
            bundle.runner.write_blocks(write_ids, data)
        except BaseException:
            pool.release(pinned)  # NOTE: nothing was registered: a block is indexed only once its KV is written
            raise
        for block_id, i in zip(write_ids, write_at):
            pool.register(block_id, hashes[start + i])
        _announce(bundle, hashes, start, pinned, set(write_ids), tokens)
    return InstallResult(pinned, len(pinned), len(write_ids), time.perf_counter() - started)


def _announce(bundle: EngineBundle, hashes: Sequence[bytes], start: int, block_ids: Sequence[int],
              written: set[int], tokens: Sequence[int] | None) -> None:
    events, bs = bundle.device_events, bundle.block_size
    if events is None or tokens is None:
        return
    for i, block_id in enumerate(block_ids, start=start):
        if block_id in written:
            events.on_block_stored(block_id, hashes[i], hashes[i - 1] if i else None,
                                   list(tokens[i * bs:(i + 1) * bs]))


def payload_tensor(bundle: EngineBundle, payloads: Sequence[memoryview]) -> torch.Tensor:
    """Verified block spans as one cache-shaped tensor `[n, *block_shape]` (`[n, layers, 2, block_size, kv_heads,
    head_dim]`, or uint8 `[n, span]` when quantized)."""
    size = bundle.span_bytes
    buf = bytearray(size * len(payloads))
    for i, payload in enumerate(payloads):
        buf[i * size:(i + 1) * size] = payload
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(bundle.torch_dtype).view(len(payloads), *bundle.block_shape)  # [n, layers, 2, bs, H, D]


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


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Leading full blocks a request of `num_tokens` can take from a cache: the last token is always computed."""
    return (num_tokens - 1) // block_size
