"""The bundled model is the embedded default: Strata's loader and transformers both load it, and agree."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from strata.llm import LLM
from strata.paths import bundled_model, DEFAULT_DRAFT_NAME
from tests.integration.test_engine_generate import hf_greedy


def test_bundled_model_loads_in_strata_and_transformers_and_agrees():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model()
    llm = LLM(path, num_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(path)
    prompt = "def fibonacci(n):\n"
    ids = llm.tokenizer.encode(prompt)
    assert ids == hf_tok(prompt)["input_ids"]
    ours = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(hf, ids, 16)


def test_bundled_draft_model_shares_the_tokenizer():
    target, draft = LLM(bundled_model(), num_blocks=16), LLM(bundled_model(DEFAULT_DRAFT_NAME), num_blocks=16)
    text = "import os\nfor i in range(10):\n    print(i)\n"
    assert target.tokenizer.encode(text) == draft.tokenizer.encode(text)
