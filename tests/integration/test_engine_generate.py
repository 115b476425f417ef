"""The whole engine (loader, runner, scheduler, sampler) against transformers' `generate`, and against itself.

Issue 2's must-shows: greedy continuations of 32 tokens identical to transformers for every architecture;
batched results identical to one-at-a-time; a prefix-cache hit gives the same tokens as a miss.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine.sampling_params import SamplingParams
from strata.llm import LLM

ARCHS = ["llama", "llama_sharded", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_prompts(count: int, seed: int, vocab: int = 200, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' model, EOS not special (generate()'s min_new_tokens would mask it)."""
    ids = torch.tensor([prompt])
    out = hf_model(ids, use_cache=True)
    generated: list[int] = []
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_match_transformers(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4)
    prompts = make_prompts(3, seed=7)
    outs = llm.generate(prompts, GREEDY_32)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 32)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_repetition_penalty_greedy_matches_transformers(tiny_checkpoint, arch):
    """The penalty over prompt + output tokens is transformers' RepetitionPenaltyLogitsProcessor, token for token."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ckpt = tiny_checkpoint(arch)
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4)
    prompts = make_prompts(3, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, repetition_penalty=1.8, ignore_eos=True))
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(24):
                logits = penalty(ids, ckpt.hf_model(ids).logits[:, -1])
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        assert out.token_ids == ids[0, len(prompt):].tolist()
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, plain)), "the penalty changed nothing"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_batched_equals_one_at_a_time(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    prompts = make_prompts(12, seed=11)
    params = [GREEDY_32 if i % 2 else SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=i,
                                                     repetition_penalty=1.3 if i % 4 == 0 else 1.0)
              for i in range(len(prompts))]
    batched = LLM(str(ckpt.path), num_blocks=256, block_size=4, max_num_batched_tokens=64)
    together = batched.generate(prompts, params)
    alone_llm = LLM(str(ckpt.path), num_blocks=256, block_size=4, enable_prefix_caching=False)
    for prompt, p, out in zip(prompts, params, together):
        assert alone_llm.generate([prompt], p)[0].token_ids == out.token_ids


def test_prefix_cache_hit_gives_same_tokens_as_miss(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3_moe")
    shared = make_prompts(1, seed=3, lo=30, hi=30)[0]
    prompts = [shared + tail for tail in make_prompts(4, seed=5, lo=2, hi=9)]
    cold = LLM(str(ckpt.path), num_blocks=256, block_size=4, enable_prefix_caching=False)
    warm = LLM(str(ckpt.path), num_blocks=256, block_size=4)
    expected = [cold.generate([p], GREEDY_32)[0] for p in prompts]
    first = warm.generate([prompts[0]], GREEDY_32)[0]
    assert first.num_cached_tokens == 0
    for prompt, want in zip(prompts, expected):
        got = warm.generate([prompt], GREEDY_32)[0]
        assert got.num_cached_tokens >= 28, "the shared 30-token prefix (7 blocks of 4) must hit"
        assert got.token_ids == want.token_ids


def test_chunked_prefill_under_small_budget_matches(tiny_checkpoint):
    ckpt = tiny_checkpoint("mixtral")
    prompts = make_prompts(4, seed=9, lo=30, hi=40)
    small = LLM(str(ckpt.path), num_blocks=256, block_size=4, max_num_batched_tokens=8)
    big = LLM(str(ckpt.path), num_blocks=256, block_size=4)
    assert [o.token_ids for o in small.generate(prompts, GREEDY_32)] == \
        [o.token_ids for o in big.generate(prompts, GREEDY_32)]


def test_preemption_when_blocks_run_out_keeps_tokens(tiny_checkpoint):
    """16 blocks of 4 tokens cannot hold 6 requests of ~60 tokens at once: the scheduler must preempt."""
    ckpt = tiny_checkpoint("llama")
    prompts = make_prompts(6, seed=13, lo=20, hi=28)
    tight = LLM(str(ckpt.path), num_blocks=24, block_size=4, max_model_len=64)
    roomy = LLM(str(ckpt.path), num_blocks=512, block_size=4)
    assert [o.token_ids for o in tight.generate(prompts, GREEDY_32)] == \
        [o.token_ids for o in roomy.generate(prompts, GREEDY_32)]


def test_stop_string_and_max_tokens(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen2")
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4)
    prompt = make_prompts(1, seed=17)[0]
    full = llm.generate([prompt], GREEDY_32)[0]
    words = full.text.split()
    assert len(words) > 4
    stop_word = words[3]
    cut = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True, stop=(stop_word,)))[0]
    assert cut.finish_reason == "stop"
    assert stop_word not in cut.text and full.text.startswith(cut.text)
    assert llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_logprobs_are_transformers_log_softmax_of_the_raw_logits(tiny_checkpoint, arch):
    """Every output position: the sampled token's logprob, its rank, and the top-N, from transformers' logits on
    the same prefix; sampled with temperature and a penalty, which must not change the reported distribution."""
    ckpt = tiny_checkpoint(arch)
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4)
    prompts = make_prompts(3, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, repetition_penalty=1.3, logprobs=5,
                            ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) == 12
        with torch.inference_mode():
            logits = ckpt.hf_model(torch.tensor([prompt + out.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # the distribution each output was drawn at
        for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(lp[pos, token].item(), abs=1e-4)
            assert entry.rank == int((lp[pos] > lp[pos, token]).sum()) + 1
            want_vals, want_ids = lp[pos].topk(5)
            assert [t for t, _ in entry.top] == want_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(want_vals.tolist(), abs=1e-4)


def test_logprobs_zero_gives_the_sampled_token_only_and_unset_gives_none(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4)
    prompts = make_prompts(2, seed=12)
    greedy, plain = llm.generate(prompts, [SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True),
                                           SamplingParams(max_tokens=6, ignore_eos=True)])
    assert [e.top for e in greedy.logprobs] == [[]] * 6
    assert [e.rank for e in greedy.logprobs] == [1] * 6  # greedy picks the most likely token
    assert all(e.logprob <= 0.0 for e in greedy.logprobs)
    assert plain.logprobs is None and plain.new_logprobs is None
    with pytest.raises(ValueError, match="logprobs must be an integer in \\[0, 20\\]"):
        SamplingParams(logprobs=21)


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4)
    prompt = make_prompts(1, seed=13)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    first = free.token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(first,)))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(first,),
                                                 min_tokens=3))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    assert held.token_ids[:1] != [first]
    text_stop = free.text.split()[0] if free.text.split() else free.text[:1]
    by_text = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop=(text_stop,)))[0]
    late = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop=(text_stop,),
                                                 min_tokens=8))[0]
    assert by_text.finish_reason == "stop" and len(by_text.token_ids) < 8
    assert late.token_ids == free.token_ids and late.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_prompt_logprobs_are_transformers_over_the_prompt_in_chunks_and_after_a_cache_hit(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    llm = LLM(str(ckpt.path), num_blocks=128, block_size=4, max_num_batched_tokens=16)  # prompts run in chunks
    prompts = make_prompts(3, seed=21, lo=20, hi=40)
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # the first prompt is now cached
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        with torch.inference_mode():
            lp = torch.log_softmax(ckpt.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):        # entry for token pos + 1, from position pos
            assert entry.token_id == prompt[pos + 1]
            assert entry.logprob == pytest.approx(lp[pos, prompt[pos + 1]].item(), abs=1e-4)
            assert entry.rank == int((lp[pos] > lp[pos, prompt[pos + 1]]).sum()) + 1
            assert [t for t, _ in entry.top] == lp[pos].topk(2).indices.tolist()
        assert out.token_ids == hf_greedy(ckpt.hf_model, prompt, 3)  # sampling is unchanged
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny_checkpoint):
    """Too few blocks for all requests at once: some are preempted (some mid-prompt) and recomputed; their prompt
    logprobs come out whole and equal to an unpressured run's."""
    ckpt = tiny_checkpoint("llama")
    prompts = make_prompts(6, seed=22, lo=30, hi=40)
    params = SamplingParams(max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    roomy = LLM(str(ckpt.path), num_blocks=256, block_size=4).generate(prompts, params)
    tight = LLM(str(ckpt.path), num_blocks=40, block_size=4, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params)
    assert tight.engine.block_manager.stats.num_queries > len(prompts)  # some request was allocated again
    for want, got in zip(roomy, outs):
        assert got.token_ids == want.token_ids
        assert [e and e.token_id for e in got.prompt_logprobs] == [e and e.token_id for e in want.prompt_logprobs]
        assert [e.logprob for e in got.prompt_logprobs[1:]] == \
            pytest.approx([e.logprob for e in want.prompt_logprobs[1:]], abs=1e-4)
