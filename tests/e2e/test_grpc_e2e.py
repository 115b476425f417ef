"""The public gRPC API on real processes (issue 5 "Must show"): streaming Generate through prefill + decode
workers and through conditional disaggregation, Abort mid-stream and client cancel (the worker frees the request),
deadlines, INVALID_ARGUMENT naming the field, ListModels / ListWorkers / GetCacheStats, health and reflection."""
from __future__ import annotations

import re
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.tokenizer import Tokenizer
from strata.client import StrataClient
from strata.paths import bundled_model
from strata.v1 import common_pb2, strata_pb2, worker_pb2

pytestmark = pytest.mark.slow

LONG_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SHORT_PROMPT = "def add(a, b):"


def fresh(prompt: str) -> str:
    """A prompt no worker has seen: the router's index (fed by KV events) would route a known one by its cache."""
    return f"# {uuid.uuid4().hex}\n{prompt}"


@pytest.fixture(scope="module")
def client(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=60, registry_address=cluster.registry_address) as c:
        yield c


def wait_idle(cluster, role: str, timeout_s: float = 10.0) -> float:
    """Seconds until the worker has nothing running or waiting (fails after timeout_s)."""
    started = time.monotonic()
    while cluster.busy(role):
        assert time.monotonic() - started < timeout_s, f"the {role} worker still runs the request"
        time.sleep(0.05)
    return time.monotonic() - started


def test_generate_streams_through_prefill_and_decode_workers(client):
    prompt = fresh(LONG_PROMPT)
    chunks = list(client.stream(prompt, max_tokens=12, ignore_eos=True, include_metrics=True,
                                request_id="grpc-stream-1"))
    assert len(chunks) >= 2
    assert all(c.request_id == "grpc-stream-1" for c in chunks)
    assert all(c.token_ids and c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    last = chunks[-1]
    tokens = [t for c in chunks for t in c.token_ids]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == last.usage.completion_tokens == 12
    tokenizer = Tokenizer.from_dir(bundled_model())
    assert last.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert "".join(c.text_delta for c in chunks) == tokenizer.decode(tokens)
    m = last.metrics
    assert m.disaggregated and m.prefill_worker_id == "prefill-0" and m.decode_worker_id == "decode-0"
    assert m.timings.ttft_ms > 0 and m.timings.prefill_ms > 0
    full, tail = divmod(last.usage.prompt_tokens, 16)
    assert m.blocks_transferred + m.blocks_from_store == full and m.blocks_recomputed == 0
    assert m.tail_tokens_transferred == tail  # the partial block came over too: nothing was recomputed


def test_short_prompt_prefills_on_the_decode_worker(client):
    """Conditional disaggregation: a prompt within the local-prefill budget skips the prefill pool."""
    out = client.generate(SHORT_PROMPT, max_tokens=4, ignore_eos=True, include_metrics=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert not out.metrics.disaggregated and out.metrics.prefill_worker_id == ""
    assert out.metrics.decode_worker_id == "decode-0"


def test_kv_events_steer_a_repeated_prompt_to_the_worker_that_holds_it(client):
    """The router's index, fed by the workers' KV events, sees that decode-0 now holds the prompt's blocks: the
    same prompt again is prefilled there (conditional disaggregation), reusing them."""
    import random

    prompt = [random.Random(uuid.uuid4().int).randrange(100, 4000) for _ in range(50)]  # 3 full blocks + 2
    first = client.generate(prompt, max_tokens=3, ignore_eos=True, include_metrics=True)
    assert first.metrics.disaggregated and first.usage.cached_tokens == 0
    deadline = time.monotonic() + 10
    while True:  # the events travel asynchronously; a request before they land is routed as if uncached
        again = client.generate(prompt, max_tokens=3, ignore_eos=True, include_metrics=True)
        if not again.metrics.disaggregated or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not again.metrics.disaggregated and again.metrics.decode_worker_id == "decode-0"
    assert again.usage.cached_tokens == 48
    assert again.token_ids == first.token_ids


def test_same_seed_same_tokens(client):
    a = client.generate(LONG_PROMPT, max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    b = client.generate(LONG_PROMPT, max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_penalties_travel_to_the_workers_and_match_the_engine_in_process(client):
    """Repetition / presence / frequency penalties cross the router and the P->D hand-off unchanged: the cluster's
    tokens equal one in-process engine's with the same settings (greedy, so nothing else can differ)."""
    from engine.sampling_params import SamplingParams
    from strata.llm import LLM

    prompt = fresh(LONG_PROMPT)
    kwargs = dict(max_tokens=16, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    remote = client.generate(prompt, **kwargs)
    local = LLM(bundled_model(), num_blocks=64).generate([prompt], SamplingParams(**kwargs))[0]
    assert remote.token_ids == local.token_ids
    plain = client.generate(prompt, max_tokens=16, ignore_eos=True)
    assert plain.token_ids != remote.token_ids, "the penalties changed nothing"


@pytest.mark.parametrize("prompt", [LONG_PROMPT, SHORT_PROMPT], ids=["disaggregated", "local"])
def test_logprobs_cross_the_router_and_match_the_engine_in_process(client, prompt):
    """The first token's logprobs come from the prefill worker, the rest from the decode worker (or all from the
    decode worker for a short prompt): together, one in-process engine's, position by position."""
    from engine.sampling_params import SamplingParams
    from strata.llm import LLM

    prompt = fresh(prompt)
    remote = client.generate(prompt, max_tokens=6, ignore_eos=True, logprobs=3, include_metrics=True)
    local = LLM(bundled_model(), num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert remote.token_ids == local.token_ids
    assert len(remote.logprobs) == 6
    for got, want in zip(remote.logprobs, local.logprobs):
        assert (got.sampled.token_id, got.rank) == (want.token_id, want.rank)
        assert got.sampled.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
    assert client.generate(prompt, max_tokens=2).logprobs == []


@pytest.mark.parametrize("prompt", [LONG_PROMPT, SHORT_PROMPT], ids=["disaggregated", "local"])
def test_prompt_logprobs_come_once_on_the_first_chunk_and_match_the_engine_in_process(client, prompt):
    from engine.sampling_params import SamplingParams
    from strata.llm import LLM

    prompt = fresh(prompt)
    chunks = list(client.stream(prompt, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
    assert chunks[0].prompt_logprobs and not any(c.prompt_logprobs for c in chunks[1:])
    local = LLM(bundled_model(), num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2))[0]
    got = chunks[0].prompt_logprobs
    assert len(got) == len(local.prompt_logprobs) - 1
    for g, w in zip(got, local.prompt_logprobs[1:]):
        assert (g.sampled.token_id, g.rank) == (w.token_id, w.rank)
        assert g.sampled.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.token_id for t in g.top] == [t for t, _ in w.top]


def test_logit_bias_reaches_both_workers(client):
    """A +100 bias makes every token the biased one: the prefill worker's first token and the decode worker's rest."""
    out = client.generate(fresh(LONG_PROMPT), max_tokens=5, ignore_eos=True, logit_bias={1234: 100.0}, logprobs=1,
                          include_metrics=True)
    assert out.metrics.disaggregated and out.token_ids == [1234] * 5
    assert [lp.sampled.token_id for lp in out.logprobs] == [1234] * 5
    with pytest.raises(grpc.RpcError) as info:
        client.generate(LONG_PROMPT, max_tokens=2, logit_bias={10**6: 1.0})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logit_bias" in info.value.details()


def test_min_tokens_holds_off_a_stop_token(client):
    prompt = fresh(LONG_PROMPT)
    free = client.generate(prompt, max_tokens=6, ignore_eos=True, cache_salt="free")
    stop = free.token_ids[0]
    assert client.generate(prompt, max_tokens=6, ignore_eos=True, stop_token_ids=[stop],
                           cache_salt="stop").token_ids == [stop]
    held = client.generate(prompt, max_tokens=6, ignore_eos=True, stop_token_ids=[stop], min_tokens=4,
                           cache_salt="held")
    assert len(held.token_ids) >= 4 and stop not in held.token_ids[:4]


def test_concurrent_requests_all_complete_with_their_own_ids(client):
    """Eight streams at once, half disaggregated and half local, through one router and two workers."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        prompt = fresh(LONG_PROMPT) if i % 2 else SHORT_PROMPT
        return client.generate(prompt, max_tokens=6, ignore_eos=True, request_id=f"grpc-many-{i}",
                                include_metrics=True)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    assert [o.request_id for o in outs] == [f"grpc-many-{i}" for i in range(8)]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    assert [o.metrics.disaggregated for o in outs] == [False, True] * 4


def test_abort_mid_stream_ends_with_abort_and_the_worker_frees_the_request(client, cluster):
    call = client.stream(LONG_PROMPT, max_tokens=1500, ignore_eos=True, request_id="grpc-abort-1")
    chunks = []
    for chunk in call:
        chunks.append(chunk)
        if len(chunks) == 3:
            client.abort("grpc-abort-1")
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert last.usage.completion_tokens < 1500
    wait_idle(cluster, "decode")
    found = cluster.worker("decode").Abort(worker_pb2.WorkerAbortRequest(request_id="grpc-abort-1"), timeout=5)
    assert not found.found  # the worker no longer has it
    with pytest.raises(grpc.RpcError) as info:
        client.abort("grpc-abort-1")  # finished: not in flight any more
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_client_cancel_propagates_to_the_worker(client, cluster):
    call = client.stream(LONG_PROMPT, max_tokens=1500, ignore_eos=True, request_id="grpc-cancel-1")
    it = iter(call)
    next(it), next(it)
    assert cluster.busy("decode") == 1
    call.cancel()
    assert wait_idle(cluster, "decode") < 10.0


def test_deadline_exceeded_is_reported_and_the_worker_stops(client, cluster):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(LONG_PROMPT, max_tokens=1500, ignore_eos=True, timeout_s=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(cluster, "decode")


@pytest.mark.parametrize("sampling, field", [
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(top_p=2.0), "sampling.top_p"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(frequency_penalty=3.0), "sampling.frequency_penalty"),
    (dict(stop_token_ids=[10**6]), "sampling.stop_token_ids"),          # outside the vocabulary
])
def test_bad_sampling_is_invalid_argument_naming_the_field(client, sampling, field):
    with pytest.raises(grpc.RpcError) as info:
        client.generate("hello", **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field)


def test_missing_prompt_unknown_model_and_bad_token_ids_are_rejected(client):
    cases = [(strata_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
             (strata_pb2.GenerateRequest(text="hi", model="gpt-4"), grpc.StatusCode.NOT_FOUND, "model 'gpt-4'"),
             (strata_pb2.GenerateRequest(token_ids=strata_pb2.TokenIds(ids=[1, 99999])),
              grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids")]
    for request, code, fragment in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(client.stub.Generate(request, timeout=10))
        assert info.value.code() == code and fragment in info.value.details()


def test_models_workers_and_cache_stats(client):
    (model,) = client.models()
    assert model.id == "strata-moe-tiny" and model.kv.block_size == 16 and model.kv.model_fingerprint
    workers = {w.id: w for w in client.workers()}
    assert set(workers) == {"prefill-0", "decode-0"}
    assert workers["prefill-0"].role == common_pb2.WORKER_ROLE_PREFILL
    assert all(w.state == common_pb2.WORKER_STATE_READY for w in workers.values())
    stats = {s.worker_id: s for s in client.cache_stats()}
    assert set(stats) == {"prefill-0", "decode-0"}
    assert {t.tier for t in stats["prefill-0"].tiers} >= {"host", "disk"}
    assert [t.tier for t in client.cache_stats(["decode-0"], tier="host")[0].tiers] == ["host"]
    with pytest.raises(grpc.RpcError) as info:
        client.cache_stats(["nobody"])
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        client.cache_stats(tier="bogus")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'bogus'" in info.value.details()


def test_health_and_reflection(cluster):
    """The public port serves Strata (health, reflection); the Registry lives on the registry port (its own health)."""
    for address, services in ((cluster.grpc_address, ("", "strata.v1.Strata")),
                              (cluster.registry_address, ("", "strata.v1.Registry"))):
        with grpc.insecure_channel(address) as channel:
            for service in services:
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING, (address, service)
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5)
    names = {s.name for s in answer.list_services_response.service}
    assert {"strata.v1.Strata", "grpc.health.v1.Health"} <= names and "strata.v1.Registry" not in names


def test_registry_lifecycle_and_a_failed_step_is_retried_on_another_worker(client, cluster):
    """A worker that registers but cannot be reached: the request that lands on it is retried on decode-0, the
    registry declares it DEAD, and Drain / Deregister follow the contract."""
    from strata.v1 import router_pb2

    ghost = common_pb2.WorkerInfo(id="a-ghost", role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                                  model=common_pb2.ModelInfo(id="strata-moe-tiny"))
    answer = client.registry.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=ghost), timeout=5)
    assert answer.worker_id == "a-ghost" and answer.heartbeat_timeout_ms > answer.heartbeat_interval_ms
    state = client.registry.Heartbeat(router_pb2.HeartbeatRequest(worker_id="a-ghost"), timeout=5).state
    assert state == common_pb2.WORKER_STATE_READY
    # The ghost has done no work, so the load guard and the tie-break prefer it over decode-0: both outputs below
    # come from decode-0 after the ghost failed (or directly), and must be identical.
    outs = [client.generate(SHORT_PROMPT, max_tokens=3, ignore_eos=True, include_metrics=True) for _ in range(2)]
    assert all(o.finish_reason == "length" and o.metrics.decode_worker_id == "decode-0" for o in outs)
    dead = {w.id: w.state for w in client.workers(include_dead=True)}
    assert dead["a-ghost"] == common_pb2.WORKER_STATE_DEAD
    import httpx
    metrics = httpx.get(cluster.http_url + "/metrics", timeout=10).text
    retries = float(re.search(r"^strata_router_step_retries_total (\S+)$", metrics, re.M).group(1))
    assert retries >= 1
    with pytest.raises(grpc.RpcError) as info:
        client.registry.Heartbeat(router_pb2.HeartbeatRequest(worker_id="a-ghost"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # dead: it must register again

    client.registry.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=ghost), timeout=5)
    assert client.drain("a-ghost").state == common_pb2.WORKER_STATE_DRAINING
    state = client.registry.Heartbeat(router_pb2.HeartbeatRequest(worker_id="a-ghost"), timeout=5).state
    assert state == common_pb2.WORKER_STATE_DRAINING
    client.registry.Deregister(router_pb2.DeregisterRequest(worker_id="a-ghost"), timeout=5)
    client.registry.Deregister(router_pb2.DeregisterRequest(worker_id="a-ghost"), timeout=5)  # idempotent
    assert "a-ghost" not in {w.id for w in client.workers(include_dead=True)}
    with pytest.raises(grpc.RpcError) as info:
        client.registry.RegisterWorker(router_pb2.RegisterWorkerRequest(
            worker=common_pb2.WorkerInfo(id="x", role=common_pb2.WORKER_ROLE_DECODE)), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker.address" in info.value.details()


def test_a_router_without_workers_answers_unavailable_and_refuses_admin_when_off():
    """No ready worker: UNAVAILABLE over gRPC, 503 over HTTP (both retryable), /health 503; `--no-admin` turns
    the cache admin calls into PERMISSION_DENIED."""
    import subprocess
    import sys

    import httpx

    from strata.launcher import REPO_ROOT

    proc = subprocess.Popen([sys.executable, "-m", "router", "--grpc-port", "0", "--http-port", "0", "--no-admin",
                             "--log-level", "WARNING"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.match(r"READY grpc=(\S+) http=(\S+)", line)
        assert m, line
        with StrataClient(m.group(1), timeout_s=10) as c:
            with pytest.raises(grpc.RpcError) as info:
                c.generate("hello", max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "no ready decode worker" in \
                info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                c.flush_cache()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        http = f"http://{m.group(2)}"
        reply = httpx.post(http + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert reply.status_code == 503 and "no ready decode worker" in reply.json()["error"]["message"]
        assert httpx.get(http + "/health", timeout=10).status_code == 503
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) is not None


def test_cache_salt_separates_tenants(client):
    """The same prompt hits the cache for the tenant that computed it, and not under another salt (DESIGN §3)."""
    prompt = LONG_PROMPT + "# tenant test\n" * 3
    first = client.generate(prompt, max_tokens=2, cache_salt="tenant-a")
    again = client.generate(prompt, max_tokens=2, cache_salt="tenant-a")
    other = client.generate(prompt, max_tokens=2, cache_salt="tenant-b")
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= 16
    assert other.usage.cached_tokens == 0
    assert again.token_ids == first.token_ids == other.token_ids
