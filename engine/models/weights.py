"""Where each of the decoder's (fused, stacked) parameters comes from in a Hugging Face checkpoint.

    our parameter                      HF tensors (concatenated on dim 0, or stacked per expert)
    layers.i.attn.qkv.weight       <-  self_attn.q_proj | k_proj | v_proj
    layers.i.mlp.gate_up.weight    <-  mlp.gate_proj | up_proj
    layers.i.mlp.experts.w13       <-  stack_e( experts.e.gate_proj | up_proj )      (Mixtral: w1 | w3)
    layers.i.mlp.experts.w2        <-  stack_e( experts.e.down_proj )                (Mixtral: w2)

Every HF tensor's shape is checked against the slice it fills before anything is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.models.errors import MissingTensorError, TensorShapeError
from engine.models.spec import ModelSpec


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class TensorReader(Protocol):
    def shape(self, name: str) -> tuple[int, ...] | None: ...
    def get(self, name: str) -> torch.Tensor: ...
    def file_of(self, name: str) -> str: ...


@dataclass(frozen=True)
class Source:
    """Concatenate `names` on dim 0; `per_expert` True: each name is a template with `{e}`, stacked over experts.
    `fused`: an already-stacked tensor (transformers v5 layout) used when the per-expert names are absent."""

    names: tuple[str, ...]
    per_expert: bool = False
    fused: str | None = None


def _attn_sources(p: str, spec: ModelSpec) -> dict[str, Source]:
    a = f"{p}self_attn."
    out = {"attn.qkv.weight": Source((f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight")),
           "attn.o.weight": Source((f"{a}o_proj.weight",))}
    if spec.qkv_bias:
        out["attn.qkv.bias"] = Source((f"{a}q_proj.bias", f"{a}k_proj.bias", f"{a}v_proj.bias"))
    if spec.o_bias:
        out["attn.o.bias"] = Source((f"{a}o_proj.bias",))
    if spec.qk_norm:
        out["attn.q_norm.weight"] = Source((f"{a}q_norm.weight",))
        out["attn.k_norm.weight"] = Source((f"{a}k_norm.weight",))
    return out


def _dense_sources(mine: str, theirs: str, bias: bool) -> dict[str, Source]:
    out = {f"{mine}gate_up.weight": Source((f"{theirs}gate_proj.weight", f"{theirs}up_proj.weight")),
           f"{mine}down.weight": Source((f"{theirs}down_proj.weight",))}
    if bias:
        out[f"{mine}gate_up.bias"] = Source((f"{theirs}gate_proj.bias", f"{theirs}up_proj.bias"))
        out[f"{mine}down.bias"] = Source((f"{theirs}down_proj.bias",))
    return out


def _moe_sources(p: str, spec: ModelSpec) -> dict[str, Source]:
    if spec.architecture == "MixtralForCausalLM":
        m = f"{p}block_sparse_moe."
        gate, up, down = "w1", "w3", "w2"
    else:
        m = f"{p}mlp."
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    e = f"{m}experts.{{e}}."
    out = {"mlp.router.weight": Source((f"{m}gate.weight",)),
           "mlp.experts.w13": Source((f"{e}{gate}.weight", f"{e}{up}.weight"), True, f"{m}experts.gate_up_proj"),
           "mlp.experts.w2": Source((f"{e}{down}.weight",), True, f"{m}experts.down_proj")}
    if spec.moe is not None and spec.moe.shared_intermediate_size:
        out.update(_dense_sources("mlp.shared.", f"{m}shared_expert.", False))
        out["mlp.shared_gate.weight"] = Source((f"{m}shared_expert_gate.weight",))
    return out


def weight_sources(spec: ModelSpec) -> dict[str, Source]:
    """Our parameter name -> where it comes from in the checkpoint."""
    out = {"embed.weight": Source(("model.embed_tokens.weight",)), "norm.weight": Source(("model.norm.weight",))}
    if not spec.tie_word_embeddings:
        out["lm_head"] = Source(("lm_head.weight",))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layer = {"input_norm.weight": Source((f"{p}input_layernorm.weight",)),
                 "post_norm.weight": Source((f"{p}post_attention_layernorm.weight",)), **_attn_sources(p, spec)}
        sparse = spec.moe is not None and i in spec.moe.sparse_layers
        layer.update(_moe_sources(p, spec) if sparse else _dense_sources("mlp.", f"{p}mlp.", spec.mlp_bias))
        out.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return out


def _read_checked(reader: TensorReader, name: str, expected: tuple[int, ...], param: str) -> torch.Tensor:
    shape = reader.shape(name)
    if shape is None:
        raise MissingTensorError(f"tensor {name!r} (for {param}) is in none of the checkpoint's safetensors files")
    if tuple(shape) != expected:
        raise TensorShapeError(f"tensor {name!r} in {reader.file_of(name)} has shape {list(shape)}, expected "
                               f"{list(expected)} from config.json")
    tensor = reader.get(name)
    if tensor.dtype not in FLOAT_DTYPES:
        # NOTE: an fp8 tensor has the float weight's shape and would copy into it without its scale.
        raise TensorShapeError(f"tensor {name!r} in {reader.file_of(name)} has dtype {tensor.dtype}, expected one "
                               f"of {[str(d) for d in FLOAT_DTYPES]} (a quantized tensor no reader unpacked)")
    return tensor


def _split_rows(param_shape: tuple[int, ...], n_parts: int) -> list[tuple[int, ...]]:
    rows, rest = param_shape[0] // n_parts, param_shape[1:]
    return [(rows, *rest)] * n_parts


def _part_shapes(param_name: str, param_shape: tuple[int, ...], n_parts: int, spec: ModelSpec) -> list[tuple[int, ...]]:
    if ".qkv." in param_name:
        rest = param_shape[1:]
        return [(spec.q_size, *rest), (spec.kv_size, *rest), (spec.kv_size, *rest)]
    return _split_rows(param_shape, n_parts)


def _load_plain(reader: TensorReader, src: Source, name: str, shape: tuple[int, ...], spec: ModelSpec) -> torch.Tensor:
    parts = _part_shapes(name, shape, len(src.names), spec)
    tensors = [_read_checked(reader, n, s, name) for n, s in zip(src.names, parts)]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _load_experts(reader: TensorReader, src: Source, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if src.fused is not None and reader.shape(src.names[0].format(e=0)) is None \
            and reader.shape(src.fused) is not None:
        return _read_checked(reader, src.fused, shape, name)
    parts = _split_rows(shape[1:], len(src.names))
    experts = []
    for e in range(shape[0]):
        tensors = [_read_checked(reader, n.format(e=e), s, name) for n, s in zip(src.names, parts)]
        experts.append(torch.cat(tensors, dim=0))
    return torch.stack(experts)                                          # [E, rows, cols]


def load_weights(model: nn.Module, spec: ModelSpec, reader: TensorReader,
                 skip: frozenset[str] = frozenset(), only_layers: bool = False) -> None:
    """Fill every parameter of `model` from the checkpoint (raises MissingTensorError / TensorShapeError).
    `skip`: our parameter names another path already filled (engine.quant.prequantized: linears a pre-quantized
    checkpoint stores quantized, now quantized modules, and float ones it dequantized). `only_layers`: fill a
    module that holds `layers` alone."""
    sources = weight_sources(spec)
    if only_layers:   # a module of decoder layers only (an EAGLE head's): no embedding, final norm or LM head
        sources = {name: src for name, src in sources.items() if name.startswith("layers.")}
    params = dict(model.named_parameters())
    for name, src in sources.items():
        if name in skip:
            continue
        param = params[name]
        shape = tuple(param.shape)
        loaded = _load_experts(reader, src, name, shape) if src.per_expert else \
            _load_plain(reader, src, name, shape, spec)
        with torch.no_grad():
            param.copy_(loaded)
    missing = set(params) - set(sources)
    assert not missing, f"parameters without a checkpoint source: {sorted(missing)}"
