"""Speculative decoding on every entry point of a real cluster (issue 13 items 4 and 5): `strata serve`'s launcher
starts a router, a prefill worker and a decode worker with `--speculative ngram` (then `--speculative draft`, the
bundled draft model); every request here is disaggregated (prefilled on the prefill worker, its KV handed to the
decode worker, which speculates).

- Greedy completions over gRPC and the OpenAI HTTP API give exactly the tokens of one engine without speculation
  (built as the workers build theirs), one at a time and 16 at once.
- A request's `speculative` field: "off" decodes plainly (nothing drafted for it), a drafter the decode workers did
  not load is INVALID_ARGUMENT / HTTP 400 naming the field before anything runs, and on the draft server a request
  may still ask for n-gram lookup (always loaded).
- The decode worker's Prometheus `/metrics` and `strata workers --json` show what it drafted and accepted.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from engine.sampling_params import SamplingParams
from strata.client import StrataClient
from strata.launcher import REPO_ROOT, ServeConfig
from strata.paths import bundled_model
from strata.v1 import worker_pb2
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from worker_common.engine_setup import build_engine_from

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
# Code that repeats. The model goes on repeating the first (n-gram lookup's drafts are accepted); it leaves the
# second after its prompt (most drafts are rejected and corrected): both paths of verification are exercised.
BODIES = ("def add(a, b):\n    return a + b\n\n" * 3 + "def add(",
          "for i in range(10):\n    total += values[i] * weights[i]\n    count += 1\n" * 3 + "for i in range(10):\n")


def make_prompt(tokenizer, tag: str, body: int = 0) -> list[int]:
    """Token ids of a prompt no worker of the cluster has seen (its own first line): it is computed, not cached."""
    return list(tokenizer.encode(f"# {tag}\n{BODIES[body % len(BODIES)]}"))


@pytest.fixture(scope="module")
def reference():
    """One engine without speculation, built as the workers build theirs (engine_text: it detokenizes too)."""
    return build_engine_from(bundled_model(), num_blocks=512, engine_text=True)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def cluster(request):
    """NOTE: `--no-speculative-adaptive`: every decode step drafts. Adaptive length (the default) stops drafting
    where it measures that plain steps are faster, which on a 2-core CPU may be everywhere: then the tests below
    would check plain decoding, and the counters would depend on timing."""
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, speculative=request.param,
                         num_speculative_tokens=3, speculative_adaptive=False, local_prefill_max_tokens=0,
                         ready_timeout_s=240, **SMALL_WORKERS)
    with own_cluster(config, f"speculative-{request.param}") as cluster:
        cluster.method = request.param
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=120) as c:
        yield c


def want(reference, prompts: list[list[int]]):
    return reference.engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def via_grpc(client: StrataClient, prompt: list[int], **kwargs):
    out = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, include_metrics=True, **kwargs)
    assert out.metrics.disaggregated and out.metrics.prefill_worker_id == "prefill-0", out.metrics
    return out


def completion_body(prompt: list[int], **extra) -> dict:
    # NOTE: greedy and no repetition penalty, which the model's generation_config.json would otherwise set
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "repetition_penalty": 1.0,
            "ignore_eos": True, **extra}


def via_http(cluster, prompt: list[int], **extra) -> dict:
    reply = httpx.post(cluster.http_url + "/v1/completions", json=completion_body(prompt, **extra), timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def decode_stats(cluster) -> worker_pb2.StatsResponse:
    return cluster.worker("decode").Stats(worker_pb2.StatsRequest(), timeout=10)


def test_greedy_one_at_a_time_over_grpc_and_http_equals_plain_decoding(cluster, client, reference):
    tokenizer = reference.tokenizer
    prompts = [make_prompt(tokenizer, f"one-{i}", body=i) for i in range(2)]
    expected = want(reference, prompts)
    for prompt, exp in zip(prompts, expected):
        assert via_grpc(client, prompt).token_ids == exp.token_ids
        answer = via_http(cluster, prompt)
        assert answer["choices"][0]["text"] == exp.text
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_greedy_sixteen_at_once_over_grpc_and_http_equal_plain_decoding(cluster, client, reference):
    """16 concurrent requests, half through each door: the decode worker verifies drafts for a whole batch."""
    tokenizer = reference.tokenizer
    prompts = [make_prompt(tokenizer, f"many-{i}", body=i) for i in range(16)]
    expected = want(reference, prompts)
    with ThreadPoolExecutor(16) as pool:
        grpc_runs = [pool.submit(via_grpc, client, p) for p in prompts[:8]]
        http_runs = [pool.submit(via_http, cluster, p) for p in prompts[8:]]
        got_grpc = [f.result() for f in grpc_runs]
        got_http = [f.result() for f in http_runs]
    assert [g.token_ids for g in got_grpc] == [e.token_ids for e in expected[:8]]
    assert [g["choices"][0]["text"] for g in got_http] == [e.text for e in expected[8:]]


def test_a_request_that_turns_speculation_off_decodes_plainly(cluster, client, reference):
    prompt = make_prompt(reference.tokenizer, "off")
    (expected,) = want(reference, [prompt])
    before = decode_stats(cluster).speculative.draft_tokens
    assert via_grpc(client, prompt, speculative="off").token_ids == expected.token_ids
    assert via_http(cluster, prompt, speculative="off")["choices"][0]["text"] == expected.text
    assert decode_stats(cluster).speculative.draft_tokens == before, "a request with speculative 'off' drafted"


def test_a_request_may_ask_for_ngram_lookup_on_any_speculating_server(cluster, client, reference):
    prompt = make_prompt(reference.tokenizer, "ngram")
    (expected,) = want(reference, [prompt])
    assert via_grpc(client, prompt, speculative="ngram").token_ids == expected.token_ids
    assert via_http(cluster, prompt, speculative="ngram")["choices"][0]["text"] == expected.text


def not_loaded(method: str) -> list[str]:
    return [m for m in ("draft", "eagle") if m != method]


def test_a_drafter_the_decode_workers_did_not_load_is_invalid_argument_naming_the_field(cluster, client,
                                                                                        reference):
    prompt = make_prompt(reference.tokenizer, "missing")
    for method in not_loaded(cluster.method):
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt, max_tokens=4, speculative=method)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sampling.speculative {method!r} is not available" in info.value.details()
        assert f"run {', '.join(sorted({cluster.method, 'ngram'}))}" in info.value.details()
        for stream in (False, True):
            reply = httpx.post(cluster.http_url + "/v1/completions", timeout=60,
                               json=completion_body(prompt, speculative=method, stream=stream))
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "speculative" and error["type"] == "invalid_request_error"
            assert f"--speculative {method}" in error["message"]


def test_an_unknown_speculative_value_is_rejected_naming_the_allowed_ones(cluster, client, reference):
    prompt = make_prompt(reference.tokenizer, "unknown")
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt, max_tokens=4, speculative="medusa")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.speculative must be one of off, ngram, draft, eagle" in info.value.details()
    for value in ("medusa", 3):
        reply = httpx.post(cluster.http_url + "/v1/completions", json=completion_body(prompt, speculative=value),
                           timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "speculative", reply.text


def prometheus_value(text: str, name: str, worker: str) -> float:
    match = re.search(rf'^{name}{{worker="{worker}"}} (\S+)$', text, re.M)
    assert match, f"{name} for {worker} is not on /metrics"
    return float(match.group(1))


def decode_metrics_url(cluster) -> str:
    match = re.search(r"READY \S+ role=decode worker_id=decode-0 .*metrics=(\S+)", cluster.log_path.read_text())
    assert match, "the decode worker's READY line names no /metrics"
    return match.group(1)


def workers_json(cluster) -> dict[str, dict]:
    done = subprocess.run([sys.executable, "-m", "strata.cli", "workers", "--router", cluster.grpc_address, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return {w["id"]: w for w in json.loads(done.stdout)}


def test_metrics_and_strata_workers_show_drafted_and_accepted_tokens(cluster, client, reference):
    via_grpc(client, make_prompt(reference.tokenizer, "counted"))
    metrics = httpx.get(decode_metrics_url(cluster), timeout=10).text
    drafted = prometheus_value(metrics, "strata_spec_draft_tokens_total", "decode-0")
    accepted = prometheus_value(metrics, "strata_spec_accepted_tokens_total", "decode-0")
    assert drafted > 0 and 0 < accepted <= drafted
    assert prometheus_value(metrics, "strata_spec_verifies_total", "decode-0") > 0
    assert prometheus_value(metrics, "strata_spec_emitted_tokens_total", "decode-0") > accepted
    assert prometheus_value(metrics, "strata_spec_draft_seconds_total", "decode-0") > 0
    assert prometheus_value(metrics, "strata_spec_verify_seconds_total", "decode-0") > 0
    assert prometheus_value(metrics, "strata_spec_acceptance_rate", "decode-0") == pytest.approx(accepted / drafted,
                                                                                                 rel=0.05)
    assert prometheus_value(metrics, "strata_spec_mean_accepted_length", "decode-0") > 1.0
    deadline = time.monotonic() + 20          # the router learns the counters from the next heartbeat
    while True:
        workers = workers_json(cluster)
        spec = workers["decode-0"]["speculative"]
        if spec["draft_tokens"] >= drafted or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert workers["prefill-0"]["speculative"] is None, "a prefill worker never speculates"
    assert spec["method"] == cluster.method and spec["methods"] == sorted({cluster.method, "ngram"})
    assert spec["draft_tokens"] >= drafted and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert spec["mean_accepted_length"] > 1.0 and spec["draft_seconds"] > 0 and spec["verify_seconds"] > 0
