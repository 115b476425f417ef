"""Serving figures from client records, defined as vLLM's serving benchmark (benchmark_serving.py) defines them.

    TTFT   request start -> first output chunk, per request
    TPOT   (e2e - TTFT) / (output_tokens - 1), per request with more than one output token
    ITL    every gap between consecutive output chunks, all requests pooled
    E2E    request start -> last chunk, per request
    throughput  completed requests / duration, output tokens / duration, (prompt + output tokens) / duration;
                duration = first send to last reply
    goodput     requests that met every SLO / duration (`--slo ttft:2.0 --slo tpot:0.2 --slo e2e:10`, seconds)

Percentiles are numpy's (linear interpolation), over successful requests only. Cache hit ratio: prompt tokens whose
KV was reused (`usage.cached_tokens`) / prompt tokens; per tier: the cached blocks each tier served
(`RequestMetrics.timings.blocks_by_tier`, gRPC) x block size / prompt tokens, so the tiers add up to the total.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from serve_client import Record, RunResult  # beside this script

SLO_METRICS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
SUMMARY_KEYS = ("requests", "failed", "request_throughput", "goodput", "slo_attainment", "ttft.p50", "ttft.p99",
                "tpot.p50", "tpot.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99", "hit_ratio.total")


@dataclass(frozen=True)
class Slo:
    """Each bound in seconds; None = not part of the SLO."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, items: Iterable[str]) -> "Slo":
        """`["ttft:2.0", "tpot:0.2"]` -> Slo(ttft=2.0, tpot=0.2); ValueError naming the item otherwise."""
        bounds: dict[str, float] = {}
        for item in items:
            name, _, value = item.partition(":")
            if name not in SLO_METRICS or not value:
                raise ValueError(f"--slo takes METRIC:SECONDS with METRIC in {SLO_METRICS}, got {item!r}")
            bounds[name] = float(value)
            if bounds[name] <= 0:
                raise ValueError(f"--slo {name} must be > 0 seconds, got {value}")
        return cls(**bounds)

    def met(self, rec: Record) -> bool:
        return (rec.ok and (self.ttft is None or rec.ttft <= self.ttft)
                and (self.tpot is None or tpot(rec) <= self.tpot)
                and (self.e2e is None or rec.e2e <= self.e2e))

    def __str__(self) -> str:
        parts = [f"{name} <= {getattr(self, name) * 1e3:g} ms" for name in SLO_METRICS if getattr(self, name)]
        return ", ".join(parts) or "none"


def tpot(rec: Record) -> float:
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1) if rec.output_tokens > 1 else 0.0


def distribution(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (seconds); all 0 when there are no values."""
    if not values:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in PERCENTILES}}


def goodput(run: RunResult, slo: Slo) -> float:
    return sum(slo.met(r) for r in run.records) / max(run.duration_s, 1e-9)


def summarize(run: RunResult, slo: Slo, block_size: int) -> dict:
    ok = [r for r in run.records if r.ok]
    duration = max(run.duration_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": len(run.records), "completed": len(ok), "failed": len(run.records) - len(ok),
        "errors": sorted({r.error for r in run.records if r.error})[:5],
        "duration_s": duration, "prompt_tokens": prompt, "output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "goodput": sum(slo.met(r) for r in ok) / duration, "slo": str(slo),
        "slo_attainment": sum(slo.met(r) for r in ok) / max(1, len(run.records)),
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution([tpot(r) for r in ok if r.output_tokens > 1]),
        "itl": distribution([gap for r in ok for gap in r.itl]),
        "e2e": distribution([r.e2e for r in ok]),
        "hit_ratio": hit_ratios(ok, block_size),
    }


def hit_ratios(records: Sequence[Record], block_size: int) -> dict[str, float]:
    """`total` and one entry per tier that served cached blocks (gRPC records carry the tiers)."""
    prompt = max(1, sum(r.prompt_tokens for r in records))
    out = {"total": sum(r.cached_tokens for r in records) / prompt}
    for tier in sorted({t for r in records for t in r.by_tier}):
        out[tier] = sum(r.by_tier.get(tier, 0) for r in records) * block_size / prompt
    return out


def tier_lookups(before: Sequence, after: Sequence) -> dict[str, dict[str, int]]:
    """Per tier, summed over workers: the store's own lookup counters (hit/miss tokens) during the run, from two
    `StrataClient.cache_stats()` snapshots. Shared tiers count once per worker that asked them."""
    def totals(stats: Sequence) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for worker in stats:
            for t in worker.tiers:
                row = out.setdefault(t.tier, {"hit_tokens": 0, "miss_tokens": 0})
                row["hit_tokens"] += t.hit_tokens
                row["miss_tokens"] += t.miss_tokens
        return out

    first, last = totals(before), totals(after)
    return {tier: {k: v - first.get(tier, {}).get(k, 0) for k, v in row.items()} for tier, row in last.items()}


def ratio(num: float, den: float) -> float | None:
    """num / den; None when the baseline is 0 (printed as "-", JSON null)."""
    return num / den if den > 0 else None


def show(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}×"


def medians(summaries: Sequence[Mapping]) -> dict[str, float]:
    """The median over rounds of each of SUMMARY_KEYS."""
    return {key: median_of(summaries, key) for key in SUMMARY_KEYS}


def tier_medians(summaries: Sequence[Mapping]) -> dict[str, float]:
    """Per tier, the median hit ratio over rounds (0 in a round where the tier served nothing)."""
    tiers = sorted({t for s in summaries for t in s["hit_ratio"]}, key=lambda t: (t != "total", t))
    return {t: float(np.median([s["hit_ratio"].get(t, 0.0) for s in summaries])) for t in tiers}


def median_of(summaries: Sequence[Mapping], path: str) -> float:
    """The median over rounds of one figure, `path` dotted: "itl.p99", "goodput"."""
    values = []
    for s in summaries:
        value = s
        for key in path.split("."):
            value = value[key]
        values.append(float(value))
    return float(np.median(values)) if values else 0.0


def print_summary(title: str, s: Mapping) -> None:
    print(f"\n== {title}")
    print(f"requests {s['completed']}/{s['requests']} completed in {s['duration_s']:.1f} s; "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s, "
          f"{s['total_token_throughput']:.0f} total tok/s; goodput {s['goodput']:.2f} req/s ({s['slo']}, "
          f"{s['slo_attainment']:.0%} of requests)")
    print(f"{'ms':<6}" + "".join(f"{k:>10}" for k in ("mean", *(f"p{q}" for q in PERCENTILES))))
    for metric in ("ttft", "tpot", "itl", "e2e"):
        d = s[metric]
        print(f"{metric.upper():<6}" + "".join(f"{d[k] * 1e3:10.1f}" for k in ("mean", *(f"p{q}" for q in
                                                                                        PERCENTILES))))
    print("cache hit ratio (prompt tokens): " + ", ".join(f"{t} {v:.1%}" for t, v in s["hit_ratio"].items()))
    if s.get("step_retries"):
        print(f"worker steps that failed and were retried on another worker (router): {s['step_retries']}")
    if s["errors"]:
        print(f"errors: {s['errors']}")
