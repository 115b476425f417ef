"""Prompt logprobs of prompts prefilled in several chunks that share their steps with other requests (issue 10,
item 5), on the bundled model, against transformers' log-softmax of the same prompt.

With a step budget of 64 tokens a 300-token prompt takes at least five chunks, and the requests around it decide
where they fall: behind a 63-token prompt its first chunk is a single token, whose one row of logits predicts a
prompt token (nothing is sampled from it).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine.sampling_params import SamplingParams
from strata.llm import LLM
from strata.paths import resolve_model

BUDGET = 64
TOL = 1e-4  # fp32 on both sides


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 4096) for _ in range(length)]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row p is the log-softmax at position p (predicting token p + 1)."""
    logits = hf_model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs_exact(entries, prompt: list[int], want: torch.Tensor, num_top: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    got = torch.tensor([e.logprob for e in entries[1:]])
    expected = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    assert (got - expected).abs().max().item() < TOL
    ranks = (want > expected.unsqueeze(1)).sum(dim=1) + 1
    assert [e.rank for e in entries[1:]] == ranks.tolist()
    top_vals, top_ids = want.topk(num_top, dim=-1)
    for pos, entry in enumerate(entries[1:]):
        assert [t for t, _ in entry.top] == top_ids[pos].tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_vals[pos].tolist(), abs=TOL)


def test_chunked_prompt_logprobs_sharing_steps_equal_transformers(hf_model):
    llm = LLM(max_num_batched_tokens=BUDGET, max_num_seqs=8)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    # Arrival order decides the chunks: the 63-token prompt leaves one token of the first step's budget.
    prompts = [make_prompt(63, 1), make_prompt(300, 2), make_prompt(10, 3), make_prompt(150, 4)]
    params = [greedy, scored, greedy, scored]
    outs = llm.generate(prompts, params)

    for prompt, p, out in zip(prompts, params, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
        # Over the outputs too: every request's greedy tokens are transformers' argmax (none was disturbed).
        want = hf_logprobs(hf_model, prompt + out.token_ids)
        assert out.token_ids == want[len(prompt) - 1:].argmax(dim=-1).tolist()
        if p.prompt_logprobs is not None:
            assert_prompt_logprobs_exact(out.prompt_logprobs, prompt, want[:len(prompt) - 1], p.prompt_logprobs)
            sampled = [e.logprob for e in out.logprobs]
            assert sampled == pytest.approx(
                want[len(prompt) - 1:].gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1).tolist(),
                abs=TOL)
        else:
            assert out.prompt_logprobs is None
