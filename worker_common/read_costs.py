"""What reading a store tier costs this worker, measured: the `<tier>_read_*` fields of `WorkerLoad` (DESIGN §2), and
what a decode worker's KV hand-off reads cost (`transfer_read_*`).

Every tier counts its get calls, the bytes they read and the seconds they took (`TierStats.get_latency_counts`,
`bytes_read`, `get_latency_sum_s`). A call reading n bytes is modelled as taking `latency + n / bandwidth`, so a
window between two readings of the counters, with c calls reading B bytes in S seconds, gives one equation

    S = c * latency + B * (1 / bandwidth)

and the meter fits both unknowns by least squares over the windows seen (older windows weigh less), never below 0:

    windows differ in bytes per call   -> both terms
    they do not, or a term comes out < 0 -> the better fit of latency alone or bandwidth alone (bandwidth on a tie)

The router's cost model takes the figures in place of its defaults once `<tier>_read_samples` (get calls) suffice.
Plain arithmetic over counters: no clocks in the fit, no tensors; `fields()` is safe from any thread.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

from kvstore.tiers.base import TierStats

MEASURED_TIERS: tuple[str, ...] = ("host", "disk", "redis", "s3")  # the tiers WorkerLoad has fields for
TRANSFER = "transfer"        # the KV hand-off reads of a decode worker: WorkerLoad's `transfer_read_*`
_WINDOW_DECAY = 0.9          # weight of a window relative to the next one
_DEGENERATE = 1e-2           # relative determinant (~ the spread of bytes per call, squared) under which the
                             # windows cannot tell latency from bandwidth apart


class ReadCost(NamedTuple):
    """A call reading n bytes takes about `latency_s + n / bytes_per_s`; `samples` get calls went into it."""

    latency_s: float
    bytes_per_s: float       # inf: no per-byte cost showed
    samples: int


class _Counters(NamedTuple):
    calls: int
    bytes: int
    seconds: float

    @classmethod
    def of(cls, stats: TierStats) -> "_Counters":
        return cls(sum(stats.get_latency_counts), stats.bytes_read, stats.get_latency_sum_s)


@dataclass
class ReadFit:
    """Decayed sums of products over windows (c calls, b bytes, s seconds) and the least-squares fit they give."""

    cc: float = 0.0
    cb: float = 0.0
    bb: float = 0.0
    cs: float = 0.0
    bs: float = 0.0
    ss: float = 0.0
    samples: int = 0

    def add(self, calls: int, nbytes: int, seconds: float) -> None:
        d = _WINDOW_DECAY
        self.cc, self.cb, self.bb = d * self.cc + calls ** 2, d * self.cb + calls * nbytes, d * self.bb + nbytes ** 2
        self.cs, self.bs = d * self.cs + calls * seconds, d * self.bs + nbytes * seconds
        self.ss = d * self.ss + seconds ** 2
        self.samples += calls

    def cost(self) -> ReadCost | None:
        """None before any call was measured."""
        if not self.samples or not self.cc:
            return None
        latency, per_byte = self._fit()
        return ReadCost(latency, 1.0 / per_byte if per_byte > 0 else math.inf, self.samples)

    def _fit(self) -> tuple[float, float]:
        det = self.cc * self.bb - self.cb * self.cb
        if det > _DEGENERATE * self.cc * self.bb:
            latency = (self.cs * self.bb - self.bs * self.cb) / det
            per_byte = (self.bs * self.cc - self.cs * self.cb) / det
            if latency >= 0 and per_byte >= 0:
                return latency, per_byte
        latency_only = (self.cs / self.cc, 0.0)
        if not self.bb:
            return latency_only
        bandwidth_only = (0.0, self.bs / self.bb)
        # NOTE: a tie (one window, or every window with the same bytes per call) goes to bandwidth, up to rounding
        better = self._residual(*latency_only) < self._residual(*bandwidth_only) - 1e-9 * self.ss
        return latency_only if better else bandwidth_only

    def _residual(self, latency: float, per_byte: float) -> float:
        """Sum of squared errors of a fit, from the sums alone."""
        return (self.ss - 2 * latency * self.cs - 2 * per_byte * self.bs + latency * latency * self.cc
                + 2 * latency * per_byte * self.cb + per_byte * per_byte * self.bb)


class TransferCounter:
    """What a decode worker's hand-off reads took: calls, bytes and seconds of the successful ones (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = self._bytes = 0
        self._seconds = 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._calls += 1
            self._bytes += nbytes
            self._seconds += seconds

    def counters(self) -> _Counters:
        with self._lock:
            return _Counters(self._calls, self._bytes, self._seconds)


class ReadCostMeter:
    """Reads the store's tier counters at most every `min_interval_s` (when asked) and keeps one `ReadFit` per tier.

    `stats` is `TieredStore.stats` (tier name -> TierStats). Counters that go backwards (a tier rebuilt) restart
    that tier's baseline; the fit so far is kept.
    """

    def __init__(self, stats: Callable[[], Mapping[str, TierStats]], min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, transfer: TransferCounter | None = None) -> None:
        """`transfer`: the worker's hand-off reads, fitted the same way as `transfer_read_*`."""
        self._stats, self._min_interval_s, self._clock = stats, min_interval_s, clock
        self._transfer = transfer
        self._last: dict[str, _Counters] = {}
        self._fits: dict[str, ReadFit] = {}
        self._fields: dict[str, float] = {}
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def costs(self) -> dict[str, ReadCost]:
        """The measured tiers' costs as of the last reading (tiers never read are absent)."""
        with self._lock:
            return {tier: cost for tier, fit in self._fits.items() if (cost := fit.cost()) is not None}

    def fields(self) -> dict[str, float]:
        """WorkerLoad's `<tier>_read_latency_s / _bytes_per_s / _samples` for every measured tier (0 = none)."""
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self._min_interval_s:
                self._read_at = now
                counters = {tier: _Counters.of(stats) for tier, stats in self._stats().items()}
                if self._transfer is not None:
                    counters[TRANSFER] = self._transfer.counters()
                self._observe(counters)
                self._fields = self._to_fields()
            return dict(self._fields)

    def _observe(self, counters: Mapping[str, _Counters]) -> None:
        for tier, now in counters.items():
            before = self._last.get(tier)
            self._last[tier] = now
            if before is None:
                before = _Counters(0, 0, 0.0)  # NOTE: calls before the first reading count as one window
            calls, nbytes, seconds = now.calls - before.calls, now.bytes - before.bytes, now.seconds - before.seconds
            if calls <= 0 or nbytes < 0 or seconds < 0:
                continue  # nothing new, or the counters were reset (the new baseline is kept)
            self._fits.setdefault(tier, ReadFit()).add(calls, nbytes, seconds)

    def _to_fields(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for tier in MEASURED_TIERS + ((TRANSFER,) if self._transfer is not None else ()):
            cost = self._fits[tier].cost() if tier in self._fits else None
            latency, bandwidth, samples = cost if cost is not None else (0.0, 0.0, 0)
            out |= {f"{tier}_read_latency_s": latency, f"{tier}_read_bytes_per_s": bandwidth,
                    f"{tier}_read_samples": samples}
        return out
