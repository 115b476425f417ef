"""Leases: the owner's promise to keep ranges of a region unchanged until a deadline (DESIGN §2, step 3).

Ranges are normalised once at grant time into sorted, merged, half-open spans so that a read checks coverage with
one bisect per descriptor. Times are CLOCK_MONOTONIC nanoseconds, which every process on one host shares (the shm
backend's readers compare against the owner's expiry directly); remote readers never compare clocks: the tcp
owner checks its own leases.
"""
from __future__ import annotations

import bisect
import itertools
import secrets
import threading
import time
from typing import NamedTuple, Sequence

from kvstore.transfer.base import LeaseId
from kvstore.transfer.errors import LeaseExpired, OutOfBounds


def now_ns() -> int:
    return time.monotonic_ns()


def ttl_to_expiry_ns(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
    return now_ns() + int(ttl_s * 1e9)


def normalize_ranges(ranges: Sequence[tuple[int, int]], region_length: int) -> tuple[list[int], list[int]]:
    """Sorted, merged `(starts, ends)` of `(offset, length)` ranges; ValueError for a range outside the region.

        region: [0 ......................................... region_length)
        ranges:    [a, a+n)   [b, b+m)[c, c+k)      -> starts [a, b]  ends [a+n, c+k]
    """
    spans = []
    for offset, length in ranges:
        if offset < 0 or length <= 0 or offset + length > region_length:
            raise ValueError(f"lease range ({offset}, {length}) must be inside the region [0, {region_length})")
        spans.append((offset, offset + length))
    if not spans:
        raise ValueError("a lease needs at least one (offset, length) range")
    spans.sort()
    starts, ends = [spans[0][0]], [spans[0][1]]
    for start, end in spans[1:]:
        if start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def covers(starts: Sequence[int], ends: Sequence[int], offset: int, length: int) -> bool:
    """Whether one merged span holds all of [offset, offset + length)."""
    i = bisect.bisect_right(starts, offset) - 1
    return i >= 0 and offset + length <= ends[i]


class Lease(NamedTuple):
    region_id: str
    starts: list[int]
    ends: list[int]
    expires_ns: int


def check_lease(lease: Lease | None, lease_id: int, region_id: str, offset: int, length: int, index: int) -> None:
    """Raise the typed error a read with this lease must fail with, if any."""
    if lease is None or lease.expires_ns <= now_ns():
        raise LeaseExpired(f"lease {lease_id} has expired or was released", index)
    if lease.region_id != region_id:
        raise OutOfBounds(f"lease {lease_id} is for region {lease.region_id!r}, not {region_id!r}", index)
    if not covers(lease.starts, lease.ends, offset, length):
        raise OutOfBounds(f"range ({offset}, {length}) of {region_id!r} is not covered by lease {lease_id}", index)


class LeaseBook:
    """The owner's leases kept in process memory (tcp backend: the owner itself checks every request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(secrets.randbits(40) + 1)  # NOTE: random base: ids of a restarted owner differ

    def grant(self, region_id: str, region_length: int, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        starts, ends = normalize_ranges(ranges, region_length)
        lease = Lease(region_id, starts, ends, ttl_to_expiry_ns(ttl_s))
        with self._lock:
            self._sweep()
            lease_id = next(self._ids)
            self._leases[lease_id] = lease
        return LeaseId(lease_id)

    def release(self, lease_id: int) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        return lease is not None and lease.expires_ns > now_ns()

    def live(self, lease_id: int) -> bool:
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_ns > now_ns()

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def drop_region(self, region_id: str) -> None:
        with self._lock:
            for lease_id in [k for k, v in self._leases.items() if v.region_id == region_id]:
                del self._leases[lease_id]

    def items(self) -> list[tuple[int, Lease]]:
        return list(self._leases.items())

    def __len__(self) -> int:
        return len(self._leases)

    def _sweep(self) -> None:
        now = now_ns()
        for lease_id in [k for k, v in self._leases.items() if v.expires_ns <= now]:
            del self._leases[lease_id]
