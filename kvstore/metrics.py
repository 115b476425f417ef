"""Per-tier store metrics (DESIGN §9): Prometheus collectors and the plain structure `strata cache stats` prints.

Both read `TieredStore.stats()` when asked, so the hot path only bumps integers.

    strata_kvstore_capacity_bytes{tier="disk"}           gauge
    strata_kvstore_hits_total{tier="host"}               counter (also misses, bytes_read, ..., skipped)
    strata_kvstore_get_latency_seconds_bucket{tier,le}   histogram (and put_latency_seconds)
"""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from kvstore.tiers.base import LATENCY_BUCKETS, TierStats

PREFIX = "strata_kvstore"
GAUGES = {"capacity_bytes": "Configured capacity of the tier", "used_bytes": "Bytes the tier holds",
          "blocks": "Blocks the tier holds", "healthy": "1 while the tier is healthy, 0 while it is skipped"}
COUNTERS = {
    "hits": "Blocks read from the tier", "misses": "Blocks asked of the tier that it did not hold",
    "bytes_read": "Bytes read from the tier", "bytes_written": "Bytes written to the tier",
    "evictions": "Blocks the tier evicted for room", "promotions": "Blocks promoted into the tier",
    "demotions": "Blocks demoted into the tier", "errors": "Failed calls to the tier's backend",
    "checksum_failures": "Stored copies that failed codec verification and were deleted",
    "dropped": "Background writes for the tier dropped because the queue was full",
    "skipped": "Calls skipped while the tier was in backoff",
    "quota_refused": "Writes refused because they would take a namespace past its byte quota",
}


def stats_dict(store: Any) -> dict:
    """Everything `strata cache stats --json` prints: per tier counters, hit rate and latency histograms."""
    tiers = {}
    for name, stats in store.stats().items():
        entry = {k: v for k, v in stats.as_dict().items() if "latency" not in k and k != "tier"}
        asked = stats.hits + stats.misses
        entry["hit_rate"] = stats.hits / asked if asked else 0.0
        entry["get_latency"] = _histogram_dict(stats.get_latency_counts, stats.get_latency_sum_s)
        entry["put_latency"] = _histogram_dict(stats.put_latency_counts, stats.put_latency_sum_s)
        tiers[name] = entry
    return {"tiers": tiers, "pending_writes": store.pending_writes()}


def _histogram_dict(counts: list[int], total_s: float) -> dict:
    n = sum(counts)
    return {"buckets_s": list(LATENCY_BUCKETS) + ["+Inf"], "counts": list(counts), "count": n, "sum_s": total_s,
            "mean_s": total_s / n if n else 0.0}


class StoreCollector(Collector):
    """A Prometheus collector over one store; register it once per process (`register_store_metrics`)."""

    def __init__(self, store: Any, prefix: str = PREFIX) -> None:
        self._store, self._prefix = store, prefix

    def collect(self) -> Iterable:
        all_stats: dict[str, TierStats] = self._store.stats()
        for field, doc in GAUGES.items():
            family = GaugeMetricFamily(f"{self._prefix}_{field}", doc, labels=["tier"])
            for name, stats in all_stats.items():
                family.add_metric([name], float(getattr(stats, field)))
            yield family
        for field, doc in COUNTERS.items():
            family = CounterMetricFamily(f"{self._prefix}_{field}", doc, labels=["tier"])
            for name, stats in all_stats.items():
                family.add_metric([name], float(getattr(stats, field)))
            yield family
        for op in ("get", "put"):
            family = HistogramMetricFamily(f"{self._prefix}_{op}_latency_seconds", f"Latency of one {op} call",
                                           labels=["tier"])
            for name, stats in all_stats.items():
                counts = getattr(stats, f"{op}_latency_counts")
                family.add_metric([name], _cumulative(counts), getattr(stats, f"{op}_latency_sum_s"))
            yield family
        pending = GaugeMetricFamily(f"{self._prefix}_pending_writes", "Background writes waiting in the queue")
        pending.add_metric([], float(self._store.pending_writes()))
        yield pending


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, count in zip(list(LATENCY_BUCKETS) + [float("inf")], counts):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return out


def register_store_metrics(store: Any, registry: CollectorRegistry = REGISTRY) -> StoreCollector:
    collector = StoreCollector(store)
    registry.register(collector)
    return collector
