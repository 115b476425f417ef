"""The routing cost model: how long a prefix takes to load, the rest to compute, and the KV to reach decode.

Pure arithmetic over a frozen config; no clocks, no I/O. `plan_prefix` picks, for one worker, how much of the
cached prefix is worth loading (a block in a slow tier can cost more to fetch than to recompute):

    blocks   | 0 .. k-1: load (own tier, shared tier, or a peer) | k .. n-1: recompute |
    tokens   | cached_tokens = min(k * block_size, num_tokens)   | uncached            |

The config holds defaults (a PCIe host tier, an NVMe disk, ...), only a starting prior: a worker that measures its
own figures (its prefill rate, each store tier's read latency and bandwidth, a decode worker's KV hand-off reads;
`MeasuredCosts`, from its heartbeats) is priced with those instead, figure by figure, once it rests on
`min_measured_samples` samples: `config.with_measured(m)`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Mapping, Sequence

from router.index import TIERS, fastest_tier

PEER = "peer"  # pseudo-tier: a block held only by another worker, read over the transfer engine
STORE_TIERS: tuple[str, ...] = ("host", "disk", "redis", "s3")  # the tiers a worker measures (its TieredStore's)
TRANSFER = "transfer"  # a decode worker's measured KV hand-off reads (`MeasuredCosts.transfer`)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class LinkCost:
    """A read path: a fixed latency per request plus bytes / bandwidth. `bandwidth = inf` is free (device tier)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        _require(self.bandwidth_bytes_per_s > 0, f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        _require(self.latency_s >= 0, f"latency_s must be >= 0, got {self.latency_s}")

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class TierCosts:
    """Read cost of each tier from the worker that uses it (defaults: PCIe host, NVMe, 10 GbE Redis, S3)."""

    device: LinkCost = LinkCost(math.inf)
    host: LinkCost = LinkCost(20e9, 50e-6)
    disk: LinkCost = LinkCost(3e9, 200e-6)
    redis: LinkCost = LinkCost(1.25e9, 500e-6)
    s3: LinkCost = LinkCost(0.5e9, 20e-3)
    peer: LinkCost = LinkCost(12.5e9, 100e-6)  # another worker's host or device tier over RDMA / TCP

    def of(self, tier: str) -> LinkCost:
        return getattr(self, tier)


@dataclass(frozen=True)
class MeasuredRead:
    """One worker's measured reads of one store tier: a call reading n bytes took about latency_s + n / bytes_per_s
    (`bytes_per_s` may be inf: no per-byte cost showed); `samples` = the get calls behind the figures."""

    tier: str
    latency_s: float
    bytes_per_s: float
    samples: int

    def __post_init__(self) -> None:
        _require(self.tier in STORE_TIERS + (TRANSFER,), f"tier must be one of {STORE_TIERS + (TRANSFER,)}, "
                                                         f"got {self.tier!r}")
        _require(self.latency_s >= 0, f"{self.tier} latency_s must be >= 0, got {self.latency_s}")
        _require(self.bytes_per_s > 0, f"{self.tier} bytes_per_s must be > 0 (inf allowed), got {self.bytes_per_s}")
        _require(self.samples >= 0, f"{self.tier} samples must be >= 0, got {self.samples}")

    @property
    def link(self) -> LinkCost:
        return LinkCost(self.bytes_per_s, self.latency_s)


@dataclass(frozen=True)
class MeasuredCosts:
    """What one worker measured of itself (WorkerLoad's measured fields): its prefill rate over `prefill_samples`
    engine steps (0 = none), its store tiers' reads, and (a decode worker) its KV hand-off reads."""

    prefill_tokens_per_s: float = 0.0
    prefill_samples: int = 0
    reads: tuple[MeasuredRead, ...] = ()
    transfer: MeasuredRead | None = None

    def __post_init__(self) -> None:
        _require(self.prefill_tokens_per_s >= 0 and self.prefill_samples >= 0,
                 f"prefill_tokens_per_s and prefill_samples must be >= 0, got {self.prefill_tokens_per_s}, "
                 f"{self.prefill_samples}")


@dataclass(frozen=True)
class CostModelConfig:
    """What the policy assumes about the fleet. Defaults: a Llama-3-8B-class model in bf16.

    recompute_weight: extra weight on prefill seconds beyond their share of this request's TTFT, because a
        recompute also takes capacity from every later request and leaves a second copy of the prefix in the
        fleet's caches (0 = greedy TTFT only). At 8 a holder keeps a request until its queue costs 9x the
        recompute; at 2 conversations left their holder behind one long decode (benchmarks/README.md, Routing grid).
    load_slack, load_floor_s, load_cache_tolerance: the load guard (router.policy). It acts once a worker's recent
        work exceeds (1 + load_slack) * mean recent work + load_floor_s; then a worker may lead the least loaded
        worker holding no more of the prompt by at most max(saving, load_cache_tolerance * share * mean recent
        work), where saving is what its cache saves and share that saving over the whole fetch + prefill
        (`load_slack = inf` turns the guard off).
    local_prefill_max_uncached_tokens: conditional disaggregation. A prompt with at most this many tokens left to
        compute on the best decode worker is prefilled there (no prefill hop, no KV transfer).
    local_prefill_min_backlog_s: conditional disaggregation under load (as Dynamo's prefill queue bound). When the
        chosen prefill worker's backlog is at least this many seconds, a longer prompt may prefill on its decode
        worker too (a decode-only one included), where that scores better (module docstring of router.policy);
        inf = never.
    peer_fetch: whether a worker may load blocks that only its peers hold (pooled host tiers, DESIGN §5).
    min_measured_samples: a worker's measured figure (prefill rate: engine steps; a tier's reads: get calls)
        replaces the default above once it rests on this many samples.
    """

    block_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    kv_bytes_per_token: int = 131_072
    tiers: TierCosts = field(default_factory=TierCosts)
    transfer: LinkCost = LinkCost(12.5e9, 100e-6)  # prefill -> decode KV hand-off
    recompute_weight: float = 8.0
    load_slack: float = 0.1
    load_floor_s: float = 0.0
    load_cache_tolerance: float = 0.5
    local_prefill_max_uncached_tokens: int = 512
    local_prefill_min_backlog_s: float = math.inf
    peer_fetch: bool = False
    min_measured_samples: int = 20

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.prefill_tokens_per_s > 0, f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        _require(self.kv_bytes_per_token >= 0, f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        _require(self.recompute_weight >= 0, f"recompute_weight must be >= 0, got {self.recompute_weight}")
        _require(self.load_slack >= 0, f"load_slack must be >= 0 (inf disables the guard), got {self.load_slack}")
        _require(self.load_floor_s >= 0, f"load_floor_s must be >= 0, got {self.load_floor_s}")
        _require(self.load_cache_tolerance >= 0, f"load_cache_tolerance must be >= 0, got {self.load_cache_tolerance}")
        _require(self.local_prefill_max_uncached_tokens >= 0,
                 f"local_prefill_max_uncached_tokens must be >= 0, got {self.local_prefill_max_uncached_tokens}")
        _require(self.local_prefill_min_backlog_s >= 0,
                 f"local_prefill_min_backlog_s must be >= 0 (inf: never), got {self.local_prefill_min_backlog_s}")
        _require(self.min_measured_samples >= 1,
                 f"min_measured_samples must be >= 1, got {self.min_measured_samples}")

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def prefills_locally(self, uncached_tokens: int) -> bool:
        """Conditional disaggregation, the one rule: a prompt with at most `local_prefill_max_uncached_tokens` left
        to compute on the best decode worker prefills there (no prefill hop, no KV transfer)."""
        return uncached_tokens <= self.local_prefill_max_uncached_tokens

    def spills_to_decode(self, prefill_backlog_s: float) -> bool:
        """Conditional disaggregation under load: whether a prompt whose prefill worker is `prefill_backlog_s`
        behind may prefill on its decode worker instead (where that scores better)."""
        return prefill_backlog_s >= self.local_prefill_min_backlog_s

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def transfer_s(self, tokens: int) -> float:
        return self.transfer.seconds(tokens * self.kv_bytes_per_token) if tokens else 0.0

    def replace(self, **changes: object) -> "CostModelConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return CostModelConfig(**values)  # type: ignore[arg-type]

    def with_measured(self, measured: MeasuredCosts | None) -> "CostModelConfig":
        """This config as one worker sees it: its measured figures where they rest on enough samples, the
        defaults elsewhere (self when nothing qualifies)."""
        if measured is None:
            return self
        changes: dict[str, object] = {}
        if measured.prefill_samples >= self.min_measured_samples and measured.prefill_tokens_per_s > 0:
            changes["prefill_tokens_per_s"] = measured.prefill_tokens_per_s
        links = {r.tier: r.link for r in measured.reads if r.samples >= self.min_measured_samples}
        if links:
            changes["tiers"] = dataclasses.replace(self.tiers, **links)
        if measured.transfer is not None and measured.transfer.samples >= self.min_measured_samples:
            changes["transfer"] = measured.transfer.link
        return self.replace(**changes) if changes else self


@dataclass(frozen=True)
class PrefixPlan:
    """How one worker would serve a prompt's prefix: load `cached_blocks` (from `sources`), compute the rest.
    `available_blocks`: the leading blocks it could have loaded; a plan that stops short of them recomputes blocks
    a tier holds, because reading them would be slower."""

    cached_blocks: int
    cached_tokens: int
    uncached_tokens: int
    fetch_s: float
    prefill_s: float
    sources: tuple[tuple[str, int], ...]  # the loaded blocks as runs of (tier read from, block count)
    available_blocks: int = 0

    @property
    def ttft_s(self) -> float:
        return self.fetch_s + self.prefill_s

    @property
    def max_load_blocks(self) -> int | None:
        """What the worker may load (PrefillRequest.max_load_blocks): `cached_blocks` when the plan stops short of
        what a tier holds, else None (no limit: the worker may also find blocks the router does not know of)."""
        return self.cached_blocks if self.cached_blocks < self.available_blocks else None


_FASTEST = tuple(fastest_tier(m) for m in range(1 << len(TIERS)))


def block_sources(own: Mapping[int, int], shared: Sequence[int], pooled_blocks: int,
                  peer_fetch: bool) -> list[tuple[str, int]]:
    """Runs of (cheapest source, blocks) over the leading blocks a worker can get: its own tiers (`own[i]`, a tier
    mask per block), a shared tier (`shared[i]`) or, with `peer_fetch`, a peer (every block inside the pooled run
    is held by someone)."""
    runs: list[tuple[str, int]] = []
    last, count = None, 0
    for i in range(pooled_blocks):
        tier = _FASTEST[own.get(i, 0) | shared[i]]
        if tier is None:
            if not peer_fetch:
                break
            tier = PEER
        if tier == last:
            count += 1
            continue
        if last is not None:
            runs.append((last, count))
        last, count = tier, 1
    if last is not None:
        runs.append((last, count))
    return runs


def plan_prefix(config: CostModelConfig, sources: list[tuple[str, int]], num_tokens: int) -> PrefixPlan:
    """Choose the cut k (load blocks [0, k), recompute the rest) with the least fetch + prefill time.

    NOTE: inside one run the total is convex in k (linear fetch + a prefill term that flattens at num_tokens), so
    only the run's first block, its last block and the flattening point need checking.
    """
    bs = config.block_size
    kink = -(-num_tokens // bs)  # first k whose prefix covers every token
    best = (config.prefill_s(num_tokens), 0)  # (total seconds, k)
    k, used, fetch_at = 0, set(), [0.0]  # fetch_at[j]: fetch seconds of the first j runs
    for tier, count in sources:
        link = config.tiers.of(tier)
        per_block = config.block_bytes / link.bandwidth_bytes_per_s
        base = fetch_at[-1] + (0.0 if tier in used else link.latency_s)
        used.add(tier)
        for j in {1, count, kink - k} & set(range(1, count + 1)):
            total = base + j * per_block + config.prefill_s(max(num_tokens - (k + j) * bs, 0))
            if (total, k + j) < best:
                best = (total, k + j)
        k += count
        fetch_at.append(base + count * per_block)
    return _plan_at(config, sources, best[1], num_tokens)


def _plan_at(config: CostModelConfig, sources: list[tuple[str, int]], k: int, num_tokens: int) -> PrefixPlan:
    runs, left, fetch, used = [], k, 0.0, set()
    for tier, count in sources:
        if left == 0:
            break
        take = min(count, left)
        link = config.tiers.of(tier)
        fetch += take * config.block_bytes / link.bandwidth_bytes_per_s + (0.0 if tier in used else link.latency_s)
        used.add(tier)
        runs.append((tier, take))
        left -= take
    cached = min(k * config.block_size, num_tokens)
    available = sum(count for _, count in sources)
    return PrefixPlan(k, cached, num_tokens - cached, fetch, config.prefill_s(num_tokens - cached), tuple(runs),
                      available)


__all__ = ["PEER", "STORE_TIERS", "TIERS", "LinkCost", "TierCosts", "MeasuredCosts", "MeasuredRead",
           "CostModelConfig", "PrefixPlan", "block_sources", "plan_prefix"]
