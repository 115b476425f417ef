"""Factories for the speculative-decoding tests: a random EAGLE head for a tiny target, and engines with a drafter."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from strata.llm import LLM


def write_random_eagle_head(folder: Path, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                            intermediate: int = 128, vocab: int = 320, seed: int = 0) -> Path:
    """A head checkpoint in the shipped format (engine/spec/eagle.py), with random weights."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["StrataEagleHead"], "model_type": "strata_eagle", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "intermediate_size": intermediate, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "vocab_size": vocab,
              "attention_bias": False, "hidden_act": "silu", "eagle": {"target": "tiny"}}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    p = "layers.0."
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden),
        f"{p}input_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
        f"{p}post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
        f"{p}self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        f"{p}self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        f"{p}self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        f"{p}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{p}self_attn.q_norm.weight": 1.0 + rand(head_dim, scale=0.1),
        f"{p}self_attn.k_norm.weight": 1.0 + rand(head_dim, scale=0.1),
        f"{p}mlp.gate_proj.weight": rand(intermediate, hidden), f"{p}mlp.up_proj.weight": rand(intermediate, hidden),
        f"{p}mlp.down_proj.weight": rand(hidden, intermediate)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def spec_llm(target: Path, method: str | None, draft: Path | None = None, k: int = 3, adaptive: bool = False,
             **kwargs) -> LLM:
    """An eager engine on `target` speculating with `method` (adaptive length off by default: every decode step
    verifies k drafts, so the tests exercise verification rather than the controller)."""
    return LLM(str(target), enforce_eager=True, speculative=method, num_speculative_tokens=k,
               speculative_model=None if draft is None else str(draft), speculative_adaptive=adaptive,
               num_blocks=kwargs.pop("num_blocks", 512), **kwargs)
