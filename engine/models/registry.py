"""Supported architectures, keyed by Hugging Face `architectures[0]`.

One decoder (engine/models/decoder.py) serves every entry; an entry only says which pluggable parts it uses and
how its checkpoint names the weights. Adding a Llama-like model is one `ArchTraits` line here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MoEKind = Literal["none", "mixtral", "qwen_moe"]


@dataclass(frozen=True)
class ArchTraits:
    """What distinguishes one architecture from the shared Llama-style decoder."""

    qkv_bias_key: str | None      # config.json key that switches q/k/v bias on (None: use qkv_bias_default)
    qkv_bias_default: bool
    o_bias_follows_qkv: bool      # Llama's `attention_bias` also puts a bias on o_proj
    qk_norm: bool                 # per-head RMSNorm on q and k before RoPE (Qwen3)
    moe: MoEKind
    shared_expert: bool = False   # a dense shared expert behind a sigmoid gate (Qwen2-MoE)
    default_rope_theta: float = 10000.0
    default_rms_eps: float = 1e-6


ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits("attention_bias", False, True, False, "none"),
    "Qwen2ForCausalLM": ArchTraits(None, True, False, False, "none"),
    "Qwen3ForCausalLM": ArchTraits("attention_bias", False, True, True, "none"),
    "MixtralForCausalLM": ArchTraits(None, False, False, False, "mixtral", False, 1e6, 1e-5),
    "Qwen2MoeForCausalLM": ArchTraits("qkv_bias", True, False, False, "qwen_moe", shared_expert=True),
    "Qwen3MoeForCausalLM": ArchTraits("attention_bias", False, True, True, "qwen_moe"),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)
