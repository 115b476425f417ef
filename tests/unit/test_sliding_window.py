"""Sliding-window attention equals transformers' (fp32, max abs logit diff <= 1e-4) for every architecture that
defines one, in every attention path: fresh prefill longer than the window, chunked prefill, a prefix-cache hit
(start_pos > 0), the paged decode of a mixed batch, the DecodeBuffer's pure decode (rebuilt and appended), and
32-token greedy continuations through the whole engine with chunked prefill and prefix caching. Runners are eager:
these are the torch backend's paths (the compiled decode step has its own parity tests).

Windows are a few tokens and blocks are 4 tokens, so every window straddles a block border; which layers slide
comes from each architecture's transformers config (the oracle reads it from the HF attention modules).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import engine.attention.torch_paged as torch_paged
from engine.batch import ScheduledSeq, StepBatch
from engine.config import CacheConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.models.errors import ConfigFieldError
from engine.models.spec import parse_spec
from engine.sampling_params import SamplingParams
from strata.llm import LLM
from tests.conftest import TINY_COMMON, TinyCheckpoint, build_checkpoint_of

ATOL = 1e-4
BLOCK = 4
VOCAB = TINY_COMMON["vocab_size"]
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (transformers config class, extra config fields, expected per-layer windows)
VARIANTS: dict[str, tuple[str, dict[str, Any], tuple[int | None, ...]]] = {
    "mistral": ("MistralConfig", {"sliding_window": 5}, (5, 5)),
    "mixtral": ("MixtralConfig", {"sliding_window": 6, "num_local_experts": 4, "num_experts_per_tok": 2}, (6, 6)),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                              "num_hidden_layers": 3}, (None, 5, 5)),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": True, "sliding_window": 7,
                              "max_window_layers": 1}, (None, 7)),
    "qwen2_moe": ("Qwen2MoeConfig", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2,
                                     "shared_expert_intermediate_size": 64, **_MOE}, (5, None)),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "use_sliding_window": True, "sliding_window": 5,
                                     "norm_topk_prob": True, **_MOE}, (5, 5)),
    # sliding_window given but switched off: full attention, as in transformers
    "qwen2_off": ("Qwen2Config", {"use_sliding_window": False, "sliding_window": 5, "max_window_layers": 0},
                  (None, None)),
}
NAMES = sorted(VARIANTS)
SLIDING = [n for n in NAMES if any(VARIANTS[n][2])]


def build_checkpoint(name: str, folder: Path, seed: int = 0) -> TinyCheckpoint:
    cls_name, extra, _ = VARIANTS[name]
    return build_checkpoint_of(cls_name, extra, folder, seed)


def make_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_for(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // BLOCK)))


def seq(rid: str, tokens: list[int], start: int, table: list[int], num_logits: int = 1) -> ScheduledSeq:
    return ScheduledSeq(rid, tokens, start, table, num_logits)


def run(runner: ModelRunner, *seqs: ScheduledSeq) -> torch.Tensor:
    return runner.execute(StepBatch(list(seqs)))


def hf_logits(ckpt: TinyCheckpoint, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.hf_model(torch.tensor([tokens])).logits[0].float()      # [n, V]


@torch.inference_mode()
def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation: one prompt forward, then one forward per token through its cache."""
    out = hf_model(torch.tensor([prompt]), use_cache=True)
    generated: list[int] = []
    for _ in range(n):
        generated.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([generated[-1:]]), cache=out.cache, use_cache=True)
    return generated


def hf_windows(hf_model: Any) -> tuple[int | None, ...]:
    """Each layer's window as transformers' modeling picks it: by `config.layer_types` where the config has them
    (Qwen2, Qwen3, Qwen2-MoE), else `config.sliding_window` on every layer (Mistral, Mixtral, Qwen3-MoE)."""
    config = hf_model.config
    window = config.sliding_window or None            # Qwen2-MoE stores 0 for "off"
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.2e} > {ATOL}"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """`models(name)` -> (TinyCheckpoint, ModelRunner), built once per module."""
    built: dict[str, tuple[TinyCheckpoint, ModelRunner]] = {}

    def get(name: str) -> tuple[TinyCheckpoint, ModelRunner]:
        if name not in built:
            ckpt = build_checkpoint(name, tmp_path_factory.mktemp(f"sw_{name}"))
            runner = ModelRunner(ModelConfig(str(ckpt.path), enforce_eager=True),
                                  CacheConfig(block_size=BLOCK, num_blocks=256))
            built[name] = (ckpt, runner)
        return built[name]
    return get


@pytest.mark.parametrize("name", NAMES)
def test_layer_windows_are_those_transformers_uses(models, name):
    ckpt, runner = models(name)
    theirs = hf_windows(ckpt.hf_model)
    assert theirs == VARIANTS[name][2]
    assert runner.spec.layer_windows == theirs
    assert tuple(layer.attn.window for layer in runner.model.layers) == theirs


@pytest.mark.parametrize("name", NAMES)
def test_prefill_longer_than_the_window_matches_transformers(models, name):
    ckpt, runner = models(name)
    tokens = make_tokens(23, seed=1)
    assert_close(run(runner, seq("a", tokens, 0, blocks_for(0, 23), num_logits=23)), hf_logits(ckpt, tokens))


@pytest.mark.parametrize("name", SLIDING)
def test_chunked_prefill_then_decode_past_the_window_matches_transformers(models, name):
    """Chunks of 7 and 6 tokens (the second at start_pos 7 > window), then 10 pure decodes through the
    DecodeBuffer (the first rebuilds it, the rest append)."""
    ckpt, runner = models(name)
    tokens = make_tokens(23, seed=2)
    table = blocks_for(10, 23)
    got = [run(runner, seq("a", tokens[:7], 0, table, num_logits=7)),
           run(runner, seq("a", tokens[7:13], 7, table, num_logits=6))]
    got += [run(runner, seq("a", [tokens[p]], p, table)) for p in range(13, 23)]
    assert_close(torch.cat(got), hf_logits(ckpt, tokens))


@pytest.mark.parametrize("name", SLIDING)
def test_prefix_cache_hit_matches_transformers(models, name):
    """A second sequence reuses the first one's 3 full blocks (12 tokens, more than the window) and computes only
    its own tail at start_pos 12, then decodes."""
    ckpt, runner = models(name)
    shared = make_tokens(12, seed=3)
    first, second = shared + make_tokens(5, seed=4), shared + make_tokens(9, seed=5)
    table_a = blocks_for(20, len(first))
    run(runner, seq("a", first, 0, table_a, num_logits=0))
    table_b = table_a[:3] + blocks_for(30, len(second) - 12)
    tail = run(runner, seq("b", second[12:-2], 12, table_b, num_logits=len(second) - 14))
    decodes = [run(runner, seq("b", [second[p]], p, table_b)) for p in (len(second) - 2, len(second) - 1)]
    assert_close(torch.cat([tail, *decodes]), hf_logits(ckpt, second)[12:])


@pytest.mark.parametrize("name", SLIDING)
def test_mixed_batch_paged_decode_matches_transformers(models, name):
    """One step with a fresh prefill longer than the window, a chunk at start_pos > 0, and decodes whose contexts
    are shorter and longer than the window (the paged-cache decode path, not the DecodeBuffer)."""
    ckpt, runner = models(name)
    a, b, c, d = make_tokens(11, 10), make_tokens(15, 11), make_tokens(14, 12), make_tokens(3, 13)
    ta, tb, tc, td = blocks_for(40, 11), blocks_for(50, 15), blocks_for(60, 14), blocks_for(70, 3)
    run(runner, seq("b", b[:9], 0, tb, 0), seq("c", c[:13], 0, tc, 0), seq("d", d[:2], 0, td, 0))
    out = run(runner, seq("a", a, 0, ta, 11), seq("c", c[13:], 13, tc),
              seq("b", b[9:], 9, tb, 6), seq("d", d[2:], 2, td))
    expected = torch.cat([hf_logits(ckpt, a), hf_logits(ckpt, c)[-1:], hf_logits(ckpt, b)[-6:],
                          hf_logits(ckpt, d)[-1:]])
    assert_close(out, expected)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_batched_pure_decode_matches_transformers(models, name):
    """12 sequences with contexts from 3 to 14 tokens decode together for 3 steps (DecodeBuffer rebuild, then
    appends), some inside the window and some past it."""
    ckpt, runner = models(name)
    prompts = [make_tokens(3 + i, 100 + i) for i in range(12)]
    tables = [blocks_for(80 + 5 * i, len(p) + 3) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        run(runner, seq(f"r{i}", p, 0, tables[i], 0))
    extra = [make_tokens(3, 200 + i) for i in range(12)]
    for step in range(3):
        out = run(runner, *[seq(f"r{i}", [extra[i][step]], len(p) + step, tables[i]) for i, p in enumerate(prompts)])
        ref = torch.cat([hf_logits(ckpt, p + extra[i][:step + 1])[-1:] for i, p in enumerate(prompts)])
        assert_close(out, ref)


@pytest.mark.parametrize("name", ["mistral", "mixtral", "qwen2", "qwen2_moe"])
def test_greedy_32_tokens_match_transformers_with_chunked_prefill_and_prefix_hits(models, name):
    """Prompts longer than the step budget (chunked) and than the window; the second round hits the prefix cache."""
    ckpt, _ = models(name)
    llm = LLM(str(ckpt.path), num_blocks=256, block_size=BLOCK, max_num_batched_tokens=8, enforce_eager=True)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (9, 17, 26)]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(ckpt.hf_model, p, 32) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    hits_before = llm.engine.block_manager.stats.hit_tokens
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    assert llm.engine.block_manager.stats.hit_tokens > hits_before


def test_full_attention_models_build_no_window_masks(tiny_checkpoint, monkeypatch):
    """No layer has a window: the backend takes exactly its full-attention paths (no mask is ever built)."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a window mask was built for a model without sliding windows")
    monkeypatch.setattr(torch_paged, "_window_masks", refuse)
    runner = ModelRunner(ModelConfig(str(tiny_checkpoint("llama").path), enforce_eager=True),
                         CacheConfig(block_size=BLOCK, num_blocks=16))
    tokens = make_tokens(10, seed=6)
    run(runner, seq("a", tokens[:6], 0, blocks_for(0, 10), 0))
    run(runner, seq("a", tokens[6:9], 6, blocks_for(0, 10)))
    run(runner, seq("a", tokens[9:], 9, blocks_for(0, 10)))


BASE = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 4, "num_attention_heads": 2}


def test_layer_types_are_honoured_when_given():
    spec = parse_spec({**BASE, "use_sliding_window": True, "sliding_window": 9, "max_window_layers": 0,
                       "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]})
    assert spec.layer_windows == (None, 9, None, 9)


@pytest.mark.parametrize("cls_name", ["Qwen2Config", "Qwen3Config", "Qwen2MoeConfig"])
@pytest.mark.parametrize("max_window_layers", [0, 1, 3, 28])
def test_sliding_layers_are_derived_as_transformers_does_without_layer_types(cls_name, max_window_layers):
    fields = {**TINY_COMMON, "num_hidden_layers": 5, "use_sliding_window": True, "sliding_window": 9,
              "max_window_layers": max_window_layers, "shared_expert_intermediate_size": 8, **_MOE}
    config = getattr(transformers, cls_name)(**fields).to_dict()
    expected = tuple(9 if t == "sliding_attention" else None for t in config.pop("layer_types"))
    assert parse_spec({**config, "architectures": [cls_name.replace("Config", "ForCausalLM")]}).layer_windows \
        == expected


def test_unsupported_window_settings_name_the_field():
    with pytest.raises(ConfigFieldError, match="use_sliding_window=true needs 'sliding_window'"):
        parse_spec({**BASE, "use_sliding_window": True, "sliding_window": None})
    with pytest.raises(ConfigFieldError, match=r"'sliding_window' must be null \(full attention\) or a positive "
                                               r"integer, got 0"):
        parse_spec({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 0})
    with pytest.raises(ConfigFieldError, match="'layer_types' must list 4 entries"):
        parse_spec({**BASE, "use_sliding_window": True, "sliding_window": 9, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(ConfigFieldError, match="'layer_types' names sliding_attention layers but the sliding "
                                               "window is off"):
        parse_spec({**BASE, "sliding_window": 9, "layer_types": ["sliding_attention"] * 4})
    with pytest.raises(ConfigFieldError, match="'layer_types' with full-attention layers is not supported"):
        parse_spec({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 9,
                    "layer_types": ["full_attention", "sliding_attention"] * 2})
