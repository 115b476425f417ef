"""Speculative decoding in the engine (issue 13): every drafter gives exactly the tokens of plain decoding under
greedy, at batch 1 and 16; penalties, logit bias, min_tokens, stop strings and logprobs give what they give
without speculation; seeded sampling is reproducible; only verified blocks are cached.

Drafters: n-gram lookup; a draft model that is the target itself (every draft accepted: bonus tokens, long
accepts) and one with other weights (mostly rejected); a random EAGLE head reading the target's features.
"""
from __future__ import annotations

import random

import pytest

from engine.sampling_params import SamplingParams
from strata.llm import LLM
from tests.integration.spec_factories import spec_llm, write_random_eagle_head

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def make_prompts(count: int, seed: int) -> list[list[int]]:
    """Random prompts, half of them repeating a phrase (so n-gram lookup finds matches)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [rng.randrange(3, 200) for _ in range(rng.randint(4, 20))]
        prompts.append(words * 3 if i % 2 else words)
    return prompts


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("llama").path


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    from tests.conftest import build_tiny_checkpoint
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft_other"), seed=7).path


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory):
    return write_random_eagle_head(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), enforce_eager=True, num_blocks=512)


def drafter_cases(target, other_draft, eagle_head):
    return {"ngram": ("ngram", None), "draft_self": ("draft", target), "draft_other": ("draft", other_draft),
            "eagle": ("eagle", eagle_head)}


@pytest.mark.parametrize("case", ["ngram", "draft_self", "draft_other", "eagle"])
@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_equal_plain_decoding(case, batch, target, other_draft, eagle_head, plain):
    method, draft = drafter_cases(target, other_draft, eagle_head)[case]
    llm = spec_llm(target, method, draft)
    prompts = make_prompts(batch, seed=batch)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    stats = llm.engine.speculation.stats
    assert stats.num_draft_tokens > 0
    if case == "draft_self":     # the target drafting for itself: every draft accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    llm.engine.scheduler.check_integrity()


def test_adaptive_length_keeps_greedy_exact(target, other_draft, plain):
    llm = spec_llm(target, "draft", other_draft, k=4, adaptive=True)
    prompts = make_prompts(8, seed=3)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY)]


@pytest.mark.parametrize("case", ["ngram", "draft_self", "draft_other"])
def test_penalties_bias_min_tokens_and_logprobs_match_plain(case, target, other_draft, eagle_head, plain):
    method, draft = drafter_cases(target, other_draft, eagle_head)[case]
    llm = spec_llm(target, method, draft)
    params = SamplingParams(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                            logit_bias={5: 3.0, 9: -2.0}, min_tokens=6, stop_token_ids=(11,), logprobs=2)
    prompts = make_prompts(6, seed=11)
    expected, got = plain.generate(prompts, params), llm.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
        assert [(lp.token_id, lp.rank) for lp in g.logprobs] == [(lp.token_id, lp.rank) for lp in e.logprobs]
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in e.logprobs], abs=1e-4)


@pytest.mark.parametrize("case", ["ngram", "draft_self"])
def test_stop_string_inside_an_accepted_run_ends_at_its_token(case, target, other_draft, eagle_head, plain):
    """A verify emits several tokens; a stop string completed by one of them ends the request right there."""
    method, draft = drafter_cases(target, other_draft, eagle_head)[case]
    prompt = make_prompts(2, seed=5)[1]
    free = plain.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop_word = free.text.split()[9]                 # a word some way into the greedy continuation
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop_word,), logprobs=0)
    expected = plain.generate([prompt], params)[0]
    got = spec_llm(target, method, draft).generate([prompt], params)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, expected.finish_reason)
    assert len(got.logprobs) == len(got.token_ids)


def test_seeded_sampling_is_reproducible_and_ngram_matches_plain(target, other_draft, plain):
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(6)]
    prompts = make_prompts(6, seed=21)
    # point-mass drafts are verified in coupled form: a seeded request gives exactly its plain tokens
    plain_out = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec_llm(target, "ngram").generate(prompts, params)] == plain_out
    # sampled drafts (q from the draft model): the same tokens run after run
    first = [o.token_ids for o in spec_llm(target, "draft", other_draft).generate(prompts, params)]
    again = [o.token_ids for o in spec_llm(target, "draft", other_draft).generate(prompts, params)]
    assert first == again


def test_only_verified_blocks_are_cached(target, other_draft):
    """Every block the engine indexes holds the request's final tokens; a rerun of prompt + outputs hits them."""
    stored: dict[bytes, list[int]] = {}
    llm = spec_llm(target, "draft", other_draft, block_size=4)
    llm.engine.block_manager._on_block_stored = lambda bid, h, parent, tokens: stored.__setitem__(h, list(tokens))
    prompts = make_prompts(4, seed=31)
    outs = llm.generate(prompts, GREEDY)
    bm = llm.engine.block_manager
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out.token_ids
        parent = bm._hash_root
        for i in range(len(tokens) // 4):
            parent = bm._hasher(parent, tokens[i * 4:(i + 1) * 4])
            if i < (len(tokens) - 1) // 4:     # every full block that was computed is indexed with its tokens
                assert stored.get(parent) == tokens[i * 4:(i + 1) * 4]
    chains = set()                             # and nothing else: every indexed hash is on one of those chains
    for prompt, out in zip(prompts, outs):
        tokens, parent = prompt + out.token_ids, bm._hash_root
        for i in range(len(tokens) // 4):
            parent = bm._hasher(parent, tokens[i * 4:(i + 1) * 4])
            chains.add(parent)
    assert set(stored) <= chains


def test_request_may_turn_speculation_off_or_pick_ngram(target, other_draft, plain):
    llm = spec_llm(target, "draft", other_draft)
    prompts = make_prompts(2, seed=41)
    before = llm.engine.speculation.stats.num_draft_tokens
    off = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, speculative="off"))
    assert llm.engine.speculation.stats.num_draft_tokens == before
    assert [o.token_ids for o in off] == [o.token_ids for o in plain.generate(prompts, SamplingParams(
        max_tokens=12, ignore_eos=True))]
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, speculative="ngram"))
    assert set(llm.engine.speculation.stats.by_method) == {"ngram"}   # the request chose ngram over the draft
    with pytest.raises(ValueError, match="speculative='eagle'"):
        llm.engine.add_request("x", prompts[0], SamplingParams(speculative="eagle"))
    with pytest.raises(ValueError, match="speculative='ngram'"):
        plain.engine.add_request("y", prompts[0], SamplingParams(speculative="ngram"))


def test_preemption_under_a_small_cache_keeps_greedy_exact(target, other_draft, plain):
    llm = spec_llm(target, "draft", other_draft, num_blocks=24, block_size=4, max_num_seqs=8)
    prompts = make_prompts(8, seed=51)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm.engine.scheduler.check_integrity()


def test_eagle_head_for_other_target_weights_is_refused(target, tmp_path):
    import json
    head = write_random_eagle_head(tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    config["eagle"] = {"target": "someone-else", "target_weights_sha256": "0" * 64}
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target_weights_sha256"):
        spec_llm(target, "eagle", head)


def test_bundled_eagle_head_drafts_for_the_bundled_target_greedy_exact():
    """The shipped head on the shipped target (float32, eager): accepted drafts and the plain tokens."""
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = LLM(enforce_eager=True).generate([prompt], params)[0].token_ids
    llm = LLM(enforce_eager=True, speculative="eagle", speculative_adaptive=False)
    assert llm.generate([prompt], params)[0].token_ids == expected
    assert llm.engine.speculation.stats.acceptance_rate > 0.2


def test_compiled_verify_step_gives_the_eager_tokens(target, other_draft, plain):
    """The compiled engine (decode and verify graphs; the draft model's too) gives plain greedy tokens, and its
    verify steps ran the verify graph."""
    llm = LLM(str(target), enforce_eager=False, speculative="draft", speculative_model=str(other_draft),
              num_speculative_tokens=3, speculative_adaptive=False, max_num_seqs=4, num_blocks=512)
    verify = llm.engine.runner.compiled_verify
    assert verify is not None and verify.compilations > 0
    # their warm-up timed one step of each bucket, the controller's first estimate of both modes
    assert sorted(verify.warm_seconds) == sorted(llm.engine.runner.compiled.warm_seconds) == verify.buckets
    assert all(t > 0 for t in verify.warm_seconds.values())
    controller = llm.engine.speculation.controller
    assert all((b, mode) in controller._times for b in verify.buckets for mode in (False, True))
    calls = []
    real = verify.run_features
    verify.run_features = lambda *a: calls.append(1) or real(*a)
    prompts = make_prompts(4, seed=61)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert calls and llm.engine.speculation.stats.num_verify_steps > 0
