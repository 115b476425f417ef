"""Load the linears a pre-quantized checkpoint stores quantized straight into quantized modules (never into float
weights: the decoder's empty float placeholders are swapped out unread).

For every linear `quantize_model` would swap, the HF parts behind it (engine.models.weights.weight_sources:
q|k|v for qkv, gate|up for gate_up, per expert gate|up and down) are read by the checkpoint's format reader
(`CheckpointQuant.read`, engine/quant/formats) and packed by `quantized_linear_parts` (one weight through
`concat_rows`, or a ConcatLinear where the parts differ in act-order perm or layout). A linear the checkpoint
stores in float (lm_head, a layer its config ignores) stays float and loads as usual; one it quantized that stays
float here (router, shared_gate, lm_head) is dequantized into its float parameter. Biases are parameters of the
quantized module and load as usual too. Activation quantization a checkpoint declares (`cq.activations`, e.g.
int8 per token) is not reproduced: activations stay in the model dtype, the more precise choice, except that fp8
weights run W8A8 with per-token e4m3 activations as vLLM's fp8 does.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.errors import CheckpointError, TensorShapeError
from engine.models.layers import Linear, SparseMoE
from engine.models.spec import ModelSpec
from engine.models.weights import Source, TensorReader, weight_sources
from engine.moe.backend import MoEBackend
from engine.moe.expert_parallel import ExpertParallelMoE
from engine.quant.apply import QUANTIZED_LINEARS, set_module
from engine.quant.formats.base import CheckpointQuant
from engine.quant.linear import quantized_linear_parts
from engine.quant.moe import QuantizedMoE
from engine.quant.packed import IntWeight, QuantizedWeight


def _prefixes(names: tuple[str, ...], expert: int | None = None) -> list[str]:
    """HF module prefixes of a source's tensors ("model.layers.0.self_attn.q_proj"), for one expert if given."""
    return [(n if expert is None else n.format(e=expert)).removesuffix(".weight") for n in names]


def _read_parts(cq: CheckpointQuant, reader: TensorReader, prefixes: list[str]) -> list[QuantizedWeight] | None:
    """Every part's weight; None when the checkpoint stores all of them in float."""
    flags = [cq.is_quantized(reader, p) for p in prefixes]
    if not any(flags):
        return None
    if not all(flags):
        raise CheckpointError(f"the checkpoint quantizes only some of {prefixes}, which share one matmul here")
    return [cq.read(reader, p) for p in prefixes]


def _check_shape(parts: list[QuantizedWeight], expected: tuple[int, ...], prefixes: list[str]) -> None:
    rows, cols = sum(p.shape[0] for p in parts), {p.shape[1] for p in parts}
    if (rows, *cols) != tuple(expected):
        shapes = [list(p.shape) for p in parts]
        raise TensorShapeError(f"quantized {prefixes} have shapes {shapes}, expected {list(expected)} joined on "
                               f"rows, from config.json")


def _linear(cq: CheckpointQuant, reader: TensorReader, linear: Linear, src: Source) -> nn.Module | None:
    prefixes = _prefixes(src.names)
    parts = _read_parts(cq, reader, prefixes)
    if parts is None:
        return None
    weight = linear.weight
    _check_shape(parts, tuple(weight.shape), prefixes)
    return quantized_linear_parts(parts, linear.bias, weight.dtype, weight.device)   # bias: filled by load_weights


def _experts(cq: CheckpointQuant, reader: TensorReader, moe: SparseMoE, up: Source,
             down: Source) -> MoEBackend | None:
    w13, w2 = moe.experts.w13, moe.experts.w2                                  # [E, 2I, H], [E, H, I]
    ups, downs = [], []
    for e in range(w13.shape[0]):
        ps13, ps2 = _prefixes(up.names, e), _prefixes(down.names, e)
        parts13, parts2 = _read_parts(cq, reader, ps13), _read_parts(cq, reader, ps2)
        if parts13 is None or parts2 is None:
            if e == 0 and parts13 is None and parts2 is None:
                return None                                                    # float experts
            raise CheckpointError(f"expert {e} of {ps13[0]}: the checkpoint quantizes only some experts' weights")
        _check_shape(parts13, tuple(w13.shape[1:]), ps13)
        _check_shape(parts2, tuple(w2.shape[1:]), ps2)
        ups.append(quantized_linear_parts(parts13, None, w13.dtype, w13.device))
        downs.append(quantized_linear_parts(parts2, None, w2.dtype, w2.device))
    if isinstance(moe.experts, ExpertParallelMoE):      # only this rank's slots
        moe.experts.adopt_all(lambda ids: QuantizedMoE([ups[e] for e in ids], [downs[e] for e in ids]))
        return moe.experts
    return QuantizedMoE(ups, downs)


def _dequantized(cq: CheckpointQuant, reader: TensorReader, param: torch.Tensor, src: Source) -> bool:
    """Fill a float parameter from parts the checkpoint quantized anyway (a Mixtral router a recipe did not
    ignore, lm_head): their dequantization, so routing and logits stay float. False when stored float."""
    prefixes = _prefixes(src.names)
    parts = _read_parts(cq, reader, prefixes)
    if parts is None:
        return False
    _check_shape(parts, tuple(param.shape), prefixes)
    with torch.no_grad():
        param.copy_(torch.cat([in_input_order(p).dequantize() for p in parts]))
    return True


def in_input_order(qw: QuantizedWeight) -> QuantizedWeight:
    """The weight with act-order undone (columns back in input order), for a plain float matmul."""
    if not isinstance(qw, IntWeight) or qw.perm is None:
        return qw
    inverse = torch.argsort(qw.perm)
    q, scale = qw.q[:, inverse], qw.scale.repeat_interleave(qw.group_size, dim=1)[:, inverse]
    zero = None if qw.zero is None else qw.zero.repeat_interleave(qw.group_size, dim=1)[:, inverse]
    return IntWeight(q, scale, zero, 1, qw.bits)


def load_prequantized(model: nn.Module, spec: ModelSpec, reader: TensorReader, cq: CheckpointQuant) -> frozenset[str]:
    """Swap in a quantized module for every linear (and MoE layer's experts) the checkpoint stores quantized, and
    dequantize into float the other linears it quantized (router, shared_gate, lm_head); returns the parameter
    names `load_weights` must no longer fill."""
    sources = weight_sources(spec)
    done: set[str] = set()
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE):
            w13, w2 = f"{name}.experts.w13", f"{name}.experts.w2"
            experts = _experts(cq, reader, module, sources[w13], sources[w2])
            if experts is not None:
                module.experts = experts
                done |= {w13, w2}
        elif isinstance(module, Linear) and name.rpartition(".")[2] in QUANTIZED_LINEARS:
            quantized = _linear(cq, reader, module, sources[f"{name}.weight"])
            if quantized is not None:
                set_module(model, name, quantized)
                done.add(f"{name}.weight")
        elif isinstance(module, Linear) and _dequantized(cq, reader, module.weight, sources[f"{name}.weight"]):
            done.add(f"{name}.weight")
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and _dequantized(cq, reader, lm_head, sources["lm_head"]):
        done.add("lm_head")
    return frozenset(done)
