"""TieredStore (DESIGN §5): one content-addressed view over host → disk → redis → s3.

- `lookup(hashes)`: the longest leading run each tier holds, and which (fastest) tier serves each leading block.
- `get(hashes, bufs, fingerprint)`: each block from the fastest tier that has it, verified by the codec; a bad copy
  is a counted checksum failure, deleted, and a slower tier may still serve the block. Hits below host are promoted.
- `put(items)`: host synchronously (a memcpy); lower tiers by policy in a background thread that never blocks the
  caller (bounded queue, drop-and-count when full).
- Eviction from a tier demotes the block into the next tier below (policy "next").
- Every tier call goes through `_call`: a tier whose reads or writes fail is skipped for that kind of call until its
  backoff passes, and counted; serving goes on with the other tiers.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, NamedTuple, Sequence

from kvstore import codec
from kvstore.config import StoreConfig
from kvstore.hashing import BlockHash
from kvstore.store_events import EventSink
from kvstore.store_policy import BackgroundWriter, TierHealth, WriteTask
from kvstore.tiers.base import TIER_REGISTRY, Tier, TierFull, TierStats, TierUnavailable

log = logging.getLogger(__name__)

_STORE_COUNTERS = ("promotions", "demotions", "checksum_failures", "dropped", "skipped", "errors")


class LookupResult(NamedTuple):
    num_hit_blocks: int  # leading blocks that some tier holds
    tiers: tuple[str, ...]  # for each of those blocks, the fastest tier that holds it
    per_tier: dict[str, int]  # longest leading run per tier (0 for a tier that was skipped)


class GetResult(NamedTuple):
    num_hit_blocks: int  # leading blocks read and verified
    tiers: list[str | None]  # per key: the tier that served it, None for a miss
    blocks: list[codec.DecodedBlock | None]  # per key: verified zero-copy views into the caller's buffer


class PutResult(NamedTuple):
    stored: int  # blocks now in host (new or already there)
    queued: int  # background writes queued for lower tiers
    dropped: int  # background writes dropped because the queue was full


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
        self._names = list(self._tiers)
        if not self._names or self._names[0] != "host":
            raise ValueError(f"the first tier must be 'host', got {self._names}")
        self._health = {(n, op): TierHealth(config.backoff_initial_s, config.backoff_max_s, clock)
                        for n in self._names for op in ("read", "write")}
        self._counters = {n: dict.fromkeys(_STORE_COUNTERS, 0) for n in self._names}
        self._counter_lock = threading.Lock()
        self._events = EventSink(publisher)
        for name, tier in self._tiers.items():
            below = self._below(name)
            tier.eviction_wants_data = (config.demotion == "next" and below is not None
                                        and below not in config.write_through)
            tier.eviction_listener = lambda key, data, name=name: self._on_evict(name, key, data)
        self._writer = BackgroundWriter(config.queue_depth, self._handle_writes)

    @property
    def host(self) -> Tier:
        return self._tiers["host"]

    def tier(self, name: str) -> Tier:
        return self._tiers[name]

    # Lookup and get -----------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> LookupResult:
        held: list[list[bool]] = []
        per_tier: dict[str, int] = {}
        for name in self._names:
            present = self._call(name, "read", self._tiers[name].contains, hashes) or [False] * len(hashes)
            held.append(present)
            per_tier[name] = next((i for i, p in enumerate(present) if not p), len(hashes))
        serving: list[str] = []
        for i in range(len(hashes)):
            tier = next((name for name, present in zip(self._names, held) if present[i]), None)
            if tier is None:
                break
            serving.append(tier)
        return LookupResult(len(serving), tuple(serving), per_tier)

    def get(self, hashes: Sequence[BlockHash], bufs: Sequence[memoryview | bytearray],
            fingerprint: bytes) -> GetResult:
        """Read and verify blocks into `bufs` (each at least the encoded block size)."""
        if len(hashes) != len(bufs):
            raise ValueError(f"got {len(hashes)} hashes but {len(bufs)} buffers")
        views = [memoryview(b).cast("B") for b in bufs]
        served: list[str | None] = [None] * len(hashes)
        blocks: list[codec.DecodedBlock | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        for name in self._names:
            if pending:
                pending = self._get_from(name, hashes, views, fingerprint, pending, served, blocks)
        self._promote(hashes, views, served, blocks)
        leading = next((i for i, t in enumerate(served) if t is None), len(hashes))
        return GetResult(leading, served, blocks)

    def _get_from(self, name: str, hashes: Sequence[BlockHash], views: list[memoryview], fingerprint: bytes,
                  pending: list[int], served: list, blocks: list) -> list[int]:
        """Serve what `name` can of `pending`; the indices still missing."""
        sizes = self._call(name, "read", self._tiers[name].get,
                           [hashes[i] for i in pending], [views[i] for i in pending])
        if sizes is None:
            return pending
        missing = []
        for i, size in zip(pending, sizes):
            try:
                if size is None:
                    raise KeyError
                blocks[i] = codec.decode(views[i][:size], fingerprint, hashes[i])
                served[i] = name
            except KeyError:
                missing.append(i)
            except codec.CorruptBlock as exc:
                log.warning("%s tier: dropping bad copy of %s: %s", name, bytes(hashes[i]).hex(), exc)
                self._count(name, checksum_failures=1)
                if self._call(name, "read", self._tiers[name].delete, [hashes[i]]):
                    self._events.removed(name, [hashes[i]])
                missing.append(i)
        return missing

    def _promote(self, hashes: Sequence[BlockHash], views: list[memoryview], served: list, blocks: list) -> None:
        if not self.config.promote_on_hit:
            return
        items = [(bytes(hashes[i]), views[i][:blocks[i].header.encoded_len]) for i, t in enumerate(served)
                 if t is not None and t != "host"]
        if items:
            self._put_host(items, counter="promotions")

    # Put ----------------------------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> PutResult:
        """Store encoded blocks (`codec.encode`). Host now; lower tiers in the background by policy."""
        checked = [(bytes(key), _checked_block(key, data)) for key, data in items]
        in_host = self._put_host(checked)
        queued = dropped = 0
        for (key, data), ok in zip(checked, in_host):
            for task in self._background_tasks(key, data, ok):
                if self._writer.submit(task):
                    queued += 1
                else:
                    dropped += 1
                    self._count(task.tier if task.kind == "write_through" else self._below("host"), dropped=1)
        return PutResult(sum(in_host), queued, dropped)

    def _background_tasks(self, key: bytes, data: bytes | memoryview, in_host: bool) -> list[WriteTask]:
        targets = [("write_through", name) for name in self.config.write_through]
        below = self._below("host")
        if not in_host and self.config.demotion == "next" and below and below not in self.config.write_through:
            targets.append(("demote", "host"))  # host could not take it: it goes straight below
        if not targets:
            return []
        owned = data if isinstance(data, bytes) else bytes(data)  # the caller may reuse its buffer once we return
        return [WriteTask(kind, tier, key, owned) for kind, tier in targets]

    def _put_host(self, items: list[tuple[bytes, bytes | memoryview]], counter: str | None = None) -> list[bool]:
        stored = self._call("host", "write", self.host.put, items) or [False] * len(items)
        done = [item for item, ok in zip(items, stored) if ok]
        if counter:
            self._count("host", **{counter: len(done)})
        self._events.stored("host", done)
        return stored

    def _on_evict(self, name: str, key: BlockHash, data: bytes | memoryview | None) -> None:
        """Called by a tier, under its lock, as it evicts `key`: publish, and queue the demotion (copying data)."""
        self._events.removed(name, [key])
        if data is not None and not self._writer.submit(WriteTask("demote", name, bytes(key), bytes(data))):
            self._count(self._below(name) or name, dropped=1)

    def _handle_writes(self, tasks: list[WriteTask]) -> None:
        """Background thread: group tasks by target tier and write each group in one batched put."""
        groups: dict[str, list[WriteTask]] = defaultdict(list)
        for task in tasks:
            target = task.tier if task.kind == "write_through" else self._demotion_target(task.tier)
            if target is not None:
                groups[target].append(task)
        for target, group in groups.items():
            group = self._skip_held_demotions(target, group)
            stored = self._call(target, "write", self._tiers[target].put, [(t.key, t.data) for t in group])
            if stored is None:
                continue
            done = [t for t, ok in zip(group, stored) if ok]
            self._count(target, demotions=sum(t.kind == "demote" for t in done))
            self._events.stored(target, [(t.key, t.data) for t in done])

    def _skip_held_demotions(self, target: str, group: list[WriteTask]) -> list[WriteTask]:
        """Demotions of blocks `target` already holds (written through earlier) are neither written nor counted."""
        if not any(t.kind == "demote" for t in group):
            return group
        held = self._call(target, "read", self._tiers[target].contains, [t.key for t in group])
        if held is None:
            return group
        return [t for t, h in zip(group, held) if not (h and t.kind == "demote")]

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
        return self._writer.pending()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued background writes (tests, shutdown); False on timeout."""
        return self._writer.flush(timeout_s)

    def clear(self) -> None:
        self.flush()
        for name, tier in self._tiers.items():
            self._call(name, "write", tier.clear)
        self._events.cleared()

    def close(self) -> None:
        self._writer.close()
        for tier in self._tiers.values():
            tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_block(key: BlockHash, data: bytes | memoryview) -> bytes | memoryview:
    """Refuse to store bytes under a key their codec header does not name (cheap: the header only)."""
    try:
        header = codec.peek_header(data)
    except codec.CorruptBlock as exc:
        raise ValueError(f"put of {bytes(key).hex()}: not an encoded block: {exc}") from None
    if header.block_hash != bytes(key):
        raise ValueError(f"put of {bytes(key).hex()}: the block's header names {header.block_hash.hex()}")
    return data

