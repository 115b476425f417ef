"""deploy/grafana/strata.json is a Grafana dashboard whose every query asks for series Strata really exports.

The exported names and labels come from the real collectors, not from a list kept by hand: the router's
`RouterMetrics` (with the per-worker `strata_cache_*` collector it adds) and a worker's load, hand-off and store
collectors, each fed one of everything, rendered in the Prometheus text format and parsed back. A panel that
misspells a metric, forgets `_total` on a counter, or groups by a label the metric does not carry fails here.
(`strata_spec_*` and `strata_moe_*` are left out: a panel using them would first need them added below.)
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from strata.v1 import common_pb2

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "strata.json"
DATASOURCE_UID = "${DS_PROMETHEUS}"
# PromQL's functions, aggregations and keywords this dashboard may use: every other word must be a metric.
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "deriv", "histogram_quantile",
                "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "topk", "bottomk", "clamp_min", "clamp_max", "abs", "label_values", "inf", "nan"}
AGGREGATIONS = re.compile(r"\b(sum|max|min|avg|count|topk|bottomk)\b")


def router_registry() -> CollectorRegistry:
    from router.openai_api import RouterMetrics

    metrics = RouterMetrics()
    usage = common_pb2.Usage(prompt_tokens=32, completion_tokens=8, cached_tokens=16)
    metrics.on_finish("http", "stop", usage, ttft_s=0.2, total_s=1.5, route="disaggregated", retries=1)
    metrics.workers.labels("decode", "ready").set(1)
    metrics.event_batches.labels("decode-0").set(3)
    metrics.event_resyncs.labels("decode-0").set(0)
    tiers = [common_pb2.CacheTierStats(tier=t, shared=t == "redis") for t in ("device", "host", "disk", "redis")]
    metrics.enable_cache_metrics(lambda: [("decode-0", common_pb2.WorkerCacheStats(worker_id="decode-0", tiers=tiers)),
                                          ("decode-1", None)])   # one worker that did not answer: scrape errors
    return metrics.registry


def worker_registry() -> CollectorRegistry:
    from kvstore.metrics import register_store_metrics
    from kvstore.tiers.base import TierStats
    from strata.cache_metrics import HandoffCollector, LoadCollector

    registry = CollectorRegistry()
    registry.register(LoadCollector("decode-0", common_pb2.WorkerLoad))
    registry.register(HandoffCollector("decode-0", lambda: defaultdict(int)))
    store = SimpleNamespace(stats=lambda: {"host": TierStats("host")}, pending_writes=lambda: 0)
    register_store_metrics(store, registry)
    return registry


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name the router and a worker export -> its label names."""
    labels: dict[str, set[str]] = defaultdict(set)
    for registry in (router_registry(), worker_registry()):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                labels[sample.name] |= set(sample.labels)
    return dict(labels)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel but rows, including those nested in collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        found += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return found


def targets(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every query."""
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in panels(dashboard) for t in p["targets"]]


class Query:
    """What one PromQL expression asks for: metric names and label names (grouped by, matched, in the legend)."""

    def __init__(self, expr: str, legend: str = "") -> None:
        bare = re.sub(r'"[^"]*"', "", expr)                     # string literals: matcher values
        self.matched = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", bare))
        self.grouped = {name.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", bare)
                        for name in group.split(",") if name.strip()}
        rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)", " ", bare)
        words = set(re.findall(r"\b[a-zA-Z_:][\w:]*\b", rest))
        self.metrics = {w for w in words if w.lower() not in PROMQL_WORDS}
        self.legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        self.aggregates = bool(AGGREGATIONS.search(rest))


def test_dashboard_is_grafana_json_with_panels(dashboard: dict) -> None:
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    found = panels(dashboard)
    assert len(found) >= 20
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in found if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in found:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"


def test_every_query_uses_the_prometheus_datasource_variable(dashboard: dict) -> None:
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == DATASOURCE_UID, panel["title"]
        assert all(t["datasource"]["uid"] == DATASOURCE_UID for t in panel["targets"]), panel["title"]


def test_every_query_names_only_exported_metrics(dashboard: dict, exported: dict[str, set[str]]) -> None:
    for title, expr, _ in targets(dashboard):
        query = Query(expr)
        assert query.metrics, f"{title}: {expr!r} names no metric"
        unknown = query.metrics - exported.keys()
        assert not unknown, f"{title}: {expr!r} asks for {sorted(unknown)}, which Strata does not export"


def test_every_label_a_query_uses_is_on_its_metrics(dashboard: dict, exported: dict[str, set[str]]) -> None:
    for title, expr, legend in targets(dashboard):
        query = Query(expr, legend)
        for metric in query.metrics:
            missing = (query.matched | query.grouped) - exported[metric]
            assert not missing, f"{title}: {metric} has no label {sorted(missing)} (it has {sorted(exported[metric])})"
        shown = query.grouped if query.aggregates else set().union(*(exported[m] for m in query.metrics))
        assert query.legend <= shown, f"{title}: legend {legend!r} shows labels the result does not keep"


def test_template_variables_query_exported_labels(dashboard: dict, exported: dict[str, set[str]]) -> None:
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query).groups()
        assert label in exported[metric], f"${variable['name']}: {metric} has no label {label}"


def test_query_parser_catches_a_wrong_name_and_a_wrong_label(exported: dict[str, set[str]]) -> None:
    """The checks above can fail: a counter without `_total`, and a label its metric does not carry."""
    assert Query("sum(rate(strata_router_routes[5m]))").metrics - exported.keys() == {"strata_router_routes"}
    query = Query('sum by (tier) (rate(strata_router_requests_total{door="http"}[5m]))')
    assert query.grouped | query.matched == {"tier", "door"}
    assert "tier" not in exported["strata_router_requests_total"]
