"""A request a worker fails is never reported as finished (issue 10, item 5): an exception in the engine step or in
the worker's output handling reaches the client as an error status (HTTP 5xx with OpenAI's error body, an error
event that the `openai` client raises in a stream, gRPC INTERNAL), on the workers' own RPCs and through the router,
while the workers keep serving the next request. A failed prefill is retried on the decode worker (the request is
then served, exactly).

Real processes (`strata serve`'s launcher, bundled model) whose workers run under `tests.e2e.fault_worker`, which
makes the requests whose id names a fault fail inside the worker process; every other request runs untouched.
"""
from __future__ import annotations

import random
import uuid

import grpc
import httpx
import openai
import pytest

from strata.client import StrataClient
from strata.launcher import ServeConfig
from strata.v1 import common_pb2, worker_pb2
from tests.e2e.fault_worker import FaultyLauncher
from tests.e2e.own_cluster import own_cluster

pytestmark = pytest.mark.slow

MODEL = "strata-moe-tiny"
PROMPT_IDS = list(range(100, 160))       # 60 tokens: disaggregated while uncached (more than 16)
GREEDY = {"ignore_eos": True, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def cluster():
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, local_prefill_max_tokens=16,
                         num_blocks=256, host_tier_mib=16, handoff_mib=16, disk_tier=False, ready_timeout_s=240)
    with own_cluster(config, "faults", FaultyLauncher) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def rid(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


def completion_body() -> dict:
    return {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, **GREEDY}


def complete(client, request_id: str | None = None, prompt: list[int] = PROMPT_IDS, **kw):
    headers = {"x-request-id": request_id} if request_id else None
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=GREEDY,
                                     extra_headers=headers, **kw)


def fresh_prompt() -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(8, 4096) for _ in range(60)]


def assert_openai_error(reply: httpx.Response, status: int, *needles: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "internal" and all(n in error["message"] for n in needles), error


def assert_serves_normally(client) -> None:
    """The worker that failed a request is still routed to and answers the next one."""
    answer = complete(client)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4


def test_engine_step_failure_on_the_decode_worker_is_http_500_with_openai_error_body(cluster, client):
    reply = httpx.post(cluster.http_url + "/v1/completions", json=completion_body(), timeout=120,
                       headers={"x-request-id": rid("fault-decode-step")})
    assert_openai_error(reply, 500, "engine step failed", "InjectedFault")
    with pytest.raises(openai.InternalServerError):
        complete(client, rid("fault-decode-step"))
    assert_serves_normally(client)


def test_engine_step_failure_mid_stream_ends_the_stream_with_an_error_the_client_raises(client):
    stream = complete(client, rid("fault-decode-step"), stream=True)
    seen = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            seen.append(chunk)
    assert "engine step failed" in info.value.message
    assert not any(c.choices and c.choices[0].finish_reason for c in seen)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 30}],
                                          max_tokens=4, stream=True, extra_body=GREEDY,
                                          extra_headers={"x-request-id": rid("fault-decode-output")})
    with pytest.raises(openai.APIError) as info:
        list(chat)
    assert "worker error while handling output" in info.value.message
    assert_serves_normally(client)


def test_worker_failures_are_grpc_internal_through_the_router(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=120) as c:
        for kind, needle in (("fault-decode-step", "engine step failed"),
                             ("fault-decode-output", "worker error while handling output")):
            with pytest.raises(grpc.RpcError) as info:
                c.generate(PROMPT_IDS, max_tokens=4, ignore_eos=True, request_id=rid(kind))
            assert info.value.code() == grpc.StatusCode.INTERNAL and needle in info.value.details()
        assert c.generate(PROMPT_IDS, max_tokens=4, ignore_eos=True).finish_reason == "length"


def test_worker_rpcs_answer_internal_for_a_request_they_fail(cluster):
    sampling = common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
    prefill, decode = cluster.worker("prefill"), cluster.worker("decode")
    for kind in ("fault-prefill-step", "fault-prefill-output"):
        with pytest.raises(grpc.RpcError) as info:
            prefill.Prefill(worker_pb2.PrefillRequest(request_id=rid(kind), token_ids=PROMPT_IDS, sampling=sampling),
                            timeout=120)
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    for kind in ("fault-decode-step", "fault-decode-output"):
        with pytest.raises(grpc.RpcError) as info:
            list(decode.Generate(worker_pb2.WorkerGenerateRequest(request_id=rid(kind), token_ids=PROMPT_IDS,
                                                                  sampling=sampling), timeout=120))
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    answer = prefill.Prefill(worker_pb2.PrefillRequest(request_id=rid("fine"), token_ids=PROMPT_IDS,
                                                       sampling=sampling), timeout=120)
    assert answer.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and answer.kv.block_hashes


def step_retries(cluster) -> float:
    metrics = httpx.get(cluster.http_url + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("strata_router_step_retries_total"))


def test_a_failed_prefill_is_retried_on_the_decode_worker_and_served_exactly(cluster, client):
    before = step_retries(cluster)
    for kind in ("fault-prefill-step", "fault-prefill-output"):
        prompt = fresh_prompt()  # no worker has it cached: the router sends it to the prefill worker first
        got = complete(client, rid(kind), prompt=prompt)
        want = complete(client, prompt=prompt)
        assert got.choices[0].finish_reason == "length" and got.choices[0].text == want.choices[0].text
    assert step_retries(cluster) - before == 2
