"""Dynamic NTK RoPE is computed per sequence, from its own length, as transformers' generate does: a request's
tokens never depend on which requests ran before it or beside it, and equal transformers' greedy generate with
prompts and continuations past max_position_embeddings (32 here).

The rule (engine/models/rope.py): the token at position p of a sequence whose prompt has L tokens is rotated for
length max(L, p + 1). transformers' oracle is a freshly loaded model per request, because its own rotary module
keeps the longest length it has seen across calls.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine.batch import ScheduledSeq, StepBatch
from engine.config import CacheConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.models.spec import parse_spec
from engine.sampling_params import SamplingParams
from strata.llm import LLM
from tests.conftest import TINY_COMMON, _randomize, write_tokenizer

ATOL = 1e-4
BLOCK = 4
MAX_POS = 32
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# The runner learns a prompt's length L from ScheduledSeq.prompt_len (the scheduler fills it).
PromptSeq = ScheduledSeq


def make_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def blocks_for(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // BLOCK)))


def load_hf(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_run(path: Path, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `n` tokens (one prompt forward, then one forward per token) on a fresh
    model, and its logits `[len(prompt) + n - 1, V]`: every prompt row, then each decode step's row."""
    model = load_hf(path)
    out = model(torch.tensor([prompt]), use_cache=True)
    rows, generated = [out.logits[0]], []
    for _ in range(n):
        generated.append(int(out.logits[0, -1].argmax()))
        if len(generated) < n:
            out = model(torch.tensor([generated[-1:]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0])
    return generated, torch.cat(rows).float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.2e} > {ATOL}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with dynamic NTK scaling (factor 4) and max_position_embeddings 32."""
    folder = tmp_path_factory.mktemp("dynamic_ntk")
    config = transformers.LlamaConfig(**{**TINY_COMMON, "max_position_embeddings": MAX_POS,
                                         "rope_parameters": dict(DYNAMIC), "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, 0)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def test_greedy_past_max_position_matches_transformers(checkpoint):
    """A prompt longer than max_position_embeddings, and a shorter one whose continuation passes it."""
    prompts = [make_prompt(45, 1), make_prompt(20, 2)]
    llm = LLM(str(checkpoint), num_blocks=128, block_size=BLOCK, enforce_eager=True)
    for prompt in prompts:
        assert llm.generate([prompt], GREEDY_32)[0].token_ids == hf_run(checkpoint, prompt, 32)[0]


def test_same_request_alone_and_after_a_long_request(checkpoint):
    prompt = make_prompt(24, 3)
    alone = LLM(str(checkpoint), num_blocks=128, block_size=BLOCK, enforce_eager=True)
    first = alone.generate([prompt], GREEDY_32)[0].token_ids
    after = LLM(str(checkpoint), num_blocks=128, block_size=BLOCK, enforce_eager=True)
    after.generate([make_prompt(90, 4)], GREEDY_32)
    assert after.generate([prompt], GREEDY_32)[0].token_ids == first
    together = after.generate([make_prompt(70, 5), prompt], GREEDY_32)[1].token_ids
    assert together == first == hf_run(checkpoint, prompt, 32)[0]


def test_chunked_prefill_prefix_hit_and_decode_match_one_forward(checkpoint):
    """A 45-token prompt computed in chunks of 16, 16 and 13 (each rotated for L = 45, not for the chunk's end),
    then decoded; a second sequence hits its first 10 blocks and computes only the last 5 prompt tokens."""
    prompt = make_prompt(45, 6)
    generated, ref = hf_run(checkpoint, prompt, 6)
    runner = ModelRunner(ModelConfig(str(checkpoint), enforce_eager=True), CacheConfig(block_size=BLOCK,
                                                                                       num_blocks=64))
    table = blocks_for(0, 50)
    got = [runner.execute(StepBatch([PromptSeq("a", prompt[s:e], s, table, e - s, prompt_len=45)]))
           for s, e in ((0, 16), (16, 32), (32, 45))]
    for i, token in enumerate(generated[:-1]):
        got.append(runner.execute(StepBatch([PromptSeq("a", [token], 45 + i, table, prompt_len=45)])))
    assert_close(torch.cat(got), ref)
    hit_table = table[:10] + blocks_for(20, 10)
    tail = runner.execute(StepBatch([PromptSeq("b", prompt[40:], 40, hit_table, 5, prompt_len=45)]))
    assert_close(tail, ref[40:45])


def test_engine_chunked_long_prompt_matches_transformers(checkpoint):
    prompt = make_prompt(45, 1)
    llm = LLM(str(checkpoint), num_blocks=128, block_size=BLOCK, enforce_eager=True, max_num_batched_tokens=16)
    assert llm.generate([prompt], GREEDY_32)[0].token_ids == hf_run(checkpoint, prompt, 32)[0]


def test_prefix_cache_salt_separates_only_what_differs():
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": MAX_POS}
    dynamic = parse_spec({**config, "rope_parameters": dict(DYNAMIC)})
    assert dynamic.prefix_cache_salt(MAX_POS) == dynamic.prefix_cache_salt(5) == ""
    assert dynamic.prefix_cache_salt(MAX_POS + 1) != dynamic.prefix_cache_salt(MAX_POS + 2)
    assert parse_spec(config).prefix_cache_salt(1000) == ""


def test_a_long_prompt_never_reuses_blocks_cached_for_another_length(checkpoint):
    """A 50-token prompt sharing its first 40 tokens with an earlier 45-token one (both past max_position_embeddings):
    the shared blocks' KV was rotated for length 45, so they must not be served to it; the short-prompt prefix
    cache still works as usual."""
    first = make_prompt(45, 3)
    second = first[:40] + make_prompt(10, 4)
    llm = LLM(str(checkpoint), num_blocks=128, block_size=BLOCK, enforce_eager=True, max_num_batched_tokens=64)
    llm.generate([first], GREEDY_32)
    out = llm.generate([second], GREEDY_32)[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == hf_run(checkpoint, second, 32)[0]
    short = make_prompt(20, 5)
    llm.generate([short], GREEDY_32)
    assert llm.generate([short[:16] + make_prompt(4, 6)], GREEDY_32)[0].num_cached_tokens == 16
