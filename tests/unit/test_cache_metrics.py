"""The router's per-tier cache metrics: every tier of every answering worker, errors counted per worker."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from strata.cache_metrics import CacheTierCollector
from strata.v1 import common_pb2


def test_tiers_become_labelled_counters_and_gauges_and_silent_workers_count_as_errors():
    stats = common_pb2.WorkerCacheStats(worker_id="d0", pending_writes=5, tiers=[
        common_pb2.CacheTierStats(tier="host", capacity_bytes=1024, used_bytes=512, blocks=2, hit_blocks=7,
                                  hit_tokens=112, get_latency_p99_ms=0.5, healthy=True),
        common_pb2.CacheTierStats(tier="redis", shared=True, miss_blocks=3, errors=1, dropped=4,
                                  quota_refused=6, healthy=False)])
    registry = CollectorRegistry()
    registry.register(CacheTierCollector(lambda: [("d0", stats), ("p0", None)]))
    generate_latest(registry)
    generate_latest(registry)
    text = generate_latest(registry).decode()  # the third scrape: p0 has failed three times
    for line in ['strata_cache_hit_blocks_total{tier="host",worker="d0"} 7.0',
                 'strata_cache_hit_tokens_total{tier="host",worker="d0"} 112.0',
                 'strata_cache_capacity_bytes{tier="host",worker="d0"} 1024.0',
                 'strata_cache_get_latency_p99_ms{tier="host",worker="d0"} 0.5',
                 'strata_cache_miss_blocks_total{tier="redis",worker="d0"} 3.0',
                 'strata_cache_errors_total{tier="redis",worker="d0"} 1.0',
                 'strata_cache_healthy{tier="redis",worker="d0"} 0.0',
                 'strata_cache_dropped_total{tier="redis",worker="d0"} 4.0',
                 'strata_cache_quota_refused_total{tier="redis",worker="d0"} 6.0',
                 'strata_cache_pending_writes{worker="d0"} 5.0',
                 'strata_cache_scrape_errors_total{worker="p0"} 3.0']:
        assert line in text, line
    assert 'worker="p0",tier' not in text and 'tier="host",worker="p0"' not in text
