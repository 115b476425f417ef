"""The tier interface (DESIGN §5). Every tier stores opaque, codec-encoded block objects keyed by block hash.

Contracts every implementation keeps:
- `contains` is batched and never raises for a missing key; it may raise `TierUnavailable` when the backend is down.
- `get` copies each object into the caller's buffer and returns how many bytes it wrote, or None for a miss. It does
  not verify the codec; `TieredStore` does, and deletes a bad copy through `delete`.
- `put` is synchronous at this level (the TieredStore runs it in the background); it returns which keys were stored.
  Storing a key that is already present is a no-op that returns True.
- `delete` of a missing key is a no-op. `clear()` empties the tier.
- A backend failure raises `TierUnavailable` (never a bare library error), so the store can mark the tier unhealthy.
  The tier counts that failure in its own `errors` (use `_failed`); the store does not count it again.
- A put that finds no room even after eviction may raise `TierFull`; the store counts it as an error and backs the
  tier's writes off like an outage.
- A buffer too small for its object is a caller error: `ValueError`.
- A tier that evicts on its own (capacity) calls `_evicted(key, data)` so the store can demote the block and publish
  `BlockRemoved`; `data` is the object's bytes when `eviction_wants_data` is set, else None, and is only valid
  during the call. The listener runs under the tier's lock: it copies what it keeps and never calls the tier.
- Counting: a tier counts hits, misses, bytes, evictions and errors; the store counts promotions and demotions (on
  the tier the block moves INTO), checksum failures (on the tier that held the bad copy), dropped background writes
  and calls skipped while the tier was unhealthy.
- A shared tier with a byte quota per namespace (`quota_bytes`) answers False from `put` for a block that would take
  its namespace (the fingerprint at offset 12 of the object, `kvstore.sealing.fingerprint_of`) past the quota, and
  counts it in `quota_refused`; deletes give the bytes back.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from kvstore.hashing import BlockHash


class TierUnavailable(RuntimeError):
    """The backend of a tier failed (server down, I/O error, disk full)."""


class TierFull(RuntimeError):
    """A put could not find room even after eviction."""


# Latency histogram buckets in seconds, shared by every tier and by the Prometheus export.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TierStats:
    """Plain counters one tier keeps; the CLI prints them and the Prometheus exporter reads them."""

    tier: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    errors: int = 0
    checksum_failures: int = 0
    dropped: int = 0
    skipped: int = 0
    quota_refused: int = 0  # writes a shared tier refused: they would take a namespace past its byte quota
    healthy: bool = True
    get_latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    put_latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    get_latency_sum_s: float = 0.0
    put_latency_sum_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def observe_latency(counts: list[int], seconds: float) -> None:
    counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bucket whose bound >= seconds; last is +Inf


class Tier(ABC):
    """One storage tier. Implementations are registered by the name users write in config (`tier: redis`)."""

    name: str = "abstract"

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = TierStats(tier=self.name)
        self.eviction_listener: Callable[[BlockHash, bytes | memoryview | None], None] | None = None
        self.eviction_wants_data = False

    @abstractmethod
    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Which keys this tier holds, in order (one batched round trip for remote tiers)."""

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading keys this tier holds without a gap."""
        for i, present in enumerate(self.contains(keys)):
            if not present:
                return i
        return len(keys)

    @abstractmethod
    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        """Copy each object into its buffer; bytes written per key, None for a miss."""

    @abstractmethod
    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        """Store objects; which ones were stored."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockHash]) -> int:
        """Remove keys; how many were present."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every object of this tier (for its namespace/prefix only, on shared backends)."""

    def close(self) -> None:
        """Release connections, files, shared memory."""

    def stats(self) -> TierStats:
        with self._stats_lock:
            return TierStats(**self._stats.as_dict())

    # Helpers for implementations -------------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        """Add to counters, e.g. `self._count(hits=2, bytes_read=n)`."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _observe(self, op: str, started: float, **deltas: int) -> None:
        """Record one `get` or `put` call that began at `started` (time.perf_counter()), plus counter deltas."""
        seconds = time.perf_counter() - started
        bucket = bisect_left(LATENCY_BUCKETS, seconds)
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)
            getattr(self._stats, f"{op}_latency_counts")[bucket] += 1
            setattr(self._stats, f"{op}_latency_sum_s", getattr(self._stats, f"{op}_latency_sum_s") + seconds)

    def _failed(self, what: str, exc: BaseException) -> TierUnavailable:
        """Count one backend failure and build the error to raise (`raise self._failed("put", exc) from exc`)."""
        with self._stats_lock:
            self._stats.errors += 1
        return TierUnavailable(f"{self.name} tier: {what} failed: {exc}")

    def _evicted(self, key: BlockHash, data: bytes | memoryview | None) -> None:
        self._count(evictions=1)
        if self.eviction_listener is not None:
            self.eviction_listener(key, data)


TIER_REGISTRY: dict[str, type[Tier]] = {}


def register_tier(name: str):
    """Class decorator: make a tier choosable by `name` in config."""

    def wrap(cls: type[Tier]) -> type[Tier]:
        cls.name = name
        TIER_REGISTRY[name] = cls
        return cls

    return wrap
