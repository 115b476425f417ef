"""Routing grid: `kv_aware` against one pooled cache over fleet sizes, cache sizes and traffic shapes (issue 17).

    python benchmarks/routing_grid.py                   # 4 fleets x 3 cache sizes x 5 traffics = 60 cells (minutes)
    python benchmarks/routing_grid.py --jobs 2          # the same, cells spread over 2 processes
    python benchmarks/routing_grid.py --quick --json    # 10 cells, 300 requests each (CI); last line: one JSON object
    python benchmarks/routing_grid.py --workers 8 --capacity 2000 --traffic multi-turn

`--quick` is a smoke test: the first 300 requests of a trace are mostly warm-up (every cache starts empty), so its
ratios say nothing about the target; the grid in benchmarks/README.md is the full traces.

Every cell replays one trace through `routing_sim.simulate` (the real index and policies, simulated workers) with
`kv_aware`, `round_robin` and `least_loaded`, and through one pooled LRU of workers x blocks (the ceiling). A cell
meets the target when kv_aware's token hit ratio is >= 0.97x the pooled one. Load imbalance = max / mean per-worker
busy time, kv_aware's beside least_loaded's (the balance a cache-blind policy gets on the same trace).

Traffic (all Mooncake format, 512-token blocks):
    synthetic    benchmarks/data/mooncake_synthetic_trace.jsonl (3,993 requests)
    multi-turn   conversation_trace.py: sessions whose every request shares block 0, growing history (2,958)
    azure-code   azure_trace.py: Azure 2023 code arrivals and lengths, Zipf app prefixes (8,819)
    azure-conv   azure_trace.py: the same over the Azure 2023 conversation trace (19,366)
    hot-prefix   synthetic with the same 32 blocks in front of every request (mooncake_trace.with_hot_prefix)
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from router.policy import get_policy

from azure_trace import azure_trace  # beside this script
from conversation_trace import conversation_trace
from mooncake_trace import DEFAULT_TRACE, TraceRequest, load_trace, with_hot_prefix
from routing_sim import SimConfig, pooled_lru, simulate

WORKERS = (4, 8, 16, 32)
CAPACITIES = (500, 2_000, 10_000)
HOT_PREFIX_BLOCKS = 32
TARGET = 0.97  # kv_aware / pooled token hit ratio, every cell

TRAFFIC: dict[str, Callable[[], list[TraceRequest]]] = {
    "synthetic": lambda: load_trace(DEFAULT_TRACE),
    "multi-turn": conversation_trace,
    "azure-code": lambda: azure_trace("code"),
    "azure-conv": lambda: azure_trace("conv"),
    "hot-prefix": lambda: with_hot_prefix(load_trace(DEFAULT_TRACE), HOT_PREFIX_BLOCKS),
}


@dataclass(frozen=True)
class Cell:
    """One grid cell's figures: token hit ratios (prefix semantics), busy-time imbalance, mean TTFT."""

    traffic: str
    workers: int
    capacity_blocks: int
    requests: int
    pooled_hit: float
    kv_hit: float
    rr_hit: float
    ll_hit: float
    kv_imbalance: float
    ll_imbalance: float
    rr_imbalance: float
    kv_ttft_mean_s: float
    ll_ttft_mean_s: float

    @property
    def kv_vs_pooled(self) -> float:
        return self.kv_hit / self.pooled_hit if self.pooled_hit else 1.0

    @property
    def rr_vs_pooled(self) -> float:
        return self.rr_hit / self.pooled_hit if self.pooled_hit else 1.0

    @property
    def meets(self) -> bool:
        return self.kv_vs_pooled >= TARGET

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_vs_pooled": self.kv_vs_pooled, "rr_vs_pooled": self.rr_vs_pooled,
                "meets": self.meets}


@functools.lru_cache(maxsize=None)  # one build per traffic and process: every cell of a traffic replays the same
def load_traffic(name: str, limit: int | None = None) -> tuple[TraceRequest, ...]:
    if name not in TRAFFIC:
        raise ValueError(f"traffic must be one of {sorted(TRAFFIC)}, got {name!r}")
    return tuple(TRAFFIC[name]()[:limit])


def run_cell(traffic: str, workers: int, capacity: int, limit: int | None = None) -> Cell:
    trace = load_traffic(traffic, limit)
    sim = SimConfig(workers, capacity)
    cost = sim.cost_model()
    f = {name: simulate(trace, get_policy(name), sim, cost) for name in ("kv_aware", "round_robin", "least_loaded")}
    kv, rr, ll = f["kv_aware"], f["round_robin"], f["least_loaded"]
    return Cell(traffic, workers, capacity, len(trace), pooled_lru(trace, workers * capacity)["token_hit_ratio"],
                kv["token_hit_ratio"], rr["token_hit_ratio"], ll["token_hit_ratio"], kv["imbalance_busy"],
                ll["imbalance_busy"], rr["imbalance_busy"], kv["ttft_mean_s"], ll["ttft_mean_s"])


def run_grid(traffics: Sequence[str], workers: Sequence[int], capacities: Sequence[int], limit: int | None = None,
             jobs: int = 1) -> list[Cell]:
    """Cells in (traffic, workers, capacity) order."""
    specs = [(t, n, c, limit) for t in traffics for n in workers for c in capacities]
    if jobs <= 1:
        return [run_cell(*s) for s in specs]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(run_cell, *zip(*specs)))


# ---------------------------------------------------------------------------------------------------- output

HEADER = ("| traffic | workers | blocks/worker | requests | pooled hit | kv_aware / pooled | round_robin / pooled "
          "| imbalance kv_aware | imbalance least_loaded | TTFT mean kv_aware / least_loaded (s) |")


def markdown(cells: Sequence[Cell]) -> str:
    rows = [HEADER, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells:
        mark = "" if c.meets else " **(below 0.97)**"
        rows.append(f"| {c.traffic} | {c.workers} | {c.capacity_blocks:,} | {c.requests:,} | {c.pooled_hit:.4f} "
                    f"| {c.kv_vs_pooled:.3f}{mark} | {c.rr_vs_pooled:.3f} | {c.kv_imbalance:.3f} "
                    f"| {c.ll_imbalance:.3f} | {c.kv_ttft_mean_s:.2f} / {c.ll_ttft_mean_s:.2f} |")
    return "\n".join(rows)


def summary(cells: Sequence[Cell]) -> dict:
    worst = min(cells, key=lambda c: c.kv_vs_pooled)
    return {"cells": len(cells), "cells_below_target": sum(not c.meets for c in cells), "target": TARGET,
            "min_kv_vs_pooled": worst.kv_vs_pooled,
            "worst_cell": f"{worst.traffic} {worst.workers}x{worst.capacity_blocks}",
            "max_kv_imbalance": max(c.kv_imbalance for c in cells),
            "max_ll_imbalance": max(c.ll_imbalance for c in cells)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    ap.add_argument("--capacity", type=int, nargs="+", default=list(CAPACITIES), help="blocks of 512 tokens per worker")
    ap.add_argument("--traffic", nargs="+", default=list(TRAFFIC), choices=list(TRAFFIC))
    ap.add_argument("--limit", type=int, help="replay only the first LIMIT requests of each trace")
    ap.add_argument("--jobs", type=int, default=1, help="processes running cells")
    ap.add_argument("--quick", action="store_true", help="4 and 16 workers x 500 blocks, every traffic, 300 requests")
    ap.add_argument("--json", action="store_true", help="print one JSON object with every cell as the last line")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.workers, args.capacity, args.traffic = [4, 16], [500], list(TRAFFIC)
        args.limit = args.limit or 300
    cells = run_grid(args.traffic, args.workers, args.capacity, args.limit, args.jobs)
    report = {"summary": summary(cells), "cells": [c.as_dict() for c in cells]}
    print(markdown(cells))
    s = report["summary"]
    print(f"\n{s['cells'] - s['cells_below_target']}/{s['cells']} cells at >= {TARGET}x pooled; worst "
          f"{s['min_kv_vs_pooled']:.3f} ({s['worst_cell']}); max imbalance kv_aware {s['max_kv_imbalance']:.3f}, "
          f"least_loaded {s['max_ll_imbalance']:.3f}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
