"""TieredStore (DESIGN §5): one content-addressed view over host → disk → redis → s3.

- `lookup(hashes)`: which tier serves each leading block, asking the fastest tier first and a slower tier only
  about the blocks still missing; the shared tiers (redis, s3) are asked concurrently under `lookup_timeout_s`, so
  a host hit costs a host lookup whatever else is configured.
- `get(hashes, bufs, fingerprint, hint)`: each block from the tier `hint` names (the lookup's answer), shared tiers
  read concurrently, then from any other tier for what is still missing; verified by the codec. A bad copy is a
  counted checksum failure, deleted, and a slower tier may still serve the block. Hits below host are promoted.
- `put(items)`: host synchronously (a memcpy); the lower tiers owe the block a write, done in the background by
  `WriteBehind` (no bytes queued for a write-through: they are read back from host; coalesced, retried, and a
  write that cannot happen is counted as `dropped`, never lost silently).
- Eviction from a tier demotes the block into the next tier below (policy "next").
- Every tier call goes through `_call`: a tier whose reads or writes fail is skipped for that kind of call until its
  backoff passes, and counted; serving goes on with the other tiers.
"""
from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from kvstore import codec
from kvstore.config import StoreConfig
from kvstore.hashing import BlockHash
from kvstore.sealing import SealedTier, Sealer, load_key
from kvstore.store_events import EventSink
from kvstore.store_policy import TierHealth
from kvstore.tiers.base import TIER_REGISTRY, Tier, TierFull, TierStats, TierUnavailable
from kvstore.write_behind import WriteBehind

log = logging.getLogger(__name__)

_STORE_COUNTERS = ("promotions", "demotions", "checksum_failures", "dropped", "skipped", "errors")
SHARED_TIERS = ("redis", "s3")  # asked concurrently, under a deadline


class LookupResult(NamedTuple):
    num_hit_blocks: int  # leading blocks that some tier holds
    tiers: tuple[str, ...]  # for each of those blocks, the fastest tier that holds it (of those asked)
    per_tier: dict[str, int]  # leading blocks each tier serves (0 for a tier that serves none or was not asked)


class GetResult(NamedTuple):
    num_hit_blocks: int  # leading blocks read and verified
    tiers: list[str | None]  # per key: the tier that served it, None for a miss
    blocks: list[codec.DecodedBlock | None]  # per key: verified zero-copy views into the caller's buffer
    read_s: float = 0.0  # wall seconds reading (all tiers)
    verify_s: float = 0.0  # seconds verifying the codec (summed over blocks)


class HostBlocks(NamedTuple):
    """`TieredStore.borrow_host`: the leading blocks host holds, verified where they lie in shared memory."""

    blocks: list[codec.DecodedBlock]  # verified zero-copy views into the host tier's slots
    slots: list[int]                  # each block's slot: a row of `rows`
    rows: memoryview                  # every slot's bytes, `row_bytes` a slot (`HostTier.slot_rows()`)
    row_bytes: int
    release: Callable[[], None]       # call once the blocks are used: their slots may be reused after it
    read_s: float = 0.0
    verify_s: float = 0.0


class PutResult(NamedTuple):
    stored: int  # blocks now in host (new or already there)
    queued: int  # lower-tier writes now owed in the background
    dropped: int  # lower-tier writes refused (bound reached); counted as `dropped` on the tier


def build_tier(name: str, options: dict) -> Tier:
    """Instantiate the tier registered under `name` (importing `kvstore.tiers.<name>` on first use)."""
    if name not in TIER_REGISTRY:
        importlib.import_module(f"kvstore.tiers.{name}")
    return TIER_REGISTRY[name](**options)


class TieredStore:
    def __init__(self, config: StoreConfig, publisher: Any | None = None, *, tiers: dict[str, Tier] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`tiers` (fastest first, host first) overrides building them from `config`; `clock` drives backoff."""
        self.config = config
        self._tiers = tiers if tiers is not None else {n: build_tier(n, config.tier_options(n))
                                                        for n in config.tier_names()}
        self._tiers = _sealed(self._tiers, config.encryption_key_file)
        self._names = list(self._tiers)
        if not self._names or self._names[0] != "host":
            raise ValueError(f"the first tier must be 'host', got {self._names}")
        self._health = {(n, op): TierHealth(config.backoff_initial_s, config.backoff_max_s, clock)
                        for n in self._names for op in ("read", "write")}
        self._counters = {n: dict.fromkeys(_STORE_COUNTERS, 0) for n in self._names}
        self._counter_lock = threading.Lock()
        self._events = EventSink(publisher)
        self._stages = _lookup_stages(self._names)
        shared = sum(n in SHARED_TIERS for n in self._names)
        self._io = ThreadPoolExecutor(max(1, shared), thread_name_prefix="strata-store-io") if shared else None
        for name, tier in self._tiers.items():
            tier.eviction_wants_data = self._below(name) is not None and (
                config.demotion == "next" or bool(config.write_through))
            tier.eviction_listener = lambda key, data, name=name: self._on_evict(name, key, data)
            if isinstance(tier, SealedTier):  # a copy that does not open was counted and deleted by the tier
                tier.bad_copy_listener = lambda key, name=name: self._events.removed(name, [key])
        self._in_hand, self._in_hand_lock = 0, threading.Lock()      # `writing`
        self._writer = WriteBehind(self._read_back, self._write_tier, self._dropped,
                                   max_entries=config.max_pending_writes, max_data_entries=config.queue_depth,
                                   retry_s=config.backoff_initial_s, max_attempts=config.write_attempts,
                                   clock=clock)

    @property
    def host(self) -> Tier:
        return self._tiers["host"]

    def tier(self, name: str) -> Tier:
        return self._tiers[name]

    # Lookup and get -----------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], expect: int = 0, shared_upto: int | None = None) -> LookupResult:
        """Fastest tier first; each later stage is asked only about the blocks no faster tier holds.
        `expect`: leading blocks someone else (the router, from every worker's KV events) knows are stored. When
        fewer are found, the shared tiers that answer from a cached index (S3) refresh it once and are asked again:
        another worker wrote them after this one last looked. `shared_upto`: the shared tiers are asked about the
        first this many blocks only (the router's index knows of no copy of the others; asking costs a network
        round trip); None = about every block."""
        serving: list[str | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        for stage in self._stages:
            if shared_upto is not None and any(n in SHARED_TIERS for n in stage):
                pending = [i for i in pending if i < shared_upto]
            # NOTE: with blocks expected, a tier with a cached index answers from it as it stands (`known`): a
            # periodic refresh started now would compete with the targeted update below for the same server
            pending = self._resolve(stage, hashes, pending, serving, "known" if expect else "contains")
        leading = _leading(serving)
        if leading < min(expect, len(hashes)):
            upto = len(hashes) if shared_upto is None else min(shared_upto, len(hashes))
            if self._refresh_shared([hashes[i] for i in range(min(expect, upto)) if serving[i] is None]):
                self._resolve(self._stages[-1], hashes, [i for i in range(upto) if serving[i] is None], serving)
                leading = _leading(serving)
        tiers = tuple(serving[:leading])
        return LookupResult(leading, tiers, {n: tiers.count(n) for n in self._names})

    def _resolve(self, stage: tuple[str, ...], hashes: Sequence[BlockHash], pending: list[int],
                 serving: list[str | None], method: str = "contains") -> list[int]:
        """Ask `stage` about the `pending` blocks (`method`, or `contains` where a tier lacks it), fill in
        `serving`; the indices still missing."""
        if not pending:
            return pending
        answers = self._ask(stage, method, [hashes[i] for i in pending])
        for name in stage:  # stage order is fastest first
            for i, p in zip(pending, answers.get(name) or ()):
                if p and serving[i] is None:
                    serving[i] = name
        return [i for i in pending if serving[i] is None]

    def _refresh_shared(self, wanted: Sequence[BlockHash]) -> bool:
        """Update the cached index of every shared tier that keeps one, for the `wanted` blocks (`learn` where the
        tier has it: it reads only what may hold them; else `refresh_index`); whether any did."""
        refreshed = False
        for name in self._names:
            tier = self._tiers[name]
            learn, refresh = getattr(tier, "learn", None), getattr(tier, "refresh_index", None)
            if name not in SHARED_TIERS or refresh is None:
                continue
            update = functools.partial(learn, wanted) if learn is not None else refresh
            refreshed = self._call(name, "read", lambda update=update: update() or True) or refreshed
        return refreshed

    def _ask(self, stage: tuple[str, ...], method: str, *args: Any) -> dict[str, Any]:
        """`method(*args)` on each tier of a stage (shared tiers concurrently, under `lookup_timeout_s`); a tier
        that failed, was skipped or did not answer in time is absent from the answer."""
        def call(name: str) -> Callable:
            tier = self._tiers[name]
            return getattr(tier, method, None) or tier.contains  # NOTE: "known" falls back to "contains"

        if self._io is None or not any(n in SHARED_TIERS for n in stage):
            out = {n: self._call(n, "read", call(n), *args) for n in stage}
            return {n: v for n, v in out.items() if v is not None}
        futures = {n: self._io.submit(self._call, n, "read", call(n), *args) for n in stage}
        wait(futures.values(), timeout=self.config.lookup_timeout_s)
        out = {}
        for name, future in futures.items():
            if not future.done():
                log.warning("%s tier: %s did not answer within %.2fs; treated as a miss", name, method,
                            self.config.lookup_timeout_s)
                self._count(name, skipped=1)
            elif future.result() is not None:
                out[name] = future.result()
        return out

    def get(self, hashes: Sequence[BlockHash], bufs: Sequence[memoryview | bytearray], fingerprint: bytes,
            hint: Sequence[str | None] | None = None) -> GetResult:
        """Read and verify blocks into `bufs` (each at least the encoded block size). `hint` (a lookup's `tiers`)
        says which tier to read each leading block from first; without it every tier is tried, fastest first."""
        if len(hashes) != len(bufs):
            raise ValueError(f"got {len(hashes)} hashes but {len(bufs)} buffers")
        started = time.perf_counter()
        views = [memoryview(b).cast("B") for b in bufs]
        served: list[str | None] = [None] * len(hashes)
        blocks: list[codec.DecodedBlock | None] = [None] * len(hashes)
        verify_s = [0.0]
        if hint:
            self._get_hinted(hashes, views, fingerprint, hint, served, blocks, verify_s)
        tried = [hint[i] if hint and i < len(hint) else None for i in range(len(hashes))]
        for name in self._names:  # what is still missing, from every tier not asked for it yet
            pending = [i for i, t in enumerate(served) if t is None and tried[i] != name]
            if not pending:
                break
            self._get_from(name, hashes, views, fingerprint, pending, served, blocks, verify_s)
        read_s = time.perf_counter() - started - verify_s[0]
        self._promote(hashes, views, served, blocks)
        leading = _leading(served)
        return GetResult(leading, served, blocks, read_s, verify_s[0])

    def borrow_host(self, hashes: Sequence[BlockHash], fingerprint: bytes) -> HostBlocks | None:
        """`get` of the leading blocks host holds without copying them: verified in place and kept there (no
        eviction, no reuse of their slots) until the result's `release()`. None when the host tier cannot lend (a
        custom host tier, or none stored yet) or is backing off. A bad copy ends the run: counted, deleted, and the caller reads or
        recomputes the rest."""
        borrow, slot_rows = getattr(self.host, "borrow", None), getattr(self.host, "slot_rows", None)
        rows = slot_rows() if borrow is not None and slot_rows is not None else None
        if rows is None:
            return None
        started = time.perf_counter()
        loan = self._call("host", "read", borrow, list(hashes))
        if loan is None:
            return None
        read_s = time.perf_counter() - started
        lent = next((i for i, view in enumerate(loan.views) if view is None), len(loan.views))
        blocks: list[codec.DecodedBlock] = []
        for key, block in zip(hashes, codec.decode_many(loan.views[:lent], fingerprint, hashes[:lent])):
            if isinstance(block, codec.CorruptBlock):
                log.warning("host tier: dropping bad copy of %s: %s", bytes(key).hex(), block)
                self._count("host", checksum_failures=1)
                if self._call("host", "read", self.host.delete, [key]):
                    self._events.removed("host", [key])
                break
            blocks.append(block)
        return HostBlocks(blocks, loan.slots[:len(blocks)], *rows, loan.release, read_s,
                          time.perf_counter() - started - read_s)

    def _get_hinted(self, hashes, views, fingerprint, hint, served, blocks, verify_s) -> None:
        """First pass of `get`: each hinted group from its tier; the shared tiers' groups concurrently."""
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(hint[:len(hashes)]):
            if name in self._tiers:
                groups.setdefault(name, []).append(i)
        remote = [n for n in groups if n in SHARED_TIERS and self._io is not None]
        futures = [self._io.submit(self._get_from, n, hashes, views, fingerprint, groups[n], served, blocks,
                                   verify_s) for n in remote]
        for name in groups:
            if name not in remote:
                self._get_from(name, hashes, views, fingerprint, groups[name], served, blocks, verify_s)
        for future in futures:
            future.result()  # NOTE: each group writes only its own indices of served/blocks

    def _get_from(self, name: str, hashes: Sequence[BlockHash], views: list[memoryview], fingerprint: bytes,
                  pending: list[int], served: list, blocks: list, verify_s: list[float]) -> None:
        """Serve what `name` can of `pending` into `served` / `blocks`."""
        sizes = self._call(name, "read", self._tiers[name].get,
                           [hashes[i] for i in pending], [views[i] for i in pending])
        if sizes is None:
            return
        started = time.perf_counter()
        got = [i for i, size in zip(pending, sizes) if size is not None]
        sized = [views[i][:size] for i, size in zip(pending, sizes) if size is not None]
        for i, block in zip(got, codec.decode_many(sized, fingerprint, [hashes[i] for i in got])):
            if isinstance(block, codec.DecodedBlock):
                blocks[i], served[i] = block, name
                continue
            log.warning("%s tier: dropping bad copy of %s: %s", name, bytes(hashes[i]).hex(), block)
            self._count(name, checksum_failures=1)
            if self._call(name, "read", self._tiers[name].delete, [hashes[i]]):
                self._events.removed(name, [hashes[i]])
        with self._counter_lock:
            verify_s[0] += time.perf_counter() - started

    def _promote(self, hashes: Sequence[BlockHash], views: list[memoryview], served: list, blocks: list) -> None:
        if not self.config.promote_on_hit:
            return
        items = [(bytes(hashes[i]), views[i][:blocks[i].header.encoded_len]) for i, t in enumerate(served)
                 if t is not None and t != "host"]
        if items:
            self._put_host(items, counter="promotions")

    # Put ----------------------------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> PutResult:
        """Store encoded blocks (`codec.encode`). Host now; each block new to host owes a write to every
        write-through tier (or, when host cannot take it, a demotion below), done in the background."""
        checked = [(bytes(key), _checked_block(key, data)) for key, data in items]
        held = self._call("host", "read", self.host.contains, [k for k, _ in checked]) or [False] * len(checked)
        in_host = self._put_host(checked)
        queued, refused = 0, Counter()
        owed = []
        for (key, data), was_held, ok in zip(checked, held, in_host):
            if was_held:
                continue  # its lower-tier writes were owed when it first came in
            tiers, carried = self._owed(data, ok)
            if tiers:
                owed.append((key, tiers, carried, not self.config.write_through))
        for (_, tiers, _, _), accepted in zip(owed, self._writer.submit_many(owed)):
            if accepted:
                queued += len(tiers)
            else:
                refused.update(tiers)
        for tier, n in refused.items():
            self._dropped(tier, n)
        return PutResult(sum(in_host), queued, sum(refused.values()))

    def _owed(self, data: bytes | memoryview, in_host: bool) -> tuple[tuple[str, ...], bytes | None]:
        """The tiers a block new to host owes a write to, and the bytes to carry (None: read back from host)."""
        if in_host:
            return tuple(self.config.write_through), None
        owned = data if isinstance(data, bytes) else bytes(data)  # the caller may reuse its buffer once we return
        if self.config.write_through:
            return tuple(self.config.write_through), owned
        below = self._demotion_target("host") if self.config.demotion == "next" else None
        return ((below,), owned) if below else ((), None)

    def _put_host(self, items: list[tuple[bytes, bytes | memoryview]], counter: str | None = None) -> list[bool]:
        stored = self._call("host", "write", self.host.put, items) or [False] * len(items)
        done = [item for item, ok in zip(items, stored) if ok]
        if counter:
            self._count("host", **{counter: len(done)})
        self._events.stored("host", done)
        return stored

    def _on_evict(self, name: str, key: BlockHash, data: bytes | memoryview | None) -> None:
        """Called by a tier, under its lock, as it evicts `key`: publish; hand the bytes to a write still owed
        (write-through reads them back from host, which is letting them go), or queue the demotion below."""
        self._events.removed(name, [key])
        if data is None:
            return
        key = bytes(key)
        if name == "host" and self._writer.owes(key):
            self._writer.attach(key, bytes(data))
            return
        below = self._below(name)
        if self.config.demotion != "next" or below is None or below in self.config.write_through:
            return
        target = self._demotion_target(name)
        if target is not None and not self._writer.submit(key, (target,), bytes(data), demotion=True):
            self._dropped(target, 1)

    def _read_back(self, keys: list[bytes]) -> list[bytes | None]:
        """Writer thread: the bytes of blocks owed a write-through, from host (uncounted: not a cache hit)."""
        peek = getattr(self.host, "peek", None)
        if peek is None:
            return [None] * len(keys)
        return self._call("host", "read", peek, keys) or [None] * len(keys)

    def _write_tier(self, target: str, items: list[tuple[bytes, bytes, bool]]) -> list[bool] | None:
        """Writer thread: one batched put into `target`; None when the tier is unavailable (retried later)."""
        todo = self._skip_held_demotions(target, items)
        stored = self._call(target, "write", self._tiers[target].put, [(k, d) for k, d, _ in todo]) if todo else []
        if stored is None:
            return None
        done = [item for item, ok in zip(todo, stored) if ok]
        self._count(target, demotions=sum(demotion for _, _, demotion in done))
        self._events.stored(target, [(k, d) for k, d, _ in done])
        written, tried = {k for k, _, _ in done}, {k for k, _, _ in todo}
        return [k in written or k not in tried for k, _, _ in items]  # a skipped demotion is already there

    def _skip_held_demotions(self, target: str, items: list[tuple[bytes, bytes, bool]]) -> list:
        """Demotions of blocks `target` already holds (written through earlier) are neither written nor counted."""
        if not any(demotion for _, _, demotion in items):
            return items
        held = self._call(target, "read", self._tiers[target].contains, [k for k, _, _ in items])
        if held is None:
            return items
        return [item for item, h in zip(items, held) if not (h and item[2])]

    def _dropped(self, tier: str, n: int) -> None:
        log.warning("%s tier: %d block write(s) dropped", tier, n)
        self._count(tier, dropped=n)

    def _below(self, name: str) -> str | None:
        i = self._names.index(name)
        return self._names[i + 1] if i + 1 < len(self._names) else None

    def _demotion_target(self, source: str) -> str | None:
        """The first tier below `source` whose writes are not in backoff."""
        for name in self._names[self._names.index(source) + 1:]:
            if self._health[(name, "write")].available():
                return name
            self._count(name, skipped=1)
        return None

    # Health, counters, stats --------------------------------------------------------------------------------

    def _call(self, name: str, op: str, fn: Callable, *args: Any) -> Any | None:
        """Run one tier call under its health policy; None when skipped or failed (failures are counted)."""
        health = self._health[(name, op)]
        if not health.available():
            self._count(name, skipped=1)
            return None
        try:
            result = fn(*args)
        except (ValueError, TypeError):
            raise  # the caller's mistake (a buffer too small), not the tier's
        except TierUnavailable as exc:  # the tier counted it
            health.failed()
            log.warning("%s tier %s unavailable (%s), retry in %.1fs", name, op, exc, health.backoff_s())
            return None
        except TierFull as exc:  # not an outage, but writes must back off all the same; the tier did not count it
            self._count(name, errors=1)
            health.failed()
            log.warning("%s tier full (%s), retry in %.1fs", name, exc, health.backoff_s())
            return None
        except Exception:  # noqa: BLE001 - a tier broke its contract; count it here, keep serving
            log.exception("%s tier raised", name)
            self._count(name, errors=1)
            health.failed()
            return None
        health.succeeded()
        if op == "write":  # a write that works proves the backend answers: reads may resume too
            self._health[(name, "read")].succeeded()
        return result

    def _count(self, name: str, **deltas: int) -> None:
        with self._counter_lock:
            for key, delta in deltas.items():
                self._counters[name][key] += delta

    def stats(self) -> dict[str, TierStats]:
        """Per tier: the tier's own counters plus what the store counted for it."""
        out = {}
        for name, tier in self._tiers.items():
            stats = tier.stats()
            with self._counter_lock:
                for key, value in self._counters[name].items():
                    setattr(stats, key, getattr(stats, key) + value)
            stats.healthy = (stats.healthy and self._health[(name, "read")].healthy
                             and self._health[(name, "write")].healthy)
            out[name] = stats
        return out

    def pending_writes(self) -> int:
        with self._in_hand_lock:
            in_hand = self._in_hand
        return self._writer.pending() + in_hand

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Count a write its caller is about to make as pending (`pending_writes`) for the block's duration: a
        worker answers a request first and writes its blocks after, and whoever waits for no pending write must
        wait for those too."""
        with self._in_hand_lock:
            self._in_hand += 1
        try:
            yield
        finally:
            with self._in_hand_lock:
                self._in_hand -= 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued background writes (tests, shutdown); False on timeout."""
        return self._writer.flush(timeout_s)

    def clear(self) -> None:
        self.flush()
        for name, tier in self._tiers.items():
            self._call(name, "write", tier.clear)
        for name in self._names:  # a shared tier is empty for every worker, not only this one
            if name in SHARED_TIERS:
                self._events.cleared(name)
        self._events.cleared()

    def close(self) -> None:
        self._writer.close()
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)
        for tier in self._tiers.values():
            tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leading(served: Sequence[str | None]) -> int:
    return next((i for i, t in enumerate(served) if t is None), len(served))


def _lookup_stages(names: list[str]) -> list[tuple[str, ...]]:
    """Local tiers one at a time, fastest first; then the shared tiers together (asked concurrently)."""
    stages = [(n,) for n in names if n not in SHARED_TIERS]
    shared = tuple(n for n in names if n in SHARED_TIERS)
    return stages + ([shared] if shared else [])


def _sealed(tiers: dict[str, Tier], key_file: str) -> dict[str, Tier]:
    """With a key file, every tier but host seals its objects at rest (kvstore/sealing.py)."""
    if not key_file:
        return tiers
    sealer = Sealer(load_key(key_file))
    return {n: t if n == "host" or isinstance(t, SealedTier) else SealedTier(t, sealer) for n, t in tiers.items()}


def _checked_block(key: BlockHash, data: bytes | memoryview) -> bytes | memoryview:
    """Refuse to store bytes under a key their codec header does not name (cheap: the header only)."""
    try:
        header = codec.peek_header(data)
    except codec.CorruptBlock as exc:
        raise ValueError(f"put of {bytes(key).hex()}: not an encoded block: {exc}") from None
    if header.block_hash != bytes(key):
        raise ValueError(f"put of {bytes(key).hex()}: the block's header names {header.block_hash.hex()}")
    return data

