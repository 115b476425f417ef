"""Per-worker, per-tier KV-cache metrics for Prometheus (`strata_cache_*{worker, tier}`), built at scrape time.

The router's `/metrics` asks every worker (`ask_workers`), so Prometheus needs one target per cluster; each worker's
own `/metrics` (`--metrics-port`) shows its tiers alone, plus its load. The numbers are the same `CacheTierStats` that `strata cache stats` prints:
monotonic counters as Prometheus counters (`_total`), the rest as gauges. A worker that does not answer within the
timeout is left out of that scrape and counted in `strata_cache_scrape_errors_total{worker}`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from strata.v1 import common_pb2, worker_pb2

_COUNTERS = (
    ("hit_blocks", "Blocks found in the tier"), ("miss_blocks", "Blocks looked up and not found"),
    ("hit_tokens", "Tokens of blocks found"), ("miss_tokens", "Tokens of blocks not found"),
    ("bytes_read", "Bytes read from the tier"), ("bytes_written", "Bytes written to the tier"),
    ("evictions", "Blocks evicted"), ("promotions", "Blocks copied up from a slower tier"),
    ("demotions", "Blocks moved down on eviction"), ("errors", "Failed tier operations"),
    ("checksum_failures", "Blocks rejected by the codec's checksum (recomputed instead)"),
    ("dropped", "Background writes into the tier that could not be written (counted, never silent)"),
    ("quota_refused", "Writes a shared tier refused: they would take a namespace past its byte quota"),
)
_GAUGES = (
    ("capacity_bytes", "Configured capacity"), ("used_bytes", "Bytes held"), ("blocks", "Blocks held"),
    ("get_latency_p50_ms", "Median get latency"), ("get_latency_p99_ms", "99th percentile get latency"),
    ("put_latency_p50_ms", "Median put latency"), ("put_latency_p99_ms", "99th percentile put latency"),
)

# (worker id, that worker's stats or None when it did not answer)
Snapshot = Sequence[tuple[str, "common_pb2.WorkerCacheStats | None"]]


def ask_workers(addresses: Iterable[tuple[str, str]], stub_for: Callable[[str], object], pool: ThreadPoolExecutor,
                timeout_s: float) -> Snapshot:
    """Every worker's `Stats().cache` in parallel; None for one that failed or timed out."""
    def one(item: tuple[str, str]):
        worker_id, address = item
        try:
            return worker_id, stub_for(address).Stats(worker_pb2.StatsRequest(), timeout=timeout_s).cache
        except grpc.RpcError:
            return worker_id, None
    return list(pool.map(one, list(addresses)))


class LoadCollector:
    """A worker's load (`strata_worker_*{worker}`: running, waiting, KV usage, ...); `load()` once per scrape."""

    def __init__(self, worker_id: str, load: Callable[[], "common_pb2.WorkerLoad"]) -> None:
        self._worker_id, self._load = worker_id, load

    def describe(self):
        return []

    def collect(self):
        load = self._load()
        for field in load.DESCRIPTOR.fields:
            family = GaugeMetricFamily(f"strata_worker_{field.name}", f"WorkerLoad.{field.name}", labels=["worker"])
            family.add_metric([self._worker_id], float(getattr(load, field.name)))
            yield family


class HandoffCollector:
    """A decode worker's KV hand-off totals: `strata_worker_kv_handoff_blocks_total{worker, source}` (transferred,
    from_store, recomputed), `..._tail_tokens_total{worker}` and `strata_worker_kv_transfer_failures_total{worker}`."""

    def __init__(self, worker_id: str, totals: Callable[[], dict[str, int]]) -> None:
        self._worker_id, self._totals = worker_id, totals

    def describe(self):
        return []

    def collect(self):
        totals = self._totals()
        blocks = CounterMetricFamily("strata_worker_kv_handoff_blocks", "Prompt blocks of Decode requests, by where "
                                     "the decode worker got them", labels=["worker", "source"])
        for source in ("transferred", "from_store", "recomputed"):
            blocks.add_metric([self._worker_id, source], totals[f"blocks_{source}"])
        yield blocks
        tail = CounterMetricFamily("strata_worker_kv_handoff_tail_tokens", "Tokens of prompts' partial last blocks "
                                   "installed from the transfer instead of recomputed", labels=["worker"])
        tail.add_metric([self._worker_id], totals["tail_tokens_transferred"])
        yield tail
        failed = CounterMetricFamily("strata_worker_kv_transfer_failures", "KV transfer reads that failed (lease "
                                     "expired, peer gone, deadline) and fell back to the store", labels=["worker"])
        failed.add_metric([self._worker_id], totals["failed_reads"])
        yield failed


class CacheTierCollector:
    """A prometheus_client collector; `snapshot()` is called once per scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot
        self._scrape_errors: dict[str, int] = {}

    def describe(self):
        return []  # collected live: nothing to check at registration

    def collect(self):
        families = {name: CounterMetricFamily(f"strata_cache_{name}", doc, labels=["worker", "tier"])
                    for name, doc in _COUNTERS}
        families.update((name, GaugeMetricFamily(f"strata_cache_{name}", doc, labels=["worker", "tier"]))
                        for name, doc in _GAUGES)
        healthy = GaugeMetricFamily("strata_cache_healthy", "1 while the tier answers", labels=["worker", "tier"])
        pending = GaugeMetricFamily("strata_cache_pending_writes", "Background writes the worker still owes",
                                    labels=["worker"])
        for worker_id, stats in self._snapshot():
            if stats is None:
                self._scrape_errors[worker_id] = self._scrape_errors.get(worker_id, 0) + 1
                continue
            for tier in stats.tiers:
                labels = [worker_id, tier.tier]
                for name, family in families.items():
                    family.add_metric(labels, float(getattr(tier, name)))
                healthy.add_metric(labels, 1.0 if tier.healthy else 0.0)
            pending.add_metric([worker_id], float(stats.pending_writes))
        errors = CounterMetricFamily("strata_cache_scrape_errors", "Scrapes a worker did not answer",
                                     labels=["worker"])
        for worker_id, n in self._scrape_errors.items():
            errors.add_metric([worker_id], float(n))
        yield from families.values()
        yield healthy
        yield pending
        yield errors
