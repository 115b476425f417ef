"""Routing policies (DESIGN §2 step 2): pure functions of (request, index match, load view, cost model).

Every policy has the same signature and is looked up by the name users write in config:

    decision = get_policy("kv_aware")(request, index.match(request.block_hashes), load_view, cost_config)

`kv_aware` predicts time to first token for each (prefill, decode) pair:

    ttft(p, d) = backlog(p) + fetch(p: cached prefix from the fastest tier, a shared tier or a peer)
               + prefill(p: uncached tokens) + transfer(p -> d: KV bytes of the prompt, 0 when p == d)

and picks the pair with the lowest ttft + recompute_weight * prefill (a recompute also costs later requests
capacity), among the workers the load guard allows, ties broken by load, then worker id. Each worker is priced with
its own measured prefill rate and tier read costs where it reports them (`CostModelConfig.with_measured`). Short or
almost fully cached prompts prefill on their decode worker (conditional disaggregation), and so may longer ones
while the prefill workers are `local_prefill_min_backlog_s` behind (conditional disaggregation under load). Cache
salt needs no code here: a different salt gives different block hashes (DESIGN §3), so a tenant's blocks never
match another tenant's query.

The load guard (`_within_guard`) keeps a hot prefix from piling every request on its holders, without breaking up
a prefix that only one worker holds (a conversation's history). It acts once some worker's recent work is past

    bound      = (1 + load_slack) * mean recent work + load_floor_s

and then holds each worker w against its alternative: the least loaded worker holding no more of the prompt than w
(the next-longest holder or a cold worker, never an arbitrary one):

    depth(w)   = blocks w's plan loads (plan.cached_blocks)
    alt(w)     = least loaded (recent work, backlog, queue, id) of {v : depth(v) <= depth(w)}, w itself possibly;
                 the least loaded worker of all when it holds more than w (moving there saves work: saving < 0)
    saving(w)  = plan(alt).ttft - plan(w).ttft            the fetch + prefill a move to alt adds: w's cache, recomputed
    share(w)   = saving(w) / plan(alt).ttft               the part of the request's work w's cache saves, 0 .. 1
    w allowed  <=> w is alt(w)
                   or recent(w) - recent(alt) <= max(saving(w), load_cache_tolerance * share(w) * mean recent work)

So a worker whose cache saves little (the first block every request shares, which every worker holds) takes new
work only while it is the least loaded of its depth: new conversations spread over the fleet. A worker holding most
of the prompt keeps it until it leads its alternative by that share of the mean load, so a conversation stays on its
worker through the ordinary imbalance whole conversations leave, and a hot prefix is copied to the next worker once
its holders run further ahead than that. The lead is held against the mean, not in seconds alone, because recent
work is a decayed sum whose size follows the half-life (30 s in the registry, 600 s in benchmarks/routing_sim.py);
`saving` is the floor at low load, where a move would recompute more than the imbalance it removes. Among the
allowed workers the cost decides, so a request its longest holder may not take goes to the next-longest holder
unless that one's own lead or queue forbids it too.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random as _random
from dataclasses import dataclass
from typing import Callable, Sequence

from router.cost_model import CostModelConfig, PrefixPlan, block_sources, plan_prefix
from router.index import BlockKey, MatchResult, WorkerId
from router.load import LoadView, WorkerLoad


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows about a request when it routes it. `seq` numbers requests (round-robin, random)."""

    block_hashes: tuple[BlockKey, ...]
    num_tokens: int
    seq: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes. `disaggregated` is prefill_worker != decode_worker; `cached_tokens` are the prompt
    tokens the prefill worker is predicted to load rather than compute; `reason` is for logs and operators.

    work_s: the prefill worker's own seconds for the prompt (fetch + prefill, no queue wait, no hand-off): what the
        router charges to its recent work. max_load_blocks: the most leading blocks the prefill worker should read
        from its store tiers (PrefillRequest.max_load_blocks), set when the plan recomputes blocks a slow tier
        holds; None = no limit.
    """

    prefill_worker: WorkerId
    decode_worker: WorkerId
    disaggregated: bool
    predicted_ttft_s: float
    cached_tokens: int
    reason: str
    work_s: float = 0.0
    max_load_blocks: int | None = None


Policy = Callable[[RouteRequest, MatchResult, LoadView, CostModelConfig], RouteDecision]


class NoWorkerError(RuntimeError):
    """No worker can take the request (no prefill-capable or no decode-capable worker in the load view)."""


# ----------------------------------------------------------------------------------------------------- helpers

def _plan(request: RouteRequest, match: MatchResult, w: WorkerLoad, config: CostModelConfig) -> PrefixPlan:
    """The worker's plan, priced with its own measured figures where it has them."""
    sources = block_sources(match.local.get(w.worker_id, {}), match.shared_masks, match.pooled_blocks,
                            config.peer_fetch)
    return plan_prefix(config.with_measured(w.measured), sources, request.num_tokens)


def _plans(request: RouteRequest, match: MatchResult, workers: Sequence[WorkerLoad],
           config: CostModelConfig) -> dict[WorkerId, PrefixPlan]:
    """One plan per worker; workers holding none of the blocks themselves and measuring nothing share one (shared
    tiers and peers only, default costs)."""
    plans: dict[WorkerId, PrefixPlan] = {}
    anonymous: PrefixPlan | None = None
    for w in workers:
        if w.worker_id in match.local or w.measured is not None:
            plans[w.worker_id] = _plan(request, match, w, config)
        else:
            anonymous = anonymous or _plan(request, match, w, config)
            plans[w.worker_id] = anonymous
    return plans


def _load_key(w: WorkerLoad) -> tuple:
    """Tie-break order: least recent work, then least backlog, then shortest queue, then worker id."""
    return (w.recent_busy_s, w.backlog_s, w.queue_len, w.worker_id)


def _momentary_key(w: WorkerLoad) -> tuple:
    return (w.backlog_s, w.queue_len, w.recent_busy_s, w.worker_id)


def _ratio_guard(workers: Sequence[WorkerLoad], config: CostModelConfig) -> tuple[WorkerLoad, ...]:
    """Workers whose recent work is within (1 + slack) * mean + floor. Never empty.

    NOTE: it bounds recent work (a decayed sum of the seconds assigned, queued work included), not the momentary
    backlog: the backlog is already a term of the predicted TTFT, while a hot prefix makes its holders the cheapest
    choice for every request at every moment, so only a long-run share stops it from starving the other workers.
    """
    if math.isinf(config.load_slack):
        return tuple(workers)
    mean = sum(w.recent_busy_s for w in workers) / len(workers)
    bound = (1.0 + config.load_slack) * mean + config.load_floor_s
    allowed = tuple(w for w in workers if w.recent_busy_s <= bound)
    return allowed or (min(workers, key=_load_key),)


def _alternatives(workers: Sequence[WorkerLoad], plans: dict[WorkerId, PrefixPlan]) -> dict[WorkerId, WorkerLoad]:
    """alt(w) of the load guard (module docstring), for every worker."""
    def depth(w: WorkerLoad) -> int:
        return plans[w.worker_id].cached_blocks

    least = min(workers, key=_load_key)
    alts: dict[WorkerId, WorkerLoad] = {}
    best: WorkerLoad | None = None  # the least loaded worker of the levels seen so far (shallowest first)
    for _, level in itertools.groupby(sorted(workers, key=depth), key=depth):
        level = list(level)
        best = min(level + ([best] if best else []), key=_load_key)
        alts.update((w.worker_id, least if depth(least) > depth(w) else best) for w in level)
    return alts


def _tolerance_s(plan: PrefixPlan, alt_plan: PrefixPlan, mean_busy_s: float, config: CostModelConfig) -> float:
    """How far a worker with `plan` may lead its alternative in recent work (module docstring)."""
    saving_s = alt_plan.ttft_s - plan.ttft_s
    if saving_s <= 0:
        return 0.0
    share = saving_s / alt_plan.ttft_s  # alt_plan.ttft_s > saving_s > 0
    return max(saving_s, config.load_cache_tolerance * share * mean_busy_s)


def _within_guard(workers: Sequence[WorkerLoad], plans: dict[WorkerId, PrefixPlan],
                  config: CostModelConfig) -> tuple[WorkerLoad, ...]:
    """The load guard (module docstring): every worker while all are within the ratio bound, else each worker that
    is its own alternative or leads it by no more than its cache earns. Never empty (the least loaded worker is its
    own alternative); order kept."""
    if len(_ratio_guard(workers, config)) == len(workers):
        return tuple(workers)
    mean = sum(w.recent_busy_s for w in workers) / len(workers)
    alts = _alternatives(workers, plans)

    def keeps(w: WorkerLoad) -> bool:
        alt = alts[w.worker_id]
        lead_s = w.recent_busy_s - alt.recent_busy_s
        return alt is w or lead_s <= _tolerance_s(plans[w.worker_id], plans[alt.worker_id], mean, config)

    return tuple(w for w in workers if keeps(w))


def _candidates(load: LoadView) -> tuple[tuple[WorkerLoad, ...], tuple[WorkerLoad, ...]]:
    prefill, decode = load.prefill_workers(), load.decode_workers()
    if not prefill or not decode:
        raise NoWorkerError(f"need a prefill-capable and a decode-capable worker in the load view, "
                            f"have {len(prefill)} and {len(decode)}")
    return prefill, decode


def _route(p: WorkerLoad, d: WorkerLoad, plan: PrefixPlan, ttft_s: float, reason: str) -> RouteDecision:
    return RouteDecision(p.worker_id, d.worker_id, p.worker_id != d.worker_id, ttft_s, plan.cached_tokens, reason,
                         plan.ttft_s, plan.max_load_blocks)


def _decision(request: RouteRequest, match: MatchResult, p: WorkerLoad, d: WorkerLoad, config: CostModelConfig,
              reason: str) -> RouteDecision:
    plan = _plan(request, match, p, config)
    ttft = p.backlog_s + plan.ttft_s + (0.0 if p.worker_id == d.worker_id else config.transfer_s(request.num_tokens))
    return _route(p, d, plan, ttft, reason)


# ----------------------------------------------------------------------------------------------------- kv_aware

def _best_by_cost(workers: Sequence[WorkerLoad], plans: dict[WorkerId, PrefixPlan], config: CostModelConfig,
                  hop_s: float, hop_free: WorkerId | None) -> tuple[tuple, WorkerLoad, float]:
    """(score, worker, ttft) of the worker with the least ttft + recompute_weight * prefill. The P->D hop costs
    `hop_s` unless the worker is `hop_free` (or `hop_free` is None: prefill on the decode worker itself)."""
    best = None
    for w in workers:
        plan = plans[w.worker_id]
        hop = 0.0 if hop_free in (None, w.worker_id) else hop_s
        ttft = w.backlog_s + plan.ttft_s + hop
        key = (ttft + config.recompute_weight * plan.prefill_s, _load_key(w))
        if best is None or key < best[0]:
            best = (key, w, ttft)
    assert best is not None
    return best


def kv_aware(request: RouteRequest, match: MatchResult, load: LoadView, config: CostModelConfig) -> RouteDecision:
    """Cache- and load-aware choice with a load guard and conditional disaggregation (module docstring).

    1. local: the best decode-capable worker prefilling the request itself (no hop). Taken outright when at most
       `local_prefill_max_uncached_tokens` tokens remain to compute there (short or almost fully cached prompts).
    2. pair: decode on the least loaded decoder d, prefill on the best prefill worker p (+ the P->D hop if p != d).
       Taken when it scores better than local; a tie stays local. A decode-only worker is not offered as local,
       unless p is at least `local_prefill_min_backlog_s` behind (the prefill pool is saturated: the decode
       worker's spare time then shortens the queue, at the price of its streams waiting out the prompt's chunks).
    """
    prefill, decode = _candidates(load)
    plans = _plans(request, match, load.workers, config)
    local_key, local, local_ttft = _best_by_cost(_within_guard(decode, plans, config), plans, config, 0.0, None)
    local_plan = plans[local.worker_id]
    if local_plan.uncached_tokens <= config.local_prefill_max_uncached_tokens:
        return _route(local, local, local_plan, local_ttft, f"local prefill: {local_plan.uncached_tokens} uncached "
                                                            f"tokens <= {config.local_prefill_max_uncached_tokens}")
    d = min(_ratio_guard(decode, config), key=_momentary_key)  # its cache plays no part: the hand-off brings the KV
    allowed_p = _within_guard(prefill, plans, config)
    pair_key, p, ttft = _best_by_cost(allowed_p, plans, config, config.transfer_s(request.num_tokens), d.worker_id)
    if (local.can_prefill or config.spills_to_decode(p.backlog_s)) and local_key[0] <= pair_key[0]:
        if not local.can_prefill:
            return _route(local, local, local_plan, local_ttft, f"local prefill: {local_plan.uncached_tokens} "
                                                                f"uncached tokens, the prefill worker "
                                                                f"{p.backlog_s:.3f}s behind")
        p, d, ttft = local, local, local_ttft
    plan = plans[p.worker_id]
    return _route(p, d, plan, ttft, f"cached {plan.cached_blocks}/{len(request.block_hashes)} blocks "
                                    f"({'+'.join(sorted({t for t, _ in plan.sources})) or 'none'}); "
                                    f"load guard skipped {len(prefill) - len(allowed_p)} of {len(prefill)}")


# ------------------------------------------------------------------------------------------- simple baselines

def round_robin(request: RouteRequest, match: MatchResult, load: LoadView, config: CostModelConfig) -> RouteDecision:
    """The `seq`-th prefill worker in id order; decode on the same worker when it can, else the `seq`-th decoder."""
    prefill, decode = _candidates(load)
    p = prefill[request.seq % len(prefill)]
    d = p if p.can_decode else decode[request.seq % len(decode)]
    return _decision(request, match, p, d, config, f"round robin #{request.seq}")


def least_loaded(request: RouteRequest, match: MatchResult, load: LoadView, config: CostModelConfig) -> RouteDecision:
    """The least loaded prefill worker (backlog, queue, recent work, id); decode there when it can."""
    prefill, decode = _candidates(load)
    p = min(prefill, key=_momentary_key)
    d = p if p.can_decode else min(decode, key=_momentary_key)
    return _decision(request, match, p, d, config, f"least loaded: backlog {p.backlog_s:.3f}s")


def make_random(seed: int) -> Policy:
    """A uniformly random policy that is still a pure function: the draw depends only on (seed, request.seq)."""

    def random_policy(request: RouteRequest, match: MatchResult, load: LoadView,
                      config: CostModelConfig) -> RouteDecision:
        prefill, decode = _candidates(load)
        rng = _random.Random(seed * 1_000_003 + request.seq)
        p = rng.choice(prefill)
        d = p if p.can_decode else rng.choice(decode)
        return _decision(request, match, p, d, config, f"random (seed {seed})")

    return random_policy


POLICIES: dict[str, Policy] = {
    "kv_aware": kv_aware,
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "random": make_random(0),
}


def local_only(policy: Policy) -> Policy:
    """`policy` for a view without prefill-capable workers (a colocated fleet, or its prefill pool is out): every
    decode worker prefills its own requests, so each is offered as `both` and the request runs, undisaggregated,
    where `policy` would prefill it (its cache, load and turn count as they do for prefill workers)."""
    def route(request: RouteRequest, match: MatchResult, load: LoadView, config: CostModelConfig) -> RouteDecision:
        decoders = load.decode_workers()
        if not decoders:
            raise NoWorkerError("no decode-capable worker in the load view")
        decision = policy(request, match, LoadView.of(dataclasses.replace(w, role="both") for w in decoders), config)
        return dataclasses.replace(decision, decode_worker=decision.prefill_worker, disaggregated=False,
                                   reason=f"no prefill worker, local: {decision.reason}")
    return route


def get_policy(name: str, seed: int | None = None) -> Policy:
    """The policy registered under `name`; `seed` picks the stream of `random`."""
    if name == "random" and seed is not None:
        return make_random(seed)
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None
