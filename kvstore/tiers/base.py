"""The tier interface (DESIGN §5). Every tier stores opaque, codec-encoded block objects keyed by block hash.

Contracts every implementation keeps:
- `contains` is batched and never raises for a missing key; it may raise `TierUnavailable` when the backend is down.
- `get` copies each object into the caller's buffer and returns how many bytes it wrote, or None for a miss. It does
  not verify the codec; `TieredStore` does, and deletes a bad copy through `delete`.
- `put` is synchronous at this level (the TieredStore runs it in the background); it returns which keys were stored.
  Storing a key that is already present is a no-op that returns True.
- `delete` of a missing key is a no-op. `clear()` empties the tier.
- A backend failure raises `TierUnavailable` (never a bare library error), so the store can mark the tier unhealthy.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Sequence

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
    healthy: bool = True
    get_latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    put_latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def as_dict(self) -> dict:
        return asdict(self)


def observe_latency(counts: list[int], seconds: float) -> None:
    for i, bound in enumerate(LATENCY_BUCKETS):
        if seconds <= bound:
            counts[i] += 1
            return
    counts[-1] += 1


class Tier(ABC):
    """One storage tier. Implementations are registered by the name users write in config (`tier: redis`)."""

    name: str = "abstract"

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = TierStats(tier=self.name)

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


TIER_REGISTRY: dict[str, type[Tier]] = {}


def register_tier(name: str):
    """Class decorator: make a tier choosable by `name` in config."""

    def wrap(cls: type[Tier]) -> type[Tier]:
        cls.name = name
        TIER_REGISTRY[name] = cls
        return cls

    return wrap
