"""The OpenAI-compatible HTTP API on real processes, through the official `openai` client unchanged (issue 5
"Must show"): completions and chat, streaming and not, 400s naming the field, a client that disconnects mid-stream
(the worker stops), /v1/models, /health, /metrics, and a second turn of a conversation hitting the cache, seen in
`strata cache stats --json`."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer
from strata.paths import bundled_model

pytestmark = pytest.mark.slow

MODEL = "strata-moe-tiny"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_whole_and_streamed_give_the_same_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    (choice,) = whole.choices
    assert choice.finish_reason in ("length", "stop") and whole.object == "text_completion"
    assert whole.usage.completion_tokens <= 10 and whole.usage.prompt_tokens > 16
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_whole_and_streamed_give_the_same_message(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, seed=3)
    message = whole.choices[0].message
    assert message.role == "assistant" and whole.object == "chat.completion"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, seed=3,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_completion_logprobs_whole_and_streamed(client):
    # NOTE: repetition_penalty 1 overrides the model's default 1.3: logprobs are of the raw distribution, so only
    # then is the greedy token the most likely one there
    plain = {"ignore_eos": True, "repetition_penalty": 1.0}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                      extra_body=plain)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0 and top[token] == value  # greedy: the sampled token is the most likely one
        assert len(top) <= 3 and max(top.values()) == value
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                            stream=True, extra_body=plain))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-5)
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_echo_with_logprobs_scores_the_prompt_whole_and_streamed(client):
    """What evaluation harnesses ask for: the prompt echoed with a logprob per token (null for the first)."""
    plain = {"ignore_eos": True, "repetition_penalty": 1.0}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                      echo=True, extra_body=plain)
    choice = whole.choices[0]
    lp = choice.logprobs
    n_prompt = whole.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2 and choice.text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                            echo=True, stream=True, extra_body=plain))
    assert stream[0].choices[0].text == PROMPT
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in stream if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    vllm = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    scored = vllm.model_dump()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == vllm.usage.prompt_tokens
    assert all(len(d) == 1 and next(iter(d.values()))["rank"] >= 1 for d in scored[1:])  # the token itself only
    assert all(any(v["logprob"] == pytest.approx(x, abs=1e-5) for v in d.values())
               for d, x in zip(scored[1:], lp.token_logprobs[1:n_prompt]))


def test_echo_of_a_token_id_prompt_repeats_it_as_text_as_its_logprobs_describe_it(client):
    """A token-id prompt is echoed decoded (its tokens joined are what the logprobs list), whole and streamed."""
    plain = {"ignore_eos": True, "repetition_penalty": 1.0}
    ids = list(Tokenizer.from_dir(bundled_model()).encode(PROMPT))
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, logprobs=1, echo=True,
                                      extra_body=plain)
    choice = whole.choices[0]
    prompt_text = "".join(choice.logprobs.tokens[:len(ids)])
    assert prompt_text and choice.text.startswith(prompt_text) and PROMPT in choice.text
    stream = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True,
                                            stream=True, extra_body=plain))
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_chat_logprobs_and_top_logprobs(client):
    messages = [{"role": "user", "content": "Add two numbers."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.7, seed=9,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert 1 <= len(content) <= 5 and len(content) == whole.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                  reverse=True)
        assert entry.logprob <= entry.top_logprobs[0].logprob
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.7,
                                                 seed=9, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e.token for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_n_choices_whole_and_streamed_each_reproducible_alone(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, extra_body={"ignore_eos": True})
    whole = client.completions.create(n=3, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) > 1, "three seeds gave three identical samples"
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 16
    alone = client.completions.create(**{**args, "seed": 42})  # choice i samples with seed + i
    assert alone.choices[0].text == texts[2]
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **args))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 24


def test_a_batch_of_prompts_gives_a_choice_per_prompt_and_choice(client):
    prompts = [PROMPT, "import os\n", "class Stack:"]
    args = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **args) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]  # greedy
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 5
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                            **args))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [a.choices[0].text for a in alone]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens
    echoed = client.completions.create(prompt=prompts[1:], echo=True, **args)
    assert [c.text for c in echoed.choices] == [p + a.choices[0].text for p, a in zip(prompts[1:], alone[1:])]


def test_chat_n_choices_stream_a_role_delta_each(client):
    messages = [{"role": "user", "content": "Add two numbers."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2, seed=1,
                                                 temperature=1.0, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2, seed=1,
                                           temperature=1.0)
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == whole.choices[i].message.content


def test_logit_bias_forces_a_token_and_unknown_ids_are_400(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"1234": 100}, logprobs=0, extra_body={"ignore_eos": True})
    token = forced.choices[0].logprobs.tokens[0]
    assert forced.choices[0].logprobs.tokens == [token] * 4 and forced.choices[0].text == token * 4
    assert forced.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"99999": 1})
    assert info.value.body["param"] == "logit_bias"


def test_options_left_out_take_the_models_generation_config_defaults(client):
    """As vLLM's OpenAI server does: the bundled model's generation_config.json (temperature 0.3, top_p 0.9,
    repetition_penalty 1.3) fills what the request leaves out, so these two requests sample identically."""
    implicit = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, seed=5)
    explicit = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, seed=5, temperature=0.3,
                                         top_p=0.9, extra_body={"repetition_penalty": 1.3})
    assert implicit.choices[0].text == explicit.choices[0].text
    openai_default = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, seed=5, temperature=1.0,
                                               top_p=1.0, extra_body={"repetition_penalty": 1.0})
    assert openai_default.choices[0].text != implicit.choices[0].text, "the defaults changed nothing"


def test_models_lists_the_bundled_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_gives_the_model_and_an_unknown_one_is_404(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=2), "top_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt=None), "prompt"),
    (dict(extra_body={"temprature": 0.5}), "temprature"),                 # misspelt: refused, not ignored
    (dict(extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),     # outside the vocabulary
])
def test_bad_completion_requests_are_400_naming_the_field(client, kwargs, field):
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.body["param"] == field and field in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"


def test_a_lone_surrogate_in_the_json_is_400_naming_the_field(cluster):
    """JSON may spell a lone surrogate (`\\ud800`), which no client library sends but a hand-written body can:
    400 naming the field, not a 500."""
    body = b'{"model": "%s", "prompt": "abc\\ud800def", "max_tokens": 4}' % MODEL.encode()
    reply = httpx.post(cluster.http_url + "/v1/completions", content=body,
                       headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "prompt" and "UTF-8" in reply.json()["error"]["message"]


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_bad_chat_request_names_the_message_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert info.value.body["param"] == "messages[0].role"


def test_client_disconnect_mid_stream_stops_the_worker(cluster):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", cluster.http_url + "/v1/completions", json=body) as response:
            # NOTE: a named iterator: breaking out of a loop over a temporary `iter_lines()` drops the generator,
            # which closes the stream at once, so the router could abort before `busy` asks (a CI flake).
            lines = response.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data:"):
                    events.append(line)
                if len(events) == 3:
                    break
            assert cluster.busy("decode") == 1
    started = time.monotonic()
    while cluster.busy("decode"):
        assert time.monotonic() - started < 10, "the decode worker kept generating for a gone client"
        time.sleep(0.05)


def test_health_and_metrics(cluster):
    health = httpx.get(cluster.http_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(cluster.http_url + "/metrics", timeout=10).text
    assert 'strata_router_workers{role="decode",state="ready"} 1.0' in metrics
    assert "strata_router_requests_total" in metrics and "strata_router_ttft_seconds_bucket" in metrics
    for worker in ("prefill-0", "decode-0"):  # every worker's tiers, asked at scrape time
        for tier in ("device", "host", "disk"):
            assert f'strata_cache_capacity_bytes{{tier="{tier}",worker="{worker}"}}' in metrics, (worker, tier)
    assert "strata_cache_hit_tokens_total{" in metrics and "strata_cache_get_latency_p99_ms{" in metrics


def cache_stats_json(cluster) -> dict:
    """`strata cache stats --json`, run as the operator would (a separate process)."""
    out = subprocess.run([sys.executable, "-m", "strata.cli", "cache", "stats", "--json",
                          "--router", cluster.grpc_address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def total_hits(stats: dict) -> int:
    return sum(t["hit_blocks"] for w in stats["workers"] for t in w["tiers"])


def test_second_turn_of_a_conversation_hits_the_cache(client, cluster):
    history = [{"role": "system", "content": "You are a careful Python assistant. " * 4},
               {"role": "user", "content": "Write a function that returns the n-th Fibonacci number."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
    before = cache_stats_json(cluster)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now make it iterative."}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16 > 0
    after = cache_stats_json(cluster)
    assert {w["worker_id"] for w in after["workers"]} == {"prefill-0", "decode-0"}
    assert total_hits(after) > total_hits(before)
    metrics = httpx.get(cluster.http_url + "/metrics", timeout=10).text  # the same counters, for Prometheus
    scraped = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("strata_cache_hit_blocks_total{"))
    assert scraped >= total_hits(after)
