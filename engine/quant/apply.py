"""The load-time hook: swap a loaded float model's linears for quantized ones (a module swap; no model file forks).

    quantized                                  kept in the model dtype
    layers.i.attn.qkv, attn.o                  embed, every norm, lm_head (also when tied to embed)
    layers.i.mlp.gate_up, mlp.down             mlp.router (MoE routing), mlp.shared_gate
    layers.i.mlp.experts  (per expert)
    layers.i.mlp.shared.gate_up, shared.down

vLLM leaves lm_head unquantized by default too: the logits see every vocabulary row, where rounding errors show.
`quantize_vocab` (`--quantize-vocab`) quantizes the two vocabulary matrices as well, with the same scheme: the LM
head becomes a quantized linear (`CausalLM.quant_head`) and the embedding a `QuantEmbedding` that dequantizes the
rows it looks up; tied embeddings stay one quantized matrix. They are 13% of an 0.5B dense model's bytes and more of
a small one's, which is what keeps a whole model above the bytes the linears alone reach.
"""
from __future__ import annotations

from torch import nn

from engine.models.layers import Linear, SparseMoE
from engine.moe.backend import MoEBackend
from engine.moe.expert_parallel import ExpertParallelMoE
from engine.quant.linear import QuantEmbedding, quantized_linear, quantized_rows
from engine.quant.moe import QuantizedMoE, quantized_experts
from engine.quant.packed import QuantizedWeight
from engine.quant.schemes import QuantScheme

__all__ = ["QUANTIZED_LINEARS", "quantize_model", "quantize_vocab", "quantized_experts", "quantized_linear",
           "set_module"]

QUANTIZED_LINEARS = frozenset({"qkv", "o", "gate_up", "down"})    # module names (last part) that get quantized


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `name`."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_linear(linear: Linear, scheme: QuantScheme) -> nn.Module:
    weight = linear.weight.detach()                                      # [n, k]
    return scheme.pack(scheme.quantize(weight), linear.bias, weight.dtype, weight.device)


def quantize_experts(experts: MoEBackend, scheme: QuantScheme) -> QuantizedMoE:
    w13, w2 = experts.w13.detach(), experts.w2.detach()                  # [E, 2I, H], [E, H, I]
    ups: list[QuantizedWeight] = [scheme.quantize(w) for w in w13]
    downs: list[QuantizedWeight] = [scheme.quantize(w) for w in w2]
    return quantized_experts(ups, downs, w13.dtype, w13.device)


def quantize_model(model: nn.Module, scheme: QuantScheme) -> int:
    """Quantize `model`'s linears in place with `scheme` (see the table above); returns how many modules were
    swapped (a MoE layer's experts count once). Call `model.post_load()` after."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, Linear) and name.rpartition(".")[2] in QUANTIZED_LINEARS or isinstance(m, SparseMoE)]
    for name, module in targets:
        try:
            if isinstance(module, SparseMoE) and isinstance(module.experts, ExpertParallelMoE):
                module.experts.post_load()              # its own slots first, then quantize only those
                module.experts.set_inner(quantize_experts(module.experts.inner, scheme))
            elif isinstance(module, SparseMoE):
                module.experts = quantize_experts(module.experts, scheme)
            else:
                set_module(model, name, quantize_linear(module, scheme))
        except ValueError as e:
            raise ValueError(f"quantizing {name} with {scheme.tag}: {e}") from e
    return len(targets)


def quantize_vocab(model: nn.Module, scheme: QuantScheme) -> None:
    """Quantize `model`'s LM head and token embedding with `scheme` (one matrix when tied). Call before
    `model.post_load()`."""
    embed = model.embed.weight.detach()                                  # [V, H]
    tied = model.lm_head is None
    try:
        head_qw = scheme.quantize(embed if tied else model.lm_head.detach())
        head = scheme.pack(head_qw, None, embed.dtype, embed.device)
        embed_qw = head_qw if tied else scheme.quantize(embed)
    except ValueError as e:
        raise ValueError(f"quantizing the vocabulary matrices (quantize_vocab) with {scheme.tag}: {e}") from e
    model.quant_head = head
    model.embed = QuantEmbedding(quantized_rows(embed_qw, embed.dtype, embed.device, head if tied else None),
                                 embed.dtype)
    model.lm_head = None
