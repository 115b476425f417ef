"""Scoring a long prompt through the real serving path (issue 10, item 5): what evaluation harnesses send, a
2,000-token completions request with `echo` and `logprobs`, alone, streamed and 8 at once, and the same over gRPC and
on the decode worker's local path. The workers' step budget is 128 tokens, so every prompt is prefilled in 16 or
more chunks that share their steps with the other requests; every logprob must equal transformers' log-softmax of
the same tokens (fp32 on both sides).

Its own cluster (`strata serve`'s launcher: router + prefill + decode worker processes, bundled model), because the
step budget is a worker flag.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from strata.client import StrataClient
from strata.launcher import ServeConfig
from strata.paths import resolve_model
from strata.v1 import common_pb2, worker_pb2
from tests.e2e.own_cluster import own_cluster

pytestmark = pytest.mark.slow

MODEL = "strata-moe-tiny"
PROMPT_LEN = 2000
BUDGET = 128            # the workers' max_num_batched_tokens
MAX_TOKENS = 2
TOL = 1e-4
GREEDY = {"ignore_eos": True, "repetition_penalty": 1.0}  # not the model's generation_config defaults


@pytest.fixture(scope="module")
def cluster():
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, local_prefill_max_tokens=16,
                         num_blocks=1280, host_tier_mib=16, handoff_mib=160, disk_tier=False, ready_timeout_s=240,
                         worker_args=("--max-num-batched-tokens", str(BUDGET)))
    with own_cluster(config, "logprobs") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizer import Tokenizer
    return Tokenizer.from_dir(resolve_model(None))


def make_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 4096) for _ in range(PROMPT_LEN)]


@torch.inference_mode()
def hf_scores(hf_model, prompt: list[int]) -> tuple[list[float], list[int], list[float]]:
    """transformers' logprob of each prompt token after the first, its greedy continuation of MAX_TOKENS tokens,
    and their logprobs (log-softmax of fp32 logits)."""
    tokens = list(prompt)
    for _ in range(MAX_TOKENS):
        lp = torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].float(), dim=-1)  # [len, vocab]
        tokens.append(int(lp[-1].argmax()))
    picked = lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].tolist()
    return picked[:len(prompt) - 1], tokens[len(prompt):], picked[len(prompt) - 1:]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) for g, w in zip(got, want))
    assert worst < TOL, f"largest difference {worst:.3g}"


def assert_echo_exact(choice, prompt: list[int], hf_model, tokenizer) -> None:
    """The legacy completions logprobs of an echoed prompt: null for its first token, then every prompt token,
    then the generated ones, each transformers' value."""
    want_prompt, generated, want_generated = hf_scores(hf_model, prompt)
    lp = choice.logprobs
    assert choice.finish_reason == "length", f"finish_reason {choice.finish_reason!r}"
    assert len(lp.token_logprobs) == PROMPT_LEN + MAX_TOKENS
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert_close(lp.token_logprobs[1:PROMPT_LEN], want_prompt)
    assert_close(lp.token_logprobs[PROMPT_LEN:], want_generated)
    assert lp.tokens[PROMPT_LEN:] == [tokenizer.decode([t], skip_special_tokens=False) for t in generated]
    # the echoed token-id prompt as text (special tokens kept, as its logprobs list them), then the continuation
    assert choice.text == tokenizer.decode(prompt, skip_special_tokens=False) + tokenizer.decode(generated)


def echo(client, prompt: list[int], **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                     echo=True, extra_body=GREEDY, **kw)


def test_echo_logprobs_of_a_2000_token_prompt_equal_transformers(client, hf_model, tokenizer):
    prompt = make_prompt(1)
    whole = echo(client, prompt)
    assert whole.usage.prompt_tokens == PROMPT_LEN and whole.usage.completion_tokens == MAX_TOKENS
    assert_echo_exact(whole.choices[0], prompt, hf_model, tokenizer)

    chunks = list(echo(client, prompt, stream=True))
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert values[0] is None
    assert_close(values[1:], whole.choices[0].logprobs.token_logprobs[1:])


def test_eight_concurrent_echo_logprobs_requests_each_equal_transformers(client, hf_model, tokenizer):
    prompts = [make_prompt(100 + i) for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: echo(client, p), prompts))
    for prompt, answer in zip(prompts, answers):
        assert_echo_exact(answer.choices[0], prompt, hf_model, tokenizer)


def test_grpc_prompt_logprobs_equal_transformers_disaggregated_and_local(cluster, hf_model):
    """Through the router (prefill worker, then decode worker), and on the decode worker's own Generate (the local
    path of conditional disaggregation), which prefills the prompt itself."""
    prompt = make_prompt(2)
    want_prompt, generated, want_generated = hf_scores(hf_model, prompt)
    with StrataClient(cluster.grpc_address, timeout_s=600) as client:
        got = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, prompt_logprobs=3,
                              repetition_penalty=1.0, ignore_eos=True)
    assert got.finish_reason == "length" and got.token_ids == generated
    assert [e.sampled.token_id for e in got.prompt_logprobs] == prompt[1:]
    assert all(len(e.top) == 3 and e.top[0].logprob >= e.sampled.logprob for e in got.prompt_logprobs)
    assert_close([e.sampled.logprob for e in got.prompt_logprobs], want_prompt)
    assert_close([e.sampled.logprob for e in got.logprobs], want_generated)

    stub = cluster.worker("decode")
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                                         prompt_logprobs=0)
    chunks = list(stub.Generate(worker_pb2.WorkerGenerateRequest(request_id="local-logprobs", token_ids=prompt,
                                                                 sampling=sampling), timeout=600))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [t for c in chunks for t in c.token_ids] == generated
    local = [e for c in chunks for e in c.prompt_logprobs]
    assert_close([e.sampled.logprob for e in local], want_prompt)
