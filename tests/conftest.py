"""Shared test factories: tiny random Hugging Face checkpoints of every supported architecture.

`tiny_checkpoint(name)` builds (once per session, seeded, fp32) a transformers model, saves it with
`save_pretrained` plus a small WordLevel tokenizer.json, and returns the folder and the in-memory HF model, which
tests use as the numerics oracle. Weights are re-drawn with a larger spread than HF's init so logits, routing and
RoPE scaling actually matter.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from kvstore.transfer.nixl import nixl_missing

# Engines the tests build run eager unless a test asks for the compiled decode step (`enforce_eager=False`): a
# first compile takes 20-40 s on a CPU. tests/unit/test_compiled_decode.py and the compiled serving test cover it.
os.environ.setdefault("STRATA_ENFORCE_EAGER", "1")
# The test process talks gRPC and then forks servers and workers: see the NOTE in strata/launcher.py.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# NIXL is optional for users; `.ci/run` installs it and sets STRATA_REQUIRE_NIXL=1, so there its tests fail, not skip.
SKIP_NIXL = nixl_missing() and not os.environ.get("STRATA_REQUIRE_NIXL")
needs_nixl = pytest.mark.skipif(SKIP_NIXL, reason="NIXL is not installed (pip install nixl-cu12); CI requires it")

TINY_COMMON: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
_LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}

# name -> (transformers config class name, extra config fields, save options)
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}, {}),
    "llama_sharded": ("LlamaConfig", {"tie_word_embeddings": True}, {"max_shard_size": "40KB"}),
    "llama_llama3": ("LlamaConfig", {"rope_parameters": _LLAMA3}, {}),
    "qwen2": ("Qwen2Config", {}, {}),
    "qwen2_yarn": ("Qwen2Config", {"rope_parameters": _YARN}, {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, {}),
    "qwen3_linear": ("Qwen3Config", {"head_dim": 16, "rope_parameters": _LINEAR}, {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, {}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "shared_expert_intermediate_size": 64, **_MOE}, {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "head_dim": 16, "norm_topk_prob": True,
                                     "mlp_only_layers": [1], **_MOE}, {}),
}

_WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["<unk>", "<s>", "</s>"]


@dataclass
class TinyCheckpoint:
    path: Path
    hf_model: Any     # transformers PreTrainedModel, fp32, eval mode


def _randomize(model: Any, seed: int) -> None:
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def write_tokenizer(folder: Path, vocab_words: list[str] = _WORDS) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {tok: i for i, tok in enumerate(SPECIAL + vocab_words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))


def build_tiny_checkpoint(name: str, folder: Path, seed: int = 0) -> TinyCheckpoint:
    cls_name, extra, save_opts = TINY_VARIANTS[name]
    return build_checkpoint_of(cls_name, extra, folder, seed, save_opts)


def build_checkpoint_of(cls_name: str, extra: dict[str, Any], folder: Path, seed: int = 0,
                        save_opts: dict[str, Any] | None = None) -> TinyCheckpoint:
    """A tiny random checkpoint of transformers' `cls_name` config with TINY_COMMON + `extra` fields."""
    import torch
    import transformers
    save_opts = save_opts or {}
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra, "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(folder, **save_opts)
    write_tokenizer(folder)
    return TinyCheckpoint(folder, model)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyCheckpoint]:
    """Factory: `tiny_checkpoint("qwen3_moe")` -> TinyCheckpoint, built once per session per name."""
    built: dict[str, TinyCheckpoint] = {}

    def make(name: str) -> TinyCheckpoint:
        if name not in built:
            built[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]
    return make
