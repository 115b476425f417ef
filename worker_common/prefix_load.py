"""Onboarding a cached prefix from the store tiers into the device cache (DESIGN §2 step 3), pipelined.

    lookup (fastest tier first)        -> n blocks, the tier of each
    staging = pool.acquire(n rows)     one row per encoded block, pages warm (worker_common/staging.py)
    every chunk of CHUNK_BLOCKS rows in flight at once (one chunk of all rows when host serves every block):
        get: the tiers write straight into the rows (shared tiers concurrently), the codec verifies each in place
    for each chunk, in order, as it lands:
        on_chunk(start, payloads)      -> ChunkInstaller posts the install of these rows to the engine thread and
                                          returns: later chunks are still being read while the engine copies it
    admit(every payload)               -> blocks already installed are found on the device and pinned; any a
                                          chunk install missed is written now; then the request joins the engine
    installer.finish(), release()      -> the chunks' own pins dropped, the staging rows back to the pool

An install writes all its rows from a strided view of the staging rows (`KVCache.write_blocks`)
(`StagedPayloads.gather`), no per-block copies in Python. What it copies from each row is the block's span: the
codec's scales section (empty unless the KV is quantized) and its payload, adjacent:

    row:  | header | tokens | scales | payload | (slack) |
                            ^ offset: where every row's span starts (one layout for the whole run)
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from engine.kv_cache import gather_rows
from kvstore.store import TieredStore
from worker_common.engine_loop import EngineLoop
from worker_common.engine_setup import EngineBundle
from worker_common.kv_blocks import InstallResult, device_prefix_blocks, install_blocks, slot_bytes
from worker_common.staging import StagingPool

CHUNK_BLOCKS = 32   # rows read before their install is handed to the engine thread
_READS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="strata-prefix-read")  # a load's later chunks
STAGING = StagingPool()  # this worker's staging buffers for prefix loads

OnChunk = Callable[[int, "StagedPayloads"], None]


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
        return memoryview(self._spans([i - self._lead])[0].numpy())

    def __iter__(self) -> Iterator[memoryview | None]:
        return (self[i] for i in range(len(self)))

    def present(self, i: int) -> bool:
        """Whether item i (0 <= i < len) is a payload, not one of the `lead` Nones: `self[i] is not None`, cheaply."""
        return i >= self._lead

    def _where(self, rows: list[int]) -> list[int]:
        """The rows of `self._staging` that hold payloads `rows` (0 = the first after the lead)."""
        return rows

    def _spans(self, rows: list[int]) -> torch.Tensor:
        """uint8 `[n, span_bytes]`: the spans of payloads `rows`, a strided view when they lie in consecutive rows
        (the usual case: no copy before the cache's own), else one copy."""
        where = self._where(rows)
        span = slice(self._offset, self._offset + self._bundle.span_bytes)
        start = where[0] if where else 0
        if where == list(range(start, start + len(where))):
            return self._staging[start:start + len(where), span]
        return gather_rows(self._staging, where)[:, span]

    def gather(self, indices: Sequence[int]) -> torch.Tensor:
        """Cache-shaped payloads `[n, *block_shape]` of items `indices` (`_spans`)."""
        picked = self._spans([i - self._lead for i in indices])
        return picked.view(self._bundle.torch_dtype).view(len(indices), *self._bundle.block_shape)


class LentPayloads(StagedPayloads):
    """Verified payloads in the host tier's own slots, lent (`TieredStore.borrow_host`): no copy before the cache's
    own. Payload r lies in slot `slots[r]` of `slot_rows` (uint8 `[num_slots, slot_bytes]`, the whole tier)."""

    def __init__(self, bundle: EngineBundle, slot_rows: torch.Tensor, slots: Sequence[int], offset: int,
                 lead: int) -> None:
        super().__init__(bundle, slot_rows, offset, len(slots), lead)
        self._slots = list(slots)

    def _where(self, rows: list[int]) -> list[int]:
        return [self._slots[r] for r in rows]


class LoadedPrefix(NamedTuple):
    payloads: Sequence[memoryview | None]  # what `install_blocks` takes: None = on the device, else a payload
    by_tier: dict[str, int]                # blocks each tier served ("device" for those already there)
    lookup_s: float
    read_s: float
    verify_s: float
    release: Callable[[], None] = lambda: None  # call once installed: the payloads' staging serves the next load


class ChunkInstaller:
    """`on_chunk` for `load_prefix`: installs each loaded chunk on the engine thread while the next one is read.
    Its blocks stay pinned until `finish`, posted after the request's admission (which pins them again)."""

    def __init__(self, loop: EngineLoop, hashes: Sequence[bytes], tokens: Sequence[int]) -> None:
        self._loop, self._hashes, self._tokens = loop, hashes, tokens
        self._futures: list[Future] = []

    @property
    def handed(self) -> int:
        """Chunks handed to the engine thread so far."""
        return len(self._futures)

    def __call__(self, start: int, payloads: StagedPayloads) -> None:
        bundle, hashes, tokens = self._loop.bundle, self._hashes, self._tokens
        self._futures.append(self._loop.post(lambda: install_blocks(bundle, hashes, payloads, tokens, start)))

    def done(self) -> list[InstallResult]:
        """The chunk installs that ran (call after the admission: the engine thread runs commands in order)."""
        return [f.result() for f in self._futures if f.done() and f.exception() is None]

    def finish(self) -> None:
        """Drop the chunks' pins, on the engine thread after the admission (a failed chunk pinned nothing)."""
        pins = [block for result in self.done() for block in result.pinned]
        if pins:
            pool = self._loop.bundle.engine.block_manager.pool
            self._loop.post(lambda: pool.release(pins))

    def install_s(self) -> float:
        return sum(result.install_s for result in self.done())


def load_prefix(bundle: EngineBundle, store: TieredStore, hashes: Sequence[bytes], fingerprint: bytes,
                plan: Any = None, on_chunk: OnChunk | None = None) -> LoadedPrefix:
    """What `install_blocks` needs for a prompt's cacheable blocks: None for the leading blocks the device holds,
    then verified payloads of the next ones any store tier holds (in the host tier's slots when host holds them
    all, else in a pooled staging buffer): call the result's `release` once they are installed (never before: the
    slots or the buffer serve the next load). `plan`: the router's request (`PrefillRequest` /
    `WorkerGenerateRequest`): load at most `max_load_blocks` leading blocks when set (loading more was found slower
    than recomputing them; blocks already on the device cost nothing and are always used), and expect
    `expected_cached_blocks` to be stored somewhere (a shared tier's cached index that knows fewer is refreshed;
    set, the shared tiers are not asked about the blocks after them). `on_chunk(start, payloads)`: called as each
    chunk of rows is verified (a `ChunkInstaller`)."""
    on_device = device_prefix_blocks(bundle, hashes)
    expect, shared_upto = 0, None
    if plan is not None:
        if plan.HasField("max_load_blocks"):
            hashes = hashes[:max(plan.max_load_blocks, on_device)]
        expect = max(0, min(plan.expected_cached_blocks, len(hashes)) - on_device)
        shared_upto = expect if plan.HasField("expected_cached_blocks") else None
    return load_from_store(bundle, store, hashes[on_device:], fingerprint, lead=on_device, expect=expect,
                           pool=STAGING, on_chunk=on_chunk, borrow=True, shared_upto=shared_upto)


def load_from_store(bundle: EngineBundle, store: TieredStore, hashes: Sequence[bytes], fingerprint: bytes,
                    lead: int = 0, expect: int = 0, pool: StagingPool | None = None,
                    on_chunk: OnChunk | None = None, borrow: bool = False,
                    shared_upto: int | None = None) -> LoadedPrefix:
    """Verified payloads of the leading blocks any tier of `store` holds (possibly none), after `lead` Nones.
    `expect`: how many of `hashes` the router's index says some tier holds (`TieredStore.lookup`). With a `pool`,
    the payloads live in one of its buffers until the caller calls `release` (after installing them). With
    `on_chunk`, when some block comes from a tier below host, blocks are read `CHUNK_BLOCKS` at a time and each
    verified chunk is handed over at once (its `start` counts the `lead` blocks). `borrow`: when host serves every
    block, the payloads are the host tier's own slots, lent until `release` (`TieredStore.borrow_host`), not
    copies (the caller installs them, then releases). `shared_upto`: `TieredStore.lookup`'s."""
    started = time.perf_counter()
    found = store.lookup(list(hashes), expect=expect, shared_upto=shared_upto) if hashes else None
    lookup_s = time.perf_counter() - started
    if not found or not found.num_hit_blocks:
        return _device_only(lead, lookup_s)
    n = found.num_hit_blocks
    if borrow and all(tier == "host" for tier in found.tiers):
        lent = _lend_from_host(bundle, store, hashes[:n], fingerprint, lead, lookup_s)
        if lent is not None:
            return lent
    if pool is not None:
        staging, release = pool.acquire(n, slot_bytes(bundle))  # one row per block
    else:
        staging, release = torch.empty((n, slot_bytes(bundle)), dtype=torch.uint8), (lambda: None)
    rows = staging.numpy()
    views = [memoryview(rows[i]) for i in range(n)]
    served: list[str] = []
    offset: int | None = None
    read_s = verify_s = 0.0
    # Pipelined only when some block comes from below host: a host read runs at memory speed, so there is little
    # to overlap and each extra install call costs the engine thread (measured: 124 host blocks installed in four
    # chunks 5.7 ms, in one 2.3-2.9 ms).
    if not any(tier != "host" for tier in found.tiers):
        on_chunk = None  # the admission installs them all at once
    step = CHUNK_BLOCKS if on_chunk is not None else n
    starts = list(range(0, n, step))

    def read(start: int):
        end = min(n, start + step)
        return store.get(list(hashes[start:end]), views[start:end], fingerprint, hint=found.tiers[start:end])

    # Every chunk is in flight at once (each of a shared tier's requests costs a round trip; they overlap), and
    # each is handed on in order as it lands, so the first chunks install while later ones are still read.
    reading = time.perf_counter()
    later = [_READS.submit(read, start) for start in starts[1:]]
    try:
        for start, pending in zip(starts, [None, *later]):
            end = min(n, start + step)
            result = read(start) if pending is None else pending.result()
            verify_s += result.verify_s
            blocks = result.blocks[:result.num_hit_blocks]
            offset = offset if offset is not None or not blocks else blocks[0].header.span_start
            good = _uniform_run(bundle, blocks, offset)
            served += result.tiers[:good]
            if good and on_chunk is not None:
                on_chunk(lead + start, StagedPayloads(bundle, staging[start:start + good], offset, good, 0))
            if good < end - start:
                break
    finally:
        wait(later)  # NOTE: a chunk still being read writes into `staging`: never release it before
    read_s = time.perf_counter() - reading - verify_s
    by_tier = {"device": lead} if lead else {}
    for tier in served:
        by_tier[tier] = by_tier.get(tier, 0) + 1
    payloads = StagedPayloads(bundle, staging, offset or 0, len(served), lead)
    return LoadedPrefix(payloads, by_tier, lookup_s, read_s, verify_s, release)


def _lend_from_host(bundle: EngineBundle, store: TieredStore, hashes: Sequence[bytes], fingerprint: bytes,
                    lead: int, lookup_s: float) -> LoadedPrefix | None:
    """`load_from_store`'s payloads when host holds every block: verified where they lie, lent until `release`
    (no copy: a 124-block host hit read 1.0-1.2 ms into staging before its install). None when the host tier does
    not lend. A block gone since the lookup (evicted meanwhile) ends the run: the engine computes the rest."""
    host = store.borrow_host(hashes, fingerprint)
    if host is None:
        return None
    offset = host.blocks[0].header.span_start if host.blocks else 0
    good = _uniform_run(bundle, host.blocks, offset)
    if not good:
        host.release()
        return _device_only(lead, lookup_s, host.read_s, host.verify_s)
    slot_rows = torch.frombuffer(host.rows, dtype=torch.uint8).view(-1, host.row_bytes)
    by_tier = {"device": lead, "host": good} if lead else {"host": good}
    return LoadedPrefix(LentPayloads(bundle, slot_rows, host.slots[:good], offset, lead), by_tier, lookup_s,
                        host.read_s, host.verify_s, host.release)


def _device_only(lead: int, lookup_s: float, read_s: float = 0.0, verify_s: float = 0.0) -> LoadedPrefix:
    """Nothing loaded from the store: the `lead` blocks on the device, if any."""
    return LoadedPrefix([None] * lead, {"device": lead} if lead else {}, lookup_s, read_s, verify_s)


def _uniform_run(bundle: EngineBundle, blocks: list, offset: int | None) -> int:
    """Leading blocks in this worker's dtype whose span sits at `offset` in its row (one layout for all). A block of
    another KV dtype ends the run: it is never installed, and its tokens are recomputed. `TieredStore.get` decodes
    each block from the start of its row, so its span sits at its header's `span_start`."""
    for i, block in enumerate(blocks):
        if block.header.dtype != bundle.kv_dtype or block.header.span_start != offset:
            return i
    return len(blocks)


def fill_load_timings(timings, loaded: LoadedPrefix, installed: InstallResult, chunks_install_s: float = 0.0) -> None:
    """The onboarding breakdown of a `common_pb2.Timings`: lookup, read, verify, install, blocks per tier."""
    timings.load_lookup_ms = loaded.lookup_s * 1e3
    timings.load_read_ms = loaded.read_s * 1e3
    timings.load_verify_ms = loaded.verify_s * 1e3
    timings.load_install_ms = (installed.install_s + chunks_install_s) * 1e3
    for tier, n in loaded.by_tier.items():
        timings.blocks_by_tier[tier] = n
