"""Expert parallelism through `strata serve` (issue 14 items 3 and 4): every prefill and decode worker runs as two
ranks (`--expert-parallel 2`), rank 0 serving the group; experts are rebalanced every few forwards while requests
run (`--num-redundant-experts 1 --eplb-interval 6`). Twice: plain, and with int8 weights and n-gram speculation.

- Greedy completions, disaggregated and prefilled on the decode worker, give exactly one local engine's tokens,
  while experts are replicated and moved; rank 0's /metrics shows both ranks' load and the rebalances.
- Killing one rank of the decode worker that streams a request ends that request within its deadline, either
  finished elsewhere with the same tokens or with UNAVAILABLE; the group leaves the router, the other decode worker
  keeps serving, and no process hangs.
"""
from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from engine.sampling_params import SamplingParams
from strata.client import StrataClient
from strata.launcher import ServeConfig
from strata.paths import bundled_model
from strata.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from worker_common.engine_setup import build_engine_from

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
LOCAL_PREFILL_MAX_TOKENS = 16


# name -> the serving options the group runs with besides expert parallelism (the reference engine gets the same
# quantization; it never speculates: speculation must not change greedy tokens)
VARIANTS = {"plain": {}, "int8-ngram": {"quantization": "int8", "speculative": "ngram",
                                        "speculative_adaptive": False}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> dict:
    return VARIANTS[request.param]


@pytest.fixture(scope="module")
def reference(variant):
    return build_engine_from(bundled_model(), num_blocks=512, engine_text=True,
                             quantization=variant.get("quantization"))


@pytest.fixture(scope="module")
def cluster(variant):
    config = ServeConfig(prefill=1, decode=2, grpc_port=0, http_port=0, expert_parallel=2, num_redundant_experts=1,
                         eplb_interval=6, eplb_window=64, local_prefill_max_tokens=LOCAL_PREFILL_MAX_TOKENS,
                         ready_timeout_s=300, **SMALL_WORKERS, **variant)
    with own_cluster(config, "expert-parallel") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=120) as c:
        yield c


def make_prompt(tokenizer, i: int, long: bool) -> list[int]:
    body = " ".join(f"item {i * 7 + j} costs {j * 3} coins;" for j in range(12 if long else 1))
    return list(tokenizer.encode(f"ledger {i}: {body}"))


def ready_field(cluster, worker_id: str, field: str) -> str:
    match = re.search(rf"READY \S+ role=\w+ worker_id={worker_id} .*\b{field}=(\S+)", cluster.log_path.read_text())
    assert match, f"{worker_id}'s READY line has no {field}="
    return match.group(1)


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # exposition sorts them
    match = re.search(rf"^{name}{{{wanted}}} (\S+)$", text, re.M)
    assert match, f"{name}{{{wanted}}} is not on /metrics"
    return float(match.group(1))


def test_greedy_tokens_through_two_ranks_equal_one_engine_while_experts_move(cluster, client, reference):
    prompts = [make_prompt(reference.tokenizer, i, long=i % 2 == 0) for i in range(8)]
    assert all(len(p) > LOCAL_PREFILL_MAX_TOKENS for p in prompts[::2])
    assert all(len(p) <= LOCAL_PREFILL_MAX_TOKENS for p in prompts[1::2])
    want = reference.engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for round in range(2):      # a second round after the first rounds of rebalancing (its prompts are cached)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                           include_metrics=True), prompts))
        assert [list(g.token_ids) for g in got] == [w.token_ids for w in want]
        if round == 0:
            assert {g.metrics.disaggregated for g in got} == {True, False}


def test_rank_zero_metrics_show_both_ranks_load_and_rebalances(cluster, client, reference):
    for i in range(2):
        client.generate(make_prompt(reference.tokenizer, 40 + i, long=True), max_tokens=MAX_TOKENS)
    worker = "decode-0"
    text = httpx.get(ready_field(cluster, worker, "metrics"), timeout=10).text
    assert metric(text, "strata_moe_rank_tokens_total", worker=worker, rank="0") > 0
    assert metric(text, "strata_moe_rank_tokens_total", worker=worker, rank="1") > 0
    assert metric(text, "strata_moe_rebalances_total", worker=worker) > 0
    assert metric(text, "strata_moe_alltoall_bytes_total", worker=worker) > 0
    assert metric(text, "strata_moe_rank_imbalance", worker=worker) >= 1.0


def test_a_conversations_next_turn_meets_its_kv_on_the_rank_that_holds_it(cluster, client, reference):
    """Turn 1 of eight conversations (at once, through the router) decodes on either rank of a decode group; the
    group's KV events tell its front which rank holds which blocks. Turn 2, sent to that group (one at a time, so
    that no load guard interferes), goes to the rank holding the prefix: all of turn 1's 3 full blocks are reused.
    (A rank chosen by load alone would miss for about half of them.)"""
    words = " ".join(f"w{i}" for i in range(200))
    firsts = [list(reference.tokenizer.encode(f"conversation {c}: {words}"))[:48] for c in range(8)]
    with ThreadPoolExecutor(8) as pool:
        turn1 = list(pool.map(lambda p: client.generate(p, max_tokens=4, ignore_eos=True, include_metrics=True),
                              firsts))
    time.sleep(0.5)                     # the KV events of turn 1 reach rank 0's front
    addresses = {p.name: p.address for p in cluster.info.processes}
    for i, (first, out) in enumerate(zip(firsts, turn1)):
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(addresses[out.metrics.decode_worker_id]))
        request = worker_pb2.WorkerGenerateRequest(request_id=f"turn2-{i}-{time.monotonic_ns()}",
                                                   token_ids=first + list(out.token_ids) + first[:4])
        request.sampling.max_tokens = 2
        last = list(stub.Generate(request, timeout=60))[-1]
        assert last.usage.cached_tokens >= 48, (out.metrics.decode_worker_id, last.usage)


def busy_decode_worker(cluster) -> str:
    """The decode worker (group) whose ranks hold a request now (its Stats sum the ranks' load)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for p in cluster.info.processes:
            if p.role != "decode":
                continue
            stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(p.address))
            load = stub.Stats(worker_pb2.StatsRequest(), timeout=5).load
            if load.running + load.waiting:
                return p.name
        time.sleep(0.05)
    raise AssertionError("no decode worker took the request")


def test_killing_one_rank_mid_stream_ends_the_request_in_time_and_the_fleet_keeps_serving(cluster, client,
                                                                                          reference):
    prompt = make_prompt(reference.tokenizer, 90, long=True)
    want = reference.engine.generate([prompt], SamplingParams(max_tokens=200, ignore_eos=True))[0].token_ids
    call = client.stream(prompt, timeout_s=120, max_tokens=200, ignore_eos=True)
    chunks = iter(call)
    tokens = list(next(chunks).token_ids)
    victim = busy_decode_worker(cluster)
    rank1_pid = int(ready_field(cluster, victim, "ep_pids").split(",")[0])
    os.kill(rank1_pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        for chunk in chunks:
            tokens.extend(chunk.token_ids)
        assert tokens == want                   # finished on the other decode worker, the same tokens
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    assert time.monotonic() - started < 60
    deadline = time.monotonic() + 30             # the broken group leaves the router
    while victim in {w.id for w in client.workers(role="decode")} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim not in {w.id for w in client.workers(role="decode")}
    again = client.generate(make_prompt(reference.tokenizer, 91, long=True), max_tokens=MAX_TOKENS, ignore_eos=True)
    assert len(again.token_ids) == MAX_TOKENS
