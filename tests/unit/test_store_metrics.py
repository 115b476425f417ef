"""Store metrics: the plain structure for the CLI and the Prometheus exposition, from one store's stats."""
from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, generate_latest

from kvstore import codec
from kvstore.config import HostTierConfig, StoreConfig
from kvstore.hashing import Namespace, hash_blocks
from kvstore.metrics import register_store_metrics, stats_dict
from kvstore.store import TieredStore

NS = Namespace("tiny@metrics", "bs4", "float16")
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=1, head_dim=8)


def make_store_with_traffic() -> TieredStore:
    store = TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=1 << 16, slot_bytes=4096)))
    hashes = hash_blocks(NS, list(range(8)), 4)
    store.put([(hashes[0], codec.encode(NS.fingerprint(), hashes[0], LAYOUT, "float16", b"\x01" * 128))])
    store.get(hashes, [bytearray(4096), bytearray(4096)], NS.fingerprint())
    return store


def test_stats_dict_is_json_ready_with_hit_rate_and_latency():
    with make_store_with_traffic() as store:
        out = json.loads(json.dumps(stats_dict(store)))
    host = out["tiers"]["host"]
    assert (host["hits"], host["misses"], host["hit_rate"], host["blocks"]) == (1, 1, 0.5, 1)
    assert host["capacity_bytes"] == 1 << 16 and host["used_bytes"] == 4096 and host["healthy"] is True
    assert host["get_latency"]["count"] == 1 and host["put_latency"]["count"] == 1
    assert len(host["get_latency"]["counts"]) == len(host["get_latency"]["buckets_s"])
    assert out["pending_writes"] == 0


def test_prometheus_exposition_labels_every_series_by_tier():
    registry = CollectorRegistry()
    with make_store_with_traffic() as store:
        register_store_metrics(store, registry)
        text = generate_latest(registry).decode()
    assert 'strata_kvstore_hits_total{tier="host"} 1.0' in text
    assert 'strata_kvstore_misses_total{tier="host"} 1.0' in text
    assert 'strata_kvstore_capacity_bytes{tier="host"} 65536.0' in text
    assert 'strata_kvstore_healthy{tier="host"} 1.0' in text
    assert 'strata_kvstore_get_latency_seconds_count{tier="host"} 1.0' in text
    assert 'strata_kvstore_get_latency_seconds_bucket{le="+Inf",tier="host"} 1.0' in text
    assert "strata_kvstore_pending_writes 0.0" in text
