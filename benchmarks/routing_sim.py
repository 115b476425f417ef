"""Routing benchmark: replay a Mooncake-format trace through the real router index and policies.

    python benchmarks/routing_sim.py                 # full synthetic trace, 8 workers x 2,000 blocks of 512 tokens
    python benchmarks/routing_sim.py --quick --json  # first 500 requests (CI); the last line is one JSON object
    python benchmarks/routing_sim.py --plot out.png

Each simulated worker has an LRU prefix cache of C blocks that publishes real `BlockStored` / `BlockRemoved`
batches (with sequence numbers) into one `router.index.PrefixIndex`; each request is routed by a real
`router.policy` function from `index.match(...)` and a `router.load.LoadView` of the simulated queues.

Time model: requests arrive at their trace timestamps; a worker serves its jobs first-come first-served, one at a
time. A prefill job takes uncached_tokens / prefill_tps; a decode job takes output_tokens * decode_s_per_token
(the per-request share of a batched decode step) and starts after its prefill (+ KV transfer when disaggregated).
TTFT = queue wait + prefill. Cache lookups and inserts happen when a request is routed (as in the single-LRU figures
of benchmarks/data/README.md, which `--sanity` reproduces).

Figures: token hit ratio (prompt tokens served from the prefill worker's cache, prefix semantics), block hit ratio,
load imbalance = max / mean of per-worker BUSY TIME (seconds of prefill + decode work; the requests-processed
ratio is reported too), TTFT mean / p99. Baselines measured in the same run: `round_robin`, `least_loaded`, and one
pooled LRU of N x C blocks with no routing at all (the ceiling for N separate caches of C). A second scenario puts
one long common prefix (`--hot-prefix-blocks`) in front of every request: kv_aware with and without its load guard.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from kvstore.events import MEDIUM_DEVICE, BlockRemoved, BlockStored, KVEventBatch
from router.cost_model import CostModelConfig
from router.index import PrefixIndex, WorkerId
from router.load import LoadView, WorkerLoad
from router.policy import Policy, RouteRequest, get_policy

from mooncake_trace import TRACE_BLOCK, TraceRequest, find_trace, load_trace, with_hot_prefix  # beside this script


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    capacity_blocks: int = 2_000
    prefill_tokens_per_s: float = 10_000.0
    decode_s_per_token: float = 0.002
    busy_half_life_s: float = 600.0
    peer_fetch: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1 or self.capacity_blocks < 1:
            raise ValueError(f"workers and capacity_blocks must be >= 1, got {self.workers}, {self.capacity_blocks}")
        if self.prefill_tokens_per_s <= 0 or self.decode_s_per_token < 0 or self.busy_half_life_s <= 0:
            raise ValueError("prefill_tokens_per_s and busy_half_life_s must be > 0, decode_s_per_token >= 0")

    def cost_model(self, **changes: object) -> CostModelConfig:
        return CostModelConfig(block_size=TRACE_BLOCK, prefill_tokens_per_s=self.prefill_tokens_per_s,
                               peer_fetch=self.peer_fetch).replace(**changes)


def block_key(hash_id: int) -> bytes:
    """A trace id as a 16-byte block hash (equal ids, equal prefixes: the chained-hash contract of DESIGN §3)."""
    return hash_id.to_bytes(16, "big")


# ------------------------------------------------------------------------------------------------- LRU caches

class LruCache:
    """A prefix cache of `capacity` blocks, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefix_run(self, hash_ids: Sequence[int]) -> int:
        k = 0
        while k < len(hash_ids) and hash_ids[k] in self.blocks:
            k += 1
        return k

    def touch(self, hash_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Use every block in order (inserting the missing ones); returns (stored, evicted) ids."""
        stored, evicted = [], []
        for h in hash_ids:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                stored.append(h)
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return stored, evicted


def pooled_lru(trace: Sequence[TraceRequest], capacity: int) -> dict[str, float]:
    """One LRU cache of `capacity` blocks serving every request: the no-routing ceiling."""
    cache = LruCache(capacity)
    hit_t = tot_t = hit_b = tot_b = 0
    for r in trace:
        k = cache.prefix_run(r.hash_ids)
        hit_t += r.prefix_tokens(k)
        tot_t += r.input_length
        hit_b += k
        tot_b += len(r.hash_ids)
        cache.touch(r.hash_ids)
    return {"token_hit_ratio": hit_t / tot_t, "block_hit_ratio": hit_b / tot_b}


# ------------------------------------------------------------------------------------------ simulated workers

@dataclass
class SimWorker:
    worker_id: WorkerId
    cache: LruCache
    free_at: float = 0.0
    busy_s: float = 0.0
    decayed_busy_s: float = 0.0
    decayed_at: float = 0.0
    requests: int = 0
    seq: int = 0
    ends: deque = field(default_factory=deque)  # end times of queued jobs, ascending

    def load(self, now: float, half_life_s: float) -> WorkerLoad:
        while self.ends and self.ends[0] <= now:
            self.ends.popleft()
        self.decayed_busy_s *= 0.5 ** ((now - self.decayed_at) / half_life_s)
        self.decayed_at = now
        return WorkerLoad(self.worker_id, "both", len(self.ends), 0, max(0.0, self.free_at - now), self.decayed_busy_s)

    def run_job(self, ready_at: float, seconds: float) -> tuple[float, float]:
        """Queue a job that may start at `ready_at`; returns (start, end)."""
        start = max(self.free_at, ready_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        self.decayed_busy_s += seconds
        self.ends.append(self.free_at)
        return start, self.free_at

    def publish(self, index: PrefixIndex, hash_ids: Sequence[int]) -> None:
        """Touch the blocks and send the resulting events to the index, as a worker's KV-event stream would."""
        stored, evicted = self.cache.touch(hash_ids)
        events: list = []
        for first, run in _chains(stored, hash_ids):
            parent = hash_ids[first - 1] if first else None
            events.append(BlockStored([block_key(h) for h in run], None if parent is None else block_key(parent),
                                      [], TRACE_BLOCK, None, MEDIUM_DEVICE))
        if evicted:
            events.append(BlockRemoved([block_key(h) for h in evicted], MEDIUM_DEVICE))
        result = index.apply(self.worker_id, KVEventBatch(0.0, events), self.seq)
        assert result.status == "applied", result
        self.seq += 1


def _chains(stored: list[int], hash_ids: Sequence[int]) -> Iterable[tuple[int, list[int]]]:
    """Split newly stored ids into runs consecutive in the request's chain: (position of the first, run)."""
    pos = {h: i for i, h in enumerate(hash_ids)}
    run: list[int] = []
    for h in stored:
        if run and pos[h] != pos[run[-1]] + 1:
            yield pos[run[0]], run
            run = []
        run.append(h)
    if run:
        yield pos[run[0]], run


# --------------------------------------------------------------------------------------------- the simulation

@dataclass
class Tally:
    hit_tokens: int = 0
    peer_tokens: int = 0
    total_tokens: int = 0
    hit_blocks: int = 0
    total_blocks: int = 0
    disaggregated: int = 0
    mispredicted: int = 0  # decisions whose predicted cached tokens differ from what the worker's cache held
    ttft: list = field(default_factory=list)
    route_s: float = 0.0


def simulate(trace: Sequence[TraceRequest], policy: Policy, sim: SimConfig, cost: CostModelConfig) -> dict:
    index = PrefixIndex()
    workers = [SimWorker(WorkerId(f"w{i:02d}"), LruCache(sim.capacity_blocks)) for i in range(sim.workers)]
    by_id = {w.worker_id: w for w in workers}
    tally = Tally()
    for seq, r in enumerate(trace):
        t0 = time.perf_counter()
        keys = tuple(block_key(h) for h in r.hash_ids)
        view = LoadView(tuple(w.load(r.ts_s, sim.busy_half_life_s) for w in workers))
        decision = policy(RouteRequest(keys, r.input_length, seq), index.match(keys), view, cost)
        tally.route_s += time.perf_counter() - t0
        reused = _serve(r, by_id[decision.prefill_worker], by_id[decision.decode_worker], workers, index, sim, cost,
                        tally)
        tally.disaggregated += decision.disaggregated
        tally.mispredicted += decision.cached_tokens != reused
    return _figures(workers, tally)


def _serve(r: TraceRequest, p: SimWorker, d: SimWorker, workers: list[SimWorker], index: PrefixIndex,
           sim: SimConfig, cost: CostModelConfig, tally: Tally) -> int:
    """Run the request on its workers' queues and caches; returns the prompt tokens it did not recompute."""
    local = p.cache.prefix_run(r.hash_ids)
    reused = local
    if sim.peer_fetch:  # blocks a peer holds are read, not recomputed (pooled host tiers, DESIGN §5)
        while reused < len(r.hash_ids) and any(r.hash_ids[reused] in w.cache.blocks for w in workers):
            reused += 1
    hit_t, reused_t = r.prefix_tokens(local), r.prefix_tokens(reused)
    fetch_s = (reused - local) * cost.block_bytes / cost.tiers.peer.bandwidth_bytes_per_s
    prefill_s = fetch_s + (r.input_length - reused_t) / sim.prefill_tokens_per_s
    decode_s = r.output_length * sim.decode_s_per_token
    if p is d:
        start, _ = p.run_job(r.ts_s, prefill_s + decode_s)
        end = start + prefill_s
    else:
        start, end = p.run_job(r.ts_s, prefill_s)
        d.run_job(end + cost.transfer_s(r.input_length), decode_s)
    p.requests += 1
    tally.ttft.append(end - r.ts_s)
    tally.hit_tokens += hit_t
    tally.peer_tokens += reused_t - hit_t
    tally.total_tokens += r.input_length
    tally.hit_blocks += local
    tally.total_blocks += len(r.hash_ids)
    p.publish(index, r.hash_ids)
    return reused_t


def _figures(workers: list[SimWorker], tally: Tally) -> dict:
    busy = [w.busy_s for w in workers]
    reqs = [w.requests for w in workers]
    ttft = sorted(tally.ttft)
    n = len(ttft)
    return {
        "token_hit_ratio": tally.hit_tokens / tally.total_tokens,
        "block_hit_ratio": tally.hit_blocks / tally.total_blocks,
        "peer_token_ratio": tally.peer_tokens / tally.total_tokens,
        "reuse_ratio": (tally.hit_tokens + tally.peer_tokens) / tally.total_tokens,
        "imbalance_busy": max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        "imbalance_requests": max(reqs) / (sum(reqs) / len(reqs)) if sum(reqs) else 1.0,
        "ttft_mean_s": sum(ttft) / n,
        "ttft_p99_s": ttft[min(n - 1, int(0.99 * n))],
        "disaggregated_fraction": tally.disaggregated / n,
        "route_us": 1e6 * tally.route_s / n,  # load view + index match + policy, per request
        "mispredicted_fraction": tally.mispredicted / n,
    }


# ------------------------------------------------------------------------------------------------- scenarios

POLICY_NAMES = ("kv_aware", "round_robin", "least_loaded")


def run_main(trace: Sequence[TraceRequest], sim: SimConfig) -> dict:
    """Every policy on the trace, plus the pooled cache and the ratios the issue's targets are stated in."""
    cost = sim.cost_model()
    results = {name: simulate(trace, get_policy(name), sim, cost) for name in POLICY_NAMES}
    pooled = pooled_lru(trace, sim.workers * sim.capacity_blocks)
    # With peer fetch a block read from a peer is reused too: compare what was not recomputed.
    basis = "reuse_ratio" if sim.peer_fetch else "token_hit_ratio"
    kv, rr = results["kv_aware"][basis], results["round_robin"][basis]
    return {"policies": results, "pooled": pooled, "ratios": {
        "basis": basis,
        "kv_vs_pooled": kv / pooled["token_hit_ratio"],
        "kv_vs_round_robin": kv / rr if rr else math.inf,
        "pooled_vs_best_policy": pooled["token_hit_ratio"] / max(v[basis] for v in results.values()),
        # The targets (8 workers x 2,000 blocks): >= 0.97x pooled, >= 3x round-robin, imbalance <= 1.1.
        "meets_targets": kv >= 0.97 * pooled["token_hit_ratio"] and kv >= 3 * rr
                         and results["kv_aware"]["imbalance_busy"] <= 1.1,
    }}


def run_hot(trace: Sequence[TraceRequest], sim: SimConfig, hot_blocks: int) -> dict:
    """One hot shared prefix: kv_aware with and without its load guard, against round_robin."""
    hot = with_hot_prefix(trace, hot_blocks)
    cost = sim.cost_model()
    return {"hot_prefix_blocks": hot_blocks, "policies": {
        "kv_aware": simulate(hot, get_policy("kv_aware"), sim, cost),
        "kv_aware_no_guard": simulate(hot, get_policy("kv_aware"), sim, cost.replace(load_slack=math.inf)),
        "round_robin": simulate(hot, get_policy("round_robin"), sim, cost),
    }, "pooled": pooled_lru(hot, sim.workers * sim.capacity_blocks)}


def run_sanity(trace: Sequence[TraceRequest]) -> dict:
    """Single-LRU token hit ratios of benchmarks/data/README.md: 10k blocks 43.1 %, 50k 65.1 %, infinite 65.1 %."""
    caps = {"10000": 10_000, "50000": 50_000, "infinite": len(trace) * 1_000}  # more blocks than the trace has
    return {name: pooled_lru(trace, cap)["token_hit_ratio"] for name, cap in caps.items()}


# ---------------------------------------------------------------------------------------------------- output

def print_table(title: str, rows: dict, pooled: dict) -> None:
    print(f"\n{title}")
    print(f"  {'policy':<20}{'tok hit':>9}{'blk hit':>9}{'peer':>7}{'imb busy':>10}{'imb reqs':>10}"
          f"{'ttft mean':>11}{'ttft p99':>10}{'disagg':>8}{'route us':>10}")
    for name, f in rows.items():
        print(f"  {name:<20}{f['token_hit_ratio']:>9.4f}{f['block_hit_ratio']:>9.4f}{f['peer_token_ratio']:>7.3f}"
              f"{f['imbalance_busy']:>10.3f}{f['imbalance_requests']:>10.3f}{f['ttft_mean_s']:>11.2f}"
              f"{f['ttft_p99_s']:>10.2f}{f['disaggregated_fraction']:>8.2f}{f['route_us']:>10.0f}")
    print(f"  {'pooled LRU (N x C)':<20}{pooled['token_hit_ratio']:>9.4f}{pooled['block_hit_ratio']:>9.4f}")


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main, hot = report["main"], report.get("hot")
    panels = [("token hit ratio (Mooncake trace)", {**{n: f["token_hit_ratio"] for n, f in main["policies"].items()},
                                                    "pooled LRU": main["pooled"]["token_hit_ratio"]}),
              ("load imbalance (max/mean busy time)", {n: f["imbalance_busy"] for n, f in main["policies"].items()})]
    if hot:
        panels.append((f"hot prefix ({hot['hot_prefix_blocks']} blocks): imbalance",
                       {n: f["imbalance_busy"] for n, f in hot["policies"].items()}))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    for i, (ax, (title, bars)) in enumerate(zip(axes, panels)):
        ax.bar(list(bars), list(bars.values()), color=["tab:green", "tab:gray", "tab:blue", "tab:orange"][:len(bars)])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=15)
        if i:
            ax.axhline(1.1, color="red", linestyle="--", label="target 1.1")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", help="Mooncake-format JSONL (default: benchmarks/data/mooncake_synthetic_trace.jsonl)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=2_000, help="blocks of 512 tokens per worker")
    ap.add_argument("--prefill-tps", type=float, default=10_000.0, help="prefill tokens/s per worker")
    ap.add_argument("--decode-s-per-token", type=float, default=0.002)
    ap.add_argument("--peer-fetch", action="store_true", help="workers may read blocks their peers hold")
    ap.add_argument("--hot-prefix-blocks", type=int, default=32, help="0 skips the hot-prefix scenario")
    ap.add_argument("--limit", type=int, help="replay only the first LIMIT requests")
    ap.add_argument("--quick", action="store_true", help="first 500 requests (CI)")
    ap.add_argument("--sanity", action="store_true", help="also check benchmarks/data/README.md's single-LRU figures")
    ap.add_argument("--plot", metavar="PNG")
    ap.add_argument("--json", action="store_true", help="print one JSON object with every figure as the last line")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    limit = 500 if args.quick and args.limit is None else args.limit
    trace = load_trace(find_trace(args.trace), limit)
    sim = SimConfig(args.workers, args.capacity, args.prefill_tps, args.decode_s_per_token, peer_fetch=args.peer_fetch)
    report: dict = {"trace_requests": len(trace), "sim": asdict(sim), "main": run_main(trace, sim)}
    print_table(f"{len(trace)} requests, {sim.workers} workers x {sim.capacity_blocks} blocks",
                report["main"]["policies"], report["main"]["pooled"])
    ratios = report["main"]["ratios"]
    print(f"  [{ratios['basis']}] kv_aware / pooled = {ratios['kv_vs_pooled']:.3f}   kv_aware / round_robin = "
          f"{ratios['kv_vs_round_robin']:.2f}x   pooled / best policy = {ratios['pooled_vs_best_policy']:.3f}   "
          f"targets met: {ratios['meets_targets']}")
    if args.hot_prefix_blocks:
        report["hot"] = run_hot(trace, sim, args.hot_prefix_blocks)
        print_table(f"hot prefix: every request starts with the same {args.hot_prefix_blocks} blocks",
                    report["hot"]["policies"], report["hot"]["pooled"])
    if args.sanity:
        report["sanity_single_lru"] = run_sanity(trace)
        print("\nsingle LRU token hit ratio (benchmarks/data/README.md: 10k 0.431, 50k 0.651, infinite 0.651): " +
              ", ".join(f"{k}: {v:.4f}" for k, v in report["sanity_single_lru"].items()))
    if args.plot:
        plot(report, args.plot)
        print(f"plot saved to {args.plot}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
