"""Supported architectures, keyed by Hugging Face `architectures[0]`.

One decoder (engine/models/decoder.py) serves every entry; an entry only says which pluggable parts it uses and
how its checkpoint names the weights. Adding a Llama-like model is one `ArchTraits` line here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MoEKind = Literal["none", "mixtral", "qwen_moe"]
# Which layers slide, as each architecture's transformers config and modeling decide (see spec.parse_windows):
#   none       no sliding window (Llama: transformers ignores a `sliding_window` field)
#   all        every layer, when `sliding_window` is set (Mistral, Mixtral)
#   all_gated  every layer, when `use_sliding_window` is also true (Qwen3-MoE)
#   qwen2      `layer_types`, else layers i >= max_window_layers; gated by use_sliding_window (Qwen2, Qwen3)
#   qwen2_moe  `layer_types`, else even layers i < max_window_layers; gated by use_sliding_window (Qwen2-MoE)
SlidingKind = Literal["none", "all", "all_gated", "qwen2", "qwen2_moe"]


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
    sliding: SlidingKind = "none"


ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits("attention_bias", False, True, False, "none"),
    "MistralForCausalLM": ArchTraits(None, False, False, False, "none", sliding="all"),
    "Qwen2ForCausalLM": ArchTraits(None, True, False, False, "none", sliding="qwen2"),
    "Qwen3ForCausalLM": ArchTraits("attention_bias", False, True, True, "none", sliding="qwen2"),
    "MixtralForCausalLM": ArchTraits(None, False, False, False, "mixtral", False, 1e6, 1e-5, sliding="all"),
    "Qwen2MoeForCausalLM": ArchTraits("qkv_bias", True, False, False, "qwen_moe", shared_expert=True,
                                      sliding="qwen2_moe"),
    "Qwen3MoeForCausalLM": ArchTraits("attention_bias", False, True, True, "qwen_moe", sliding="all_gated"),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)
