"""`strata serve` with the compiled decode step in its workers (the rest of the e2e suite runs them eager): requests
route, disaggregate (prefill worker -> KV hand-off -> decode worker) and decode in compiled steps, alone and
batched, token for token as the eager offline engine generates them."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine.sampling_params import SamplingParams
from strata.launcher import ServeConfig
from strata.llm import LLM
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def push(self, x):",
           "for i in range(10):"]


@pytest.fixture(scope="module")
def compiled_cluster():
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, local_prefill_max_tokens=0,
                         ready_timeout_s=900, **SMALL_WORKERS)
    with own_cluster(config, "compiled", env={"STRATA_ENFORCE_EAGER": "0"}) as cluster:
        yield cluster


def test_compiled_workers_serve_the_eager_engines_tokens(compiled_cluster):
    log = compiled_cluster.log_tail(200_000)
    assert "decode step compiled for batch sizes" in log, "the workers did not compile their decode step"
    reference = LLM(None, enforce_eager=True).generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    client = openai.OpenAI(base_url=compiled_cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: str) -> str:
        out = client.completions.create(model="strata-moe-tiny", prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "top_k": 0,
                                                    "top_p": 1.0})
        return out.choices[0].text

    assert complete(PROMPTS[0]) == reference[0].text                         # alone: the batch-1 graph
    with ThreadPoolExecutor(len(PROMPTS)) as pool:                            # together: the batched graph
        texts = list(pool.map(complete, PROMPTS))
    assert texts == [r.text for r in reference]
