"""Strata's logits equal transformers' (max abs diff <= 1e-4, fp32, CPU) for every supported architecture, through
full prefill, token-by-token paged decode, chunked prefill, and mixed prefill/decode batches."""
from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.model_runner import ModelRunner
from engine.config import CacheConfig, ModelConfig
from tests.conftest import TINY_VARIANTS

ATOL = 1e-4
BLOCK = 4
VARIANTS = sorted(TINY_VARIANTS)


def make_runner(path, num_blocks: int = 200) -> ModelRunner:
    return ModelRunner(ModelConfig(str(path)), CacheConfig(block_size=BLOCK, num_blocks=num_blocks))


def make_tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_for(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // BLOCK)))


def seq(rid: str, tokens: list[int], start: int, table: list[int], num_logits: int = 1) -> ScheduledSeq:
    return ScheduledSeq(rid, tokens, start, table, num_logits)


def hf_logits(ckpt, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.hf_model(torch.tensor([tokens])).logits[0].float()      # [n, V]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.2e} > {ATOL}"


@pytest.fixture(scope="module")
def runners(tiny_checkpoint):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            ckpt = tiny_checkpoint(name)
            cache[name] = (ckpt, make_runner(ckpt.path))
        return cache[name]
    return get


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_logits_match_transformers(runners, name):
    ckpt, runner = runners(name)
    tokens = make_tokens(23, seed=1)
    out = runner.execute(StepBatch([seq("a", tokens, 0, blocks_for(0, 23), num_logits=23)]))
    assert_close(out, hf_logits(ckpt, tokens))


@pytest.mark.parametrize("name", VARIANTS)
def test_paged_decode_matches_transformers_full_sequence(runners, name):
    """Prefill 9 tokens, then decode 12 more one at a time through the paged cache (crossing block borders)."""
    ckpt, runner = runners(name)
    tokens = make_tokens(21, seed=2)
    ref = hf_logits(ckpt, tokens)
    table = blocks_for(10, 21)
    got = [runner.execute(StepBatch([seq("a", tokens[:9], 0, table)]))]
    for pos in range(9, 21):
        got.append(runner.execute(StepBatch([seq("a", [tokens[pos]], pos, table)])))
    assert_close(torch.cat(got), ref[8:])


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen2_moe"])
def test_chunked_prefill_equals_one_prefill(runners, name):
    ckpt, runner = runners(name)
    tokens = make_tokens(19, seed=3)
    table = blocks_for(20, 19)
    first = runner.execute(StepBatch([seq("a", tokens[:7], 0, table, num_logits=0)]))
    second = runner.execute(StepBatch([seq("a", tokens[7:], 7, table, num_logits=12)]))
    assert first.shape == (0, 320)
    assert_close(second, hf_logits(ckpt, tokens)[7:])


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "qwen3_moe"])
def test_mixed_batch_equals_each_sequence_alone(runners, name):
    """One step with a fresh prefill, a chunk continuing at start_pos>0, and decodes of different lengths."""
    ckpt, runner = runners(name)
    a, b, c, d = make_tokens(6, 10), make_tokens(15, 11), make_tokens(10, 12), make_tokens(3, 13)
    ta, tb, tc, td = blocks_for(30, 6), blocks_for(40, 15), blocks_for(50, 10), blocks_for(60, 3)
    runner.execute(StepBatch([seq("b", b[:9], 0, tb, 0), seq("c", c[:9], 0, tc, 0), seq("d", d[:2], 0, td, 0)]))
    out = runner.execute(StepBatch([seq("a", a, 0, ta, 2), seq("c", c[9:], 9, tc),
                                    seq("b", b[9:], 9, tb, 6), seq("d", d[2:], 2, td)]))
    assert out.shape == (2 + 1 + 6 + 1, 320)
    expected = torch.cat([hf_logits(ckpt, a)[-2:], hf_logits(ckpt, c)[-1:],
                          hf_logits(ckpt, b)[-6:], hf_logits(ckpt, d)[-1:]])
    assert_close(out, expected)


def test_batched_decode_of_many_sequences_matches_transformers(runners):
    """32 concurrent decodes with different context lengths in one step (the batched decode path)."""
    ckpt, runner = runners("qwen2_moe")
    prompts = [make_tokens(3 + i % 11, 100 + i) for i in range(32)]
    tables = [blocks_for(70 + 4 * i, 16) for i in range(32)]
    for i, p in enumerate(prompts):
        runner.execute(StepBatch([seq(f"r{i}", p[:-1], 0, tables[i], 0)]))
    out = runner.execute(StepBatch([seq(f"r{i}", p[-1:], len(p) - 1, tables[i]) for i, p in enumerate(prompts)]))
    assert_close(out, torch.cat([hf_logits(ckpt, p)[-1:] for p in prompts]))
