"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`): the tensors of one quantized linear.

    pack-quantized   {p}.weight_packed      int32 [n, ceil(k * bits / 32)]  value + 2**(bits-1), LSB first (packing.py)
                     {p}.weight_shape       int   [2] = (n, k)
                     {p}.weight_zero_point  int32 [ceil(n * bits / 32), G]  asymmetric only; packed along n, offset
                                                                           as the weight (older writers: int8 [n, G])
    int-/naive-      {p}.weight             int8  [n, k]  signed values
    quantized        {p}.weight_zero_point  int8  like the scale           asymmetric only
    float-quantized  {p}.weight             float8_e4m3fn [n, k]
    all              {p}.weight_scale       [n, k / g] (group) | [n, 1] (channel) | [1] (tensor)
                     {p}.weight_g_idx       int [k]  only with act-order "group" (act_order.py)

    W = (q - zero) * scale, q and zero in the signed range [-2**(bits-1), 2**(bits-1)) (compressed-tensors
    `dequantize`); an IntWeight with a zero point holds both shifted by 2**(bits-1), the same difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.models.errors import ConfigFieldError
from engine.models.weights import TensorReader
from engine.quant.formats.act_order import act_order_perm
from engine.quant.formats.base import ActivationQuant, CheckpointQuant
from engine.quant.formats.ct_config import CtGroup, CtWeights, group_of, parse_groups
from engine.quant.formats.fields import Fields
from engine.quant.formats.packing import unpack_words
from engine.quant.formats.tensors import (FLOAT_DTYPES, INT_DTYPES, Shape, has_tensor, read_tensor,
                                          shape_error)
from engine.quant.packed import Fp8Weight, IntWeight, QuantizedWeight


@dataclass(frozen=True)
class CompressedTensorsQuant(CheckpointQuant):
    scheme: str
    name: str
    groups: tuple[CtGroup, ...]
    ignore: tuple[str, ...]
    activations: ActivationQuant | None = None

    def is_quantized(self, reader: TensorReader, hf_prefix: str) -> bool:
        return group_of(hf_prefix, self.groups, self.ignore) is not None

    def read(self, reader: TensorReader, hf_prefix: str) -> QuantizedWeight:
        group = group_of(hf_prefix, self.groups, self.ignore)
        if group is None:
            raise ConfigFieldError(f"{hf_prefix} is not quantized: no quantization_config.config_groups target "
                                   f"matches it, or quantization_config.ignore lists it")
        w = group.weights
        if w.type == "float":
            return _read_fp8(reader, hf_prefix, w)
        if w.format == "pack-quantized":
            return _read_packed(reader, hf_prefix, w)
        return _read_int(reader, hf_prefix, w)


def _scale_shapes(w: CtWeights, n: int, k: int) -> tuple[Shape, ...]:
    if w.strategy == "group":
        return ((n, k // w.group_size),)
    return ((n, 1), (n,)) if w.strategy == "channel" else ((1,), (), (1, 1))


def _read_scale(reader: TensorReader, p: str, w: CtWeights, n: int, k: int) -> tuple[torch.Tensor, int]:
    """float32 `[n, G]` and the group size (k for channel and tensor scales)."""
    if w.strategy == "group" and k % w.group_size:
        raise shape_error(reader, _weight_name(reader, p), f"k a multiple of group_size={w.group_size}")
    scale = read_tensor(reader, f"{p}.weight_scale", _scale_shapes(w, n, k), FLOAT_DTYPES,
                        f"{w.strategy} weight scale").float()
    if w.strategy == "group":
        return scale, w.group_size
    return scale.reshape(-1, 1).expand(n, 1).contiguous(), k                 # [n, 1]


def _weight_name(reader: TensorReader, p: str) -> str:
    return f"{p}.weight_packed" if has_tensor(reader, f"{p}.weight_packed") else f"{p}.weight"


def _read_zero(reader: TensorReader, p: str, w: CtWeights, n: int, k: int) -> torch.Tensor:
    """Signed int32 `[n, G]` zero points: packed int32 (pack-quantized group / channel, as compressed-tensors
    writes them) or stored as they are (int8, shaped like the scale)."""
    name, groups = f"{p}.weight_zero_point", k // w.group_size if w.strategy == "group" else 1
    packed_shape = (math.ceil(n * w.bits / 32), groups)
    may_pack = w.format == "pack-quantized" and w.strategy in ("group", "channel")
    zero = read_tensor(reader, name, _scale_shapes(w, n, k) + ((packed_shape,) if may_pack else ()), INT_DTYPES,
                       "asymmetric zero point")
    if may_pack and zero.dtype == torch.int32 and tuple(zero.shape) == packed_shape:
        return unpack_words(zero, w.bits, dim=0)[:n] - (1 << (w.bits - 1))              # [n, G]
    return zero.to(torch.int32).reshape(-1, groups).expand(n, groups).contiguous()      # [n, G]


def _read_g_idx(reader: TensorReader, p: str, w: CtWeights, k: int) -> torch.Tensor | None:
    name = f"{p}.weight_g_idx"
    if w.strategy != "group" or not has_tensor(reader, name):
        return None
    g_idx = read_tensor(reader, name, ((k,),), INT_DTYPES, "act-order group of each input column")
    try:
        return act_order_perm(g_idx, w.group_size)
    except ValueError as e:
        raise shape_error(reader, name, f"a group index per column; {e}") from None


def _int_weight(reader: TensorReader, p: str, w: CtWeights, q: torch.Tensor) -> IntWeight:
    """`q` signed int32 `[n, k]` as compressed-tensors quantized it."""
    n, k = q.shape
    scale, g = _read_scale(reader, p, w, n, k)
    perm = _read_g_idx(reader, p, w, k)
    if perm is not None:
        q = q[:, perm]                                                       # [n, k] groups now contiguous
    if w.symmetric:
        return IntWeight(q.contiguous(), scale, None, g, w.bits, perm)
    offset = 1 << (w.bits - 1)
    zero = _read_zero(reader, p, w, n, k) + offset                           # [n, G] unsigned
    return IntWeight((q + offset).contiguous(), scale, zero, g, w.bits, perm)


def _read_packed(reader: TensorReader, p: str, w: CtWeights) -> IntWeight:
    packed = read_tensor(reader, f"{p}.weight_packed", ((None, None),), (torch.int32,), "packed int weight")
    n, k = (int(v) for v in read_tensor(reader, f"{p}.weight_shape", ((2,),), INT_DTYPES, "(out, in) features"))
    if tuple(packed.shape) != (n, math.ceil(k * w.bits / 32)):
        raise shape_error(reader, f"{p}.weight_packed", f"[{n}, ceil({k} * {w.bits} / 32)] from {p}.weight_shape")
    q = unpack_words(packed, w.bits, dim=1)[:, :k] - (1 << (w.bits - 1))    # [n, k] signed
    return _int_weight(reader, p, w, q)


def _read_int(reader: TensorReader, p: str, w: CtWeights) -> IntWeight:
    weight = read_tensor(reader, f"{p}.weight", ((None, None),), (torch.int8,), f"int{w.bits} weight")
    return _int_weight(reader, p, w, weight.to(torch.int32))


def _read_fp8(reader: TensorReader, p: str, w: CtWeights) -> Fp8Weight:
    weight = read_tensor(reader, f"{p}.weight", ((None, None),), (torch.float8_e4m3fn,), "FP8 weight")
    n, k = weight.shape
    scale, _ = _read_scale(reader, p, w, n, k)                               # [n, 1]
    return Fp8Weight(weight, scale.reshape(n).contiguous())


def _one_scheme(qc: Fields, groups: tuple[CtGroup, ...]) -> tuple[str, ActivationQuant | None]:
    """All groups must map to one engine scheme and one activation mode: the loader builds one kind of linear."""
    kinds = {(g.weights.scheme, g.activations) for g in groups}
    if len(kinds) > 1:
        shown = {g.name: g.label for g in groups}
        raise ConfigFieldError(f"{qc.source}: {qc.name('config_groups')} mixes quantizations {shown}; supported: "
                               f"groups that all map to one scheme (int4, int8 or fp8) and one activation mode")
    return kinds.pop()


def parse_compressed_tensors(qc: Fields) -> CompressedTensorsQuant:
    qc.refuse_set("kv_cache_scheme", "KV-cache quantization from the checkpoint is not supported "
                                     "(the engine's --kv-cache-dtype quantizes the cache itself)")
    qc.refuse_set("sparsity_config", "sparse compressed-tensors checkpoints are not supported")
    qc.refuse_set("transform_config", "transformed (rotated) weights need online transforms, which are not supported")
    qc.refuse_set("moe_sparsity_config", "MoE expert sparsity is not supported")
    groups = parse_groups(qc)
    scheme, activations = _one_scheme(qc, groups)
    name = "ct-" + "+".join(dict.fromkeys(g.label for g in groups))
    return CompressedTensorsQuant(scheme=scheme, name=name, groups=groups, ignore=qc.strings("ignore"),
                                  activations=activations)
