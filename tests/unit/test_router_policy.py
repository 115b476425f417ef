"""Routing policies: pure functions of (request, index match, load view, cost model) (DESIGN §2 step 2)."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from kvstore.events import BlockStored, KVEventBatch
from kvstore.hashing import Namespace, hash_blocks
from router.cost_model import (
    CostModelConfig,
    LinkCost,
    MeasuredCosts,
    MeasuredRead,
    TierCosts,
    block_sources,
    plan_prefix,
)
from router.index import PrefixIndex, WorkerId
from router.load import LoadView, WorkerLoad
from router.registry import LoadFigures, ModelFacts, WorkerRecord, WorkerRegistry
from router.policy import (
    POLICIES,
    NoWorkerError,
    RouteRequest,
    get_policy,
    kv_aware,
    least_loaded,
    local_only,
    round_robin,
)

BS = 4  # tokens per block in these tests
# 1,000 tokens/s: a block of 4 tokens takes 4 ms to compute; no KV bytes, so transfers are free unless a test says.
CFG = CostModelConfig(block_size=BS, prefill_tokens_per_s=1000.0, kv_bytes_per_token=0,
                      local_prefill_max_uncached_tokens=0)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(ids) -> tuple[bytes, ...]:
    return tuple(h(i) for i in ids)


def make_index(seq: int = 0, **holdings) -> PrefixIndex:
    """`make_index(w0=[0, 1, 2])`: each worker holds those blocks in its device tier; `w0=([0, 1], "host")`."""
    index = PrefixIndex()
    for worker, held in holdings.items():
        ids, medium = held if isinstance(held, tuple) else (held, "GPU")
        index.apply(WorkerId(worker), KVEventBatch(0.0, [BlockStored(list(chain(ids)), None, [], BS, None, medium)]),
                    seq)
    return index


def make_load(n: int = 3, role: str = "both", prefix: str = "w", **fields) -> list[WorkerLoad]:
    """n workers; `backlog_s={"w1": 2.0}`, `recent_busy_s={...}`, `queue_len={...}` override per worker."""
    out = []
    for i in range(n):
        wid = WorkerId(f"{prefix}{i}")
        out.append(WorkerLoad(wid, role, backlog_s=fields.get("backlog_s", {}).get(wid, 0.0),
                              recent_busy_s=fields.get("recent_busy_s", {}).get(wid, 0.0),
                              queue_len=fields.get("queue_len", {}).get(wid, 0)))
    return out


def make_request(num_blocks: int = 8, seq: int = 0, start: int = 0) -> RouteRequest:
    return RouteRequest(chain(range(start, start + num_blocks)), num_blocks * BS, seq)


def route(policy, request, index, loads, config=CFG):
    return policy(request, index.match(request.block_hashes), LoadView.of(loads), config)


# ---------------------------------------------------------------------------------------------------- kv_aware

def test_kv_aware_picks_the_worker_with_the_cached_prefix():
    index = make_index(w0=[0, 1], w1=[0, 1, 2, 3, 4, 5], w2=[0])
    d = route(kv_aware, make_request(8), index, make_load(3))
    assert (d.prefill_worker, d.decode_worker, d.disaggregated) == ("w1", "w1", False)
    assert d.cached_tokens == 6 * BS
    assert d.predicted_ttft_s == pytest.approx(2 * BS / 1000.0)  # the 2 uncached blocks


def test_kv_aware_predicted_ttft_adds_queue_wait_and_transfer():
    cfg = CFG.replace(kv_bytes_per_token=1000, transfer=LinkCost(1e6, 0.001))
    loads = [WorkerLoad(WorkerId("p1"), "prefill", backlog_s=0.5), WorkerLoad(WorkerId("d1"), "decode")]
    index = make_index(p1=[0, 1, 2, 3, 4, 5])
    d = route(kv_aware, make_request(8), index, loads, cfg)
    # 0.5 s queue + 8 uncached tokens at 1,000/s + transfer of 32 tokens x 1,000 B at 1 MB/s + 1 ms latency
    assert (d.prefill_worker, d.decode_worker, d.disaggregated) == ("p1", "d1", True)
    assert d.predicted_ttft_s == pytest.approx(0.5 + 0.008 + 0.032 + 0.001)


def test_kv_aware_leaves_a_cache_holder_whose_queue_costs_more_than_the_recompute():
    index = make_index(w0=[0, 1, 2, 3, 4, 5, 6, 7])
    cfg = CFG.replace(recompute_weight=0.0)
    near = route(kv_aware, make_request(8), index, make_load(2, backlog_s={"w0": 0.02}), cfg)
    far = route(kv_aware, make_request(8), index, make_load(2, backlog_s={"w0": 0.05}), cfg)
    assert near.prefill_worker == "w0"  # 20 ms wait < 32 ms of recompute
    assert far.prefill_worker == "w1" and far.cached_tokens == 0


def test_recompute_weight_keeps_requests_on_the_cache_longer():
    index = make_index(w0=[0, 1, 2, 3, 4, 5, 6, 7])
    d = route(kv_aware, make_request(8), index, make_load(2, backlog_s={"w0": 0.05}), CFG.replace(recompute_weight=1))
    assert d.prefill_worker == "w0"  # 50 ms wait < 32 ms x (1 + 1)


def test_kv_aware_cold_request_goes_to_the_least_loaded_then_lowest_id():
    index = make_index()
    assert route(kv_aware, make_request(4), index, make_load(3, recent_busy_s={"w0": 5, "w1": 1, "w2": 1})
                 ).prefill_worker == "w1"
    assert route(kv_aware, make_request(4), index, make_load(3)).prefill_worker == "w0"


def test_load_guard_skips_an_overloaded_holder():
    index = make_index(w0=[0, 1, 2, 3, 4, 5, 6, 7])
    busy = {"w0": 10.0, "w1": 4.0, "w2": 4.0}  # mean 6; w0 is above 1.1 x 6, 6 s ahead of w1 > 32 ms of recompute
    loads = make_load(3, recent_busy_s=busy, queue_len={"w0": 2})
    assert route(kv_aware, make_request(8), index, loads).prefill_worker == "w1"
    no_guard = CFG.replace(load_slack=math.inf)
    assert route(kv_aware, make_request(8), index, loads, no_guard).prefill_worker == "w0"


def test_load_guard_holds_an_idle_holder_to_the_share_its_cache_saves():
    """Being idle no longer exempts a worker past its bound (it did: at low load every worker is idle, so the guard
    never acted and new conversations piled on the workers holding their shared first block). w0's 8 host blocks
    save 32 of the 40 ms the request costs elsewhere (share 0.8): it may lead w1 by 0.5 x 0.8 x the mean."""
    index = make_index(w0=([0, 1, 2, 3, 4, 5, 6, 7], "host"))
    near = make_load(3, recent_busy_s={"w0": 7.0, "w1": 5.0, "w2": 5.5})  # lead 2.0 <= 0.5 x 0.8 x 5.83 = 2.33
    far = make_load(3, recent_busy_s={"w0": 10.0, "w1": 4.0, "w2": 4.0})  # lead 6.0 > 0.5 x 0.8 x 6 = 2.4
    kept = route(kv_aware, make_request(10), index, near)
    assert (kept.prefill_worker, kept.cached_tokens) == ("w0", 32)
    assert "load guard skipped 1 of 3" in kept.reason  # w2 leads w1 with nothing more cached: no claim
    moved = route(kv_aware, make_request(10), index, far)
    assert (moved.prefill_worker, moved.cached_tokens) == ("w1", 0)


def test_load_guard_keeps_a_busy_holder_until_its_lead_exceeds_what_its_cache_saves():
    """w0 has a queue and is past the bound (any lead is, against an idle peer); its 8 cached blocks save 32 ms of
    prefill (1,000 tokens/s): it keeps the request while it leads w1 by at most that, and loses it beyond."""
    index = make_index(w0=([0, 1, 2, 3, 4, 5, 6, 7], "host"))
    near = make_load(2, recent_busy_s={"w0": 0.030}, queue_len={"w0": 1})
    far = make_load(2, recent_busy_s={"w0": 0.034}, queue_len={"w0": 1})
    assert route(kv_aware, make_request(8), index, near).prefill_worker == "w0"
    moved = route(kv_aware, make_request(8), index, far)
    assert (moved.prefill_worker, moved.cached_tokens) == ("w1", 0)


def test_load_guard_still_spreads_workers_without_a_cache_advantage():
    index = make_index(w0=[0, 1, 2, 3], w1=[0, 1, 2, 3])  # both hold the prefix: w0 saves nothing over w1
    loads = make_load(2, recent_busy_s={"w0": 1.0, "w1": 0.5})
    assert route(kv_aware, make_request(8), index, loads).prefill_worker == "w1"


def test_longest_prefix_holder_wins_over_workers_holding_only_the_shared_first_block():
    """The conversation case: every worker holds block 0 (the system prompt), w1 holds the conversation (8 of 10
    blocks) and is past its bound with a request running. Its cache saves 28 of the 36 ms any other worker would
    compute (share 0.78), so it may lead the least loaded, w2, by 0.5 x 0.78 x the mean: 3.74 s here. The guard used
    to compare its lead with the 28 ms alone and send the request to w2, which recomputed 9 blocks."""
    index = make_index(w0=[0], w1=[0, 1, 2, 3, 4, 5, 6, 7], w2=[0], w3=[0])
    busy = {"w0": 10.0, "w1": 11.5, "w2": 8.0, "w3": 9.0}  # mean 9.625: w1 past 1.1 x mean, leads w2 by 3.5 s
    loads = make_load(4, recent_busy_s=busy, queue_len={"w1": 1}, backlog_s={"w1": 0.005})
    d = route(kv_aware, make_request(10), index, loads)
    assert (d.prefill_worker, d.cached_tokens) == ("w1", 32)
    busy["w1"] = 14.0  # mean 10.25: a 6 s lead is past 0.5 x 0.78 x 10.25 = 3.99 s
    moved = route(kv_aware, make_request(10), index, make_load(4, recent_busy_s=busy, queue_len={"w1": 1}))
    assert (moved.prefill_worker, moved.cached_tokens) == ("w2", 4)


def test_load_guard_sends_what_the_longest_holder_may_not_take_to_the_next_longest():
    """w0 (8 blocks) leads far; w1 (5 blocks) leads the least loaded worker w2 (block 0 only) by 1 s, within what
    its 16 ms saving of 36 earns (0.5 x 0.44 x 6.375 = 1.42 s): w1 takes it, not a worker holding block 0 alone."""
    index = make_index(w0=list(range(8)), w1=list(range(5)), w2=[0], w3=[0])
    busy = {"w0": 12.0, "w1": 5.0, "w2": 4.0, "w3": 4.5}
    d = route(kv_aware, make_request(10), index, make_load(4, recent_busy_s=busy, queue_len={"w0": 3}))
    assert (d.prefill_worker, d.cached_tokens) == ("w1", 20)
    assert "load guard skipped 2 of 4" in d.reason  # w0 (too far ahead) and w3 (behind w2, same depth)


def test_load_guard_gives_holders_of_the_same_prefix_length_the_request_by_recent_work():
    """w0 and w1 hold the same 8 blocks; w2 (nothing) is past its bound, so the guard acts: among equal holders the
    one with less recent work takes it, though w0's queue is momentarily shorter."""
    index = make_index(w0=list(range(8)), w1=list(range(8)))
    loads = make_load(3, recent_busy_s={"w0": 6.0, "w1": 4.0, "w2": 8.5}, backlog_s={"w1": 0.002})
    d = route(kv_aware, make_request(10), index, loads)
    assert (d.prefill_worker, d.cached_tokens) == ("w1", 32)


def test_new_conversations_go_to_the_least_loaded_worker_not_the_holders_of_the_shared_block():
    """A request matching only block 0: the holders of block 0 save 4 ms, nothing against a lead of seconds, so the
    least loaded worker takes it even though it must compute block 0 itself."""
    index = make_index(w0=[0], w1=[0], w2=[0])
    loads = make_load(4, recent_busy_s={"w0": 9.0, "w1": 8.0, "w2": 8.5, "w3": 2.0})
    d = route(kv_aware, RouteRequest(chain([0, 900, 901, 902]), 16), index, loads)
    assert (d.prefill_worker, d.cached_tokens) == ("w3", 0)


def test_load_guard_never_leaves_a_cold_worker_a_claim_over_a_less_loaded_holder():
    """w2 holds nothing and has the most recent work: a worker holding more with less work is its alternative, so
    it is not allowed even when the holders' queues make it the cheapest."""
    index = make_index(w0=list(range(8)), w1=list(range(8)))
    loads = make_load(3, recent_busy_s={"w0": 5.0, "w1": 4.0, "w2": 9.0}, backlog_s={"w0": 0.5, "w1": 0.5})
    d = route(kv_aware, make_request(10), index, loads, CFG.replace(recompute_weight=0.0))
    assert d.prefill_worker == "w1"  # 0.5 s queue + 8 ms > 40 ms on w2, but w2 may not take it


def _serve_through_registry(index: PrefixIndex, n_requests: int, concurrent: bool) -> list:
    """The live router's accounting: the real registry's load view (recent work decayed from `begin`, the queue
    from in-flight steps), 2 prefill + 2 decode workers, requests sharing a 16-block prefix + 2 blocks each."""
    now = [0.0]
    registry = WorkerRegistry(clock=lambda: now[0])
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        registry.register(WorkerRecord(WorkerId(wid), role, f"{wid}:1", ModelFacts("m")))
    decisions = []
    for r in range(n_requests):
        request = RouteRequest(chain(list(range(16)) + [500 + 2 * r, 501 + 2 * r]), 18 * BS, r)
        d = kv_aware(request, index.match(request.block_hashes), registry.load_view(), CFG)
        registry.begin(d.prefill_worker, d.work_s, prefill_s=d.work_s)   # as request_run does
        if not concurrent:
            registry.end(d.prefill_worker)
            now[0] += 1.0
        decisions.append(d)
    return decisions


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-by-one", "burst"])
def test_prefix_only_in_one_prefill_workers_host_tier_keeps_every_request_there(concurrent):
    """The measured bug: with the prefix in p0's host tier only, the guard sent every other request to p1, which
    recomputed it all. p1 gains nothing from them: p0's lead (2 uncached blocks, 8 ms a request) stays below the
    64 ms its cache saves for all six."""
    index = make_index(p0=(list(range(16)), "host"))
    decisions = _serve_through_registry(index, 6, concurrent)
    assert [(d.prefill_worker, d.cached_tokens) for d in decisions] == [("p0", 64)] * 6
    # charged: the prefill of 8 tokens + one host read (50 us), not the queue wait
    assert all(d.work_s == pytest.approx(0.008 + 50e-6) for d in decisions)


@pytest.mark.parametrize("policy", [kv_aware, least_loaded])
def test_a_burst_between_two_heartbeats_is_spread_not_sent_to_the_lowest_last_report(policy):
    """Colocated workers (`--prefill 0`) report backlogs a second apart. The router adds the prefill it sent since
    each report, so a burst of cold prompts alternates between two equal workers and the predicted queue waits
    include it. Before, least_loaded sent every request until the next heartbeat to the worker whose last report
    was lowest (kv_aware's load guard spread them by recent work, but its TTFT predictions left out the queue the
    router had just built). A load report replaces what was added."""
    registry = WorkerRegistry(clock=lambda: 0.0)
    for wid, backlog in (("d0", 0.10), ("d1", 0.11)):
        registry.register(WorkerRecord(WorkerId(wid), "decode", f"{wid}:1", ModelFacts("m")))
        registry.heartbeat(WorkerId(wid), LoadFigures(backlog_s=backlog))
    route_ = local_only(policy)
    sent = []
    for r in range(8):                                  # 16 uncached blocks each: 64 ms of prefill at 1,000 tok/s
        request = make_request(16, seq=r, start=100 * r)
        d = route_(request, PrefixIndex().match(request.block_hashes), registry.load_view(), CFG)
        registry.begin(d.prefill_worker, d.work_s, prefill_s=d.work_s)
        sent.append(d.prefill_worker)
    assert Counter(sent) == {"d0": 4, "d1": 4}, sent
    assert {w.worker_id: w.backlog_s for w in registry.load_view().workers} == \
        pytest.approx({"d0": 0.10 + 4 * 0.064, "d1": 0.11 + 4 * 0.064})
    registry.heartbeat(WorkerId("d0"), LoadFigures(backlog_s=0.2))
    assert registry.load_view().workers[0].backlog_s == pytest.approx(0.2)


def _replay_hot_prefix(config: CostModelConfig, n_requests: int = 80) -> Counter:
    """A burst: every request has the same 6-block hot prefix + 2 blocks of its own. Workers publish what they
    compute and accumulate the work and the queue they are given, as the router's load view would show."""
    index, busy, queued, seq = PrefixIndex(), Counter(), Counter(), Counter()
    for r in range(n_requests):
        ids = list(range(6)) + [1000 + 2 * r, 1001 + 2 * r]
        request = RouteRequest(chain(ids), len(ids) * BS, r)
        loads = [WorkerLoad(WorkerId(f"w{i}"), recent_busy_s=busy[f"w{i}"], queue_len=queued[f"w{i}"])
                 for i in range(4)]
        d = kv_aware(request, index.match(request.block_hashes), LoadView.of(loads), config)
        busy[d.prefill_worker] += (request.num_tokens - d.cached_tokens) / config.prefill_tokens_per_s
        queued[d.prefill_worker] += 1
        event = BlockStored(list(request.block_hashes), None, [], BS, None, "GPU")
        index.apply(WorkerId(d.prefill_worker), KVEventBatch(0.0, [event]), seq[d.prefill_worker])
        seq[d.prefill_worker] += 1
    return busy


def test_load_guard_spreads_a_hot_prefix_across_workers():
    guarded = _replay_hot_prefix(CFG)
    piled = _replay_hot_prefix(CFG.replace(load_slack=math.inf))
    assert len(piled) == 1  # without the guard the first holder takes every request
    assert len(guarded) == 4
    assert max(guarded.values()) / (sum(guarded.values()) / 4) <= 1.1


def test_conditional_disaggregation_threshold():
    loads = make_load(2, "prefill", "p") + make_load(1, "decode", "d")
    cfg = CFG.replace(local_prefill_max_uncached_tokens=8)
    index = make_index(p0=[0, 1, 2, 3, 4, 5, 6, 7])
    short = route(kv_aware, make_request(2), index, loads, cfg)  # 8 tokens: prefill on the decode worker
    long = route(kv_aware, make_request(8), index, loads, cfg)  # 32 uncached on d0: go through the prefill pool
    assert (short.prefill_worker, short.decode_worker, short.disaggregated) == ("d0", "d0", False)
    assert (long.prefill_worker, long.decode_worker, long.disaggregated) == ("p0", "d0", True)
    assert long.cached_tokens == 32


def test_almost_fully_cached_prompt_is_prefilled_on_the_decode_worker():
    loads = make_load(1, "prefill", "p") + make_load(1, "decode", "d")
    index = make_index(d0=[0, 1, 2, 3, 4, 5, 6])  # 7 of 8 blocks on the decode worker
    d = route(kv_aware, make_request(8), index, loads, CFG.replace(local_prefill_max_uncached_tokens=4))
    assert (d.prefill_worker, d.decode_worker, d.disaggregated, d.cached_tokens) == ("d0", "d0", False, 28)


@pytest.mark.parametrize("backlog_s, bound_s, cached_on_p", [(0.5, math.inf, False), (0.5, 0.4, False),
                                                             (0.3, 0.4, False), (0.2, 0.1, True), (0.01, 0.0, False)])
def test_a_long_prompt_prefills_on_its_decode_worker_only_while_the_prefill_worker_is_behind(backlog_s, bound_s,
                                                                                             cached_on_p):
    """Conditional disaggregation under load: a decode-only worker takes a long prompt itself when the prefill
    worker is at least `local_prefill_min_backlog_s` behind and starting there scores better (here: 32 tokens,
    32 ms of prefill either way, so the backlog decides, unless the prefill worker holds the prefix and what it
    saves outweighs the wait: 0.2 s + the last block, against 32 ms at 9x for the recompute)."""
    loads = [WorkerLoad(WorkerId("p0"), "prefill", backlog_s=backlog_s), WorkerLoad(WorkerId("d0"), "decode")]
    index = make_index(p0=list(range(8))) if cached_on_p else make_index()
    d = route(kv_aware, make_request(8), index, loads, CFG.replace(local_prefill_min_backlog_s=bound_s))
    spills = backlog_s >= bound_s and not cached_on_p
    assert (d.prefill_worker, d.disaggregated) == (("d0", False) if spills else ("p0", True))
    assert d.decode_worker == "d0"
    if spills:
        assert "prefill worker 0." in d.reason and d.predicted_ttft_s == pytest.approx(0.032)
    else:
        assert d.predicted_ttft_s == pytest.approx(backlog_s + (0.0 if cached_on_p else 0.032), abs=1e-3)  # + hop


def test_a_busy_decode_worker_does_not_take_the_prompt_of_a_less_busy_prefill_worker():
    loads = [WorkerLoad(WorkerId("p0"), "prefill", backlog_s=0.5), WorkerLoad(WorkerId("d0"), "decode", backlog_s=0.6)]
    d = route(kv_aware, make_request(8), make_index(), loads, CFG.replace(local_prefill_min_backlog_s=0.2))
    assert (d.prefill_worker, d.decode_worker, d.disaggregated) == ("p0", "d0", True)


def test_cache_salt_isolates_tenants():
    """Equal tokens under different salts hash differently, so one tenant's cache never serves another."""
    ns = Namespace("model", "layout", "bf16")
    tokens = list(range(32))
    tenant_a, tenant_b = hash_blocks(ns.with_salt("a"), tokens, BS), hash_blocks(ns.with_salt("b"), tokens, BS)
    index = PrefixIndex()
    index.apply(WorkerId("w1"), KVEventBatch(0.0, [BlockStored(tenant_a, None, tokens, BS, None, "GPU")]), 0)
    loads = make_load(3)
    a = route(kv_aware, RouteRequest(tuple(tenant_a), 32), index, loads)
    b = route(kv_aware, RouteRequest(tuple(tenant_b), 32), index, loads)
    assert (a.prefill_worker, a.cached_tokens) == ("w1", 32)
    assert b.cached_tokens == 0 and index.match(tenant_b).pooled_blocks == 0


def test_shared_tier_prefix_is_usable_by_every_worker():
    index = make_index(store=([0, 1, 2, 3], "redis"))
    d = route(kv_aware, make_request(8), index, make_load(2, recent_busy_s={"w0": 1.0}))
    assert (d.prefill_worker, d.cached_tokens) == ("w1", 16)


# ------------------------------------------------------------------------------------------------ cost model

def test_plan_prefix_recomputes_when_the_tier_is_slower_than_prefill():
    slow_s3 = CFG.replace(kv_bytes_per_token=1000, tiers=TierCosts(s3=LinkCost(1e5, 0.0)))  # 40 ms/block > 4 ms
    fast_host = CFG.replace(kv_bytes_per_token=1000, tiers=TierCosts(host=LinkCost(1e7, 0.0)))  # 0.4 ms/block
    assert plan_prefix(slow_s3, [("s3", 4)], 32).cached_blocks == 0
    plan = plan_prefix(fast_host, [("device", 2), ("host", 4)], 32)
    assert (plan.cached_blocks, plan.cached_tokens, plan.sources) == (6, 24, (("device", 2), ("host", 4)))
    assert plan.fetch_s == pytest.approx(4 * 0.0004) and plan.prefill_s == pytest.approx(0.008)


def test_plan_prefix_stops_loading_where_a_slow_run_begins():
    cfg = CFG.replace(kv_bytes_per_token=1000, tiers=TierCosts(s3=LinkCost(1e5, 0.0)))
    assert plan_prefix(cfg, [("device", 3), ("s3", 5)], 32).cached_blocks == 3


def measured(prefill_tokens_per_s: float = 0.0, samples: int = 100, **reads: tuple[float, float]) -> MeasuredCosts:
    """`measured(disk=(latency_s, bytes_per_s))`: a worker's heartbeat figures, `samples` behind each."""
    return MeasuredCosts(prefill_tokens_per_s, samples if prefill_tokens_per_s else 0,
                         tuple(MeasuredRead(t, lat, bw, samples) for t, (lat, bw) in reads.items()))


def one_pair(m: MeasuredCosts | None) -> list[WorkerLoad]:
    return [WorkerLoad(WorkerId("p0"), "prefill", measured=m), WorkerLoad(WorkerId("d0"), "decode")]


def test_measured_slow_tier_makes_the_plan_recompute_and_the_worker_read_nothing():
    """Defaults: NVMe at 3 GB/s, so 8 disk blocks (32 KB) load in 0.2 ms instead of 32 ms of prefill. p0 measured its
    disk at 50 ms a call: recomputing is faster, so nothing is cached and the worker is told to read no block."""
    cfg = CFG.replace(kv_bytes_per_token=1000)
    index = make_index(p0=([0, 1, 2, 3, 4, 5, 6, 7], "disk"))
    fast = route(kv_aware, make_request(8), index, one_pair(None), cfg)
    slow = route(kv_aware, make_request(8), index, one_pair(measured(disk=(0.050, 3e9))), cfg)
    assert (fast.cached_tokens, fast.max_load_blocks) == (32, None)
    assert (slow.prefill_worker, slow.cached_tokens, slow.max_load_blocks) == ("p0", 0, 0)
    assert slow.work_s == pytest.approx(0.032)  # 32 tokens at 1,000 tokens/s


def test_measured_slow_tier_after_device_blocks_caps_the_load_at_the_device_run():
    cfg = CFG.replace(kv_bytes_per_token=1000)
    index = make_index(p0=[0, 1], store=([0, 1, 2, 3, 4, 5, 6, 7], "s3"))
    d = route(kv_aware, make_request(9), index, one_pair(measured(s3=(0.2, 1e8))), cfg)
    assert (d.prefill_worker, d.cached_tokens, d.max_load_blocks) == ("p0", 8, 2)  # the 6 s3 blocks: recomputed


def test_measured_figures_with_too_few_samples_leave_the_defaults():
    cfg = CFG.replace(kv_bytes_per_token=1000, min_measured_samples=50)
    index = make_index(p0=([0, 1, 2, 3, 4, 5, 6, 7], "disk"))
    d = route(kv_aware, make_request(8), index, one_pair(measured(samples=49, disk=(0.050, 3e9))), cfg)
    assert (d.cached_tokens, d.max_load_blocks) == (32, None)


def test_measured_prefill_rate_replaces_the_default():
    """S3 costs 20 ms a call by default. At the default 1,000 tokens/s, 32 tokens take 32 ms: load them. A worker
    that measured 10,000 tokens/s computes them in 3.2 ms: it recomputes instead."""
    cfg = CFG.replace(kv_bytes_per_token=1000)
    index = make_index(store=([0, 1, 2, 3, 4, 5, 6, 7], "s3"))
    default = route(kv_aware, make_request(9), index, one_pair(None), cfg)
    assert (default.prefill_worker, default.cached_tokens) == ("p0", 32)
    d = route(kv_aware, make_request(9), index, one_pair(measured(10_000.0)), cfg)
    assert (d.prefill_worker, d.cached_tokens, d.max_load_blocks) == ("p0", 0, 0)
    assert d.work_s == pytest.approx(0.0036)  # 36 tokens at 10,000 tokens/s


def test_each_worker_is_priced_with_its_own_measurements():
    """Both prefill workers can read the prefix from the shared s3 tier; p1 measured slow s3 reads, p0 did not
    (defaults): p0 loads it, so p0 gets the request."""
    cfg = CFG.replace(kv_bytes_per_token=1000)
    index = make_index(store=([0, 1, 2, 3, 4, 5, 6, 7], "s3"))
    loads = [WorkerLoad(WorkerId("p0"), "prefill", recent_busy_s=1.0),
             WorkerLoad(WorkerId("p1"), "prefill", measured=measured(s3=(0.5, 1e6))),
             WorkerLoad(WorkerId("d0"), "decode")]
    d = route(kv_aware, make_request(9), index, loads, cfg.replace(load_slack=math.inf))
    assert (d.prefill_worker, d.cached_tokens) == ("p0", 32)


def test_with_measured_replaces_only_the_figures_with_enough_samples():
    cfg = CostModelConfig(min_measured_samples=10)
    m = MeasuredCosts(5_000.0, 10, (MeasuredRead("host", 1e-4, 4e9, 10), MeasuredRead("redis", 1e-3, 1e8, 9)))
    mine = cfg.with_measured(m)
    assert (mine.prefill_tokens_per_s, mine.tiers.host, mine.tiers.redis) == (5_000.0, LinkCost(4e9, 1e-4),
                                                                            cfg.tiers.redis)
    assert cfg.with_measured(None) is cfg and cfg.with_measured(MeasuredCosts()) is cfg


def test_measured_figures_are_validated():
    with pytest.raises(ValueError, match="tier must be one of"):
        MeasuredRead("device", 0.0, 1e9, 1)
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        MeasuredRead("disk", 0.0, 0.0, 1)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        MeasuredRead("disk", float("nan"), 1e9, 1)
    with pytest.raises(ValueError, match="min_measured_samples"):
        CostModelConfig(min_measured_samples=0)


def test_peer_fetch_lets_a_worker_load_blocks_only_a_peer_holds():
    index = make_index(w0=[0, 1, 2, 3])
    m = index.match(chain(range(8)))
    assert block_sources(m.local.get("w1", {}), m.shared_masks, m.pooled_blocks, True) == [("peer", 4)]
    assert block_sources(m.local.get("w1", {}), m.shared_masks, m.pooled_blocks, False) == []


def test_cost_config_validates_fields():
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        CostModelConfig(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="load_slack"):
        CostModelConfig(load_slack=-1)
    with pytest.raises(ValueError, match="load_cache_tolerance"):
        CostModelConfig(load_cache_tolerance=-0.5)
    with pytest.raises(ValueError, match="local_prefill_min_backlog_s"):
        CostModelConfig(local_prefill_min_backlog_s=-1.0)


# --------------------------------------------------------------------------------------- simple baselines

def test_round_robin_cycles_through_workers_in_id_order():
    index = make_index()
    picks = [route(round_robin, make_request(2, seq=s), index, make_load(3)).prefill_worker for s in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_round_robin_with_separate_pools_disaggregates():
    loads = make_load(2, "prefill", "p") + make_load(3, "decode", "d")
    d = route(round_robin, make_request(2, seq=4), make_index(), loads)
    assert (d.prefill_worker, d.decode_worker, d.disaggregated) == ("p0", "d1", True)


def test_least_loaded_picks_the_smallest_backlog():
    d = route(least_loaded, make_request(2), make_index(), make_load(3, backlog_s={"w0": 3.0, "w1": 1.0, "w2": 2.0}))
    assert d.prefill_worker == "w1"


def test_random_is_deterministic_per_seed_and_request():
    index, loads = make_index(), make_load(4)
    draws = lambda seed: [route(get_policy("random", seed), make_request(2, seq=s), index, loads).prefill_worker
                          for s in range(20)]
    assert draws(7) == draws(7) and draws(7) != draws(8)
    assert len(set(draws(7))) > 1


def test_registry_has_every_policy_and_rejects_unknown_names():
    assert set(POLICIES) == {"kv_aware", "round_robin", "least_loaded", "random"}
    assert get_policy("kv_aware") is kv_aware
    with pytest.raises(ValueError, match="policy must be one of"):
        get_policy("fastest")


def test_no_decode_worker_is_a_typed_error():
    with pytest.raises(NoWorkerError):
        route(kv_aware, make_request(2), make_index(), make_load(2, "prefill"))


def test_load_view_rejects_duplicate_worker_ids_and_bad_roles():
    with pytest.raises(ValueError, match="unique"):
        LoadView.of([WorkerLoad(WorkerId("a")), WorkerLoad(WorkerId("a"))])
    with pytest.raises(ValueError, match="role"):
        WorkerLoad(WorkerId("a"), "router")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- a fleet without prefill workers

@pytest.mark.parametrize("name", ["kv_aware", "round_robin", "least_loaded"])
def test_without_prefill_workers_the_policy_still_chooses_among_the_decoders(name):
    """Colocated (`strata serve --prefill 0`) or the prefill pool out: the policy picks the decode worker that
    prefills the request itself, by the prefix it holds (kv_aware), its turn (round_robin) or its load."""
    policy = local_only(get_policy(name))
    loads = make_load(3, role="decode", backlog_s={"w0": 0.01, "w2": 0.2})
    index = make_index(w0=[0, 1, 2, 3, 4, 5], w2=[0])
    chosen = [policy(make_request(8, seq=s), index.match(chain(range(8))), LoadView.of(loads), CFG) for s in range(3)]
    assert all(d.prefill_worker == d.decode_worker and not d.disaggregated for d in chosen)
    expected = {"kv_aware": ["w0"] * 3, "round_robin": ["w0", "w1", "w2"], "least_loaded": ["w1"] * 3}[name]
    assert [d.decode_worker for d in chosen] == expected
    if name == "kv_aware":
        assert chosen[0].cached_tokens == 6 * BS and chosen[0].reason.startswith("no prefill worker, local")
    with pytest.raises(NoWorkerError):
        policy(make_request(8), index.match(chain(range(8))), LoadView.of(make_load(2, role="prefill")), CFG)
