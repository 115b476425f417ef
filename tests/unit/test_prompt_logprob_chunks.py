"""Prompt logprobs survive any chunking: wherever the step budget cuts a prompt (a one-token chunk included, which has
a single logits row that must not be sampled from), its prompt logprobs and tokens equal those of the prompt
prefilled in one step. The paged toy runner of `test_llm_engine_loop` makes every logits row depend on what the
cache holds, so a wrong row or a corrupted request shows."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from tests.unit.test_llm_engine_loop import make_engine, run_to_end

SCORED = SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=1)
PROMPT = [(7 * i) % 250 + 3 for i in range(40)]


def scored_alone() -> tuple[list, list[int]]:
    engine = make_engine(budget=64)
    engine.add_request("alone", PROMPT, SCORED)
    final = run_to_end(engine)["alone"][-1]
    return final.prompt_logprobs, final.token_ids


@pytest.mark.parametrize("ahead", range(1, 8))
def test_prompt_logprobs_equal_unchunked_wherever_the_budget_cuts(ahead):
    """A request of `ahead` tokens takes the first step's budget before the scored prompt: its first chunk is
    8 - ahead tokens (one token when ahead = 7), and a decoding request shares every later step."""
    want_logprobs, want_tokens = scored_alone()
    engine = make_engine(budget=8)
    engine.add_request("ahead", list(range(3, 3 + ahead)), SamplingParams(max_tokens=30))
    engine.add_request("scored", PROMPT, SCORED)
    outputs = run_to_end(engine)
    final = outputs["scored"][-1]
    assert final.finish_reason == "length" and final.token_ids == want_tokens
    assert final.prompt_logprobs == want_logprobs and len(final.prompt_logprobs) == len(PROMPT)
    assert all(not o.new_token_ids for o in outputs["scored"][:-4])  # prompt chunks: no token sampled


def test_prompt_logprobs_with_a_one_token_step_budget():
    """Every prompt chunk is one token: each single logits row records a prompt logprob, none is sampled from."""
    want_logprobs, want_tokens = scored_alone()
    engine = make_engine(budget=1)
    engine.add_request("scored", PROMPT, SCORED)
    final = run_to_end(engine)["scored"][-1]
    assert final.token_ids == want_tokens and final.prompt_logprobs == want_logprobs
