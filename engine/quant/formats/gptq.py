"""GPTQ checkpoints (`quant_method: "gptq"`: AutoGPTQ, GPTQModel, optimum), 4-bit.

    {prefix}.qweight  int32 [k / 8, n]    8 input rows per word: row 8r + j in bits [4j, 4j + 4) (packing.py)
    {prefix}.qzeros   int32 [G, n / 8]    8 output columns per word, same nibble order; G = k / group_size
    {prefix}.scales   fp16  [G, n]
    {prefix}.g_idx    int32 [k]           group of each input row (act-order: not sorted; act_order.py)

    W[o, c] = scales[g_idx[c], o] * (q[c, o] - zero[g_idx[c], o])

Zero points. The v1 format ("gptq", the default and what published checkpoints use) stores `zero - 1` in each
nibble, written by GPTQModel as one 32-bit word subtraction (`qzeros -= 0x11111111`, borrows included) and by
AutoGPTQ per nibble; "gptq_v2" stores the zeros themselves. v1 is read back with GPTQModel's inverse, one word
addition of 0x11111111, which is exact for every zero GPTQModel writes and for every zero >= 1 AutoGPTQ writes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.weights import TensorReader
from engine.quant.formats.act_order import act_order_perm
from engine.quant.formats.base import CheckpointQuant
from engine.quant.formats.fields import Fields
from engine.quant.formats.packing import add_per_field, unpack_words
from engine.quant.formats.tensors import FLOAT_DTYPES, INT_DTYPES, has_tensor, read_tensor, shape_error
from engine.quant.packed import IntWeight

BITS = (4,)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GptqQuant(CheckpointQuant):
    """`group_size` -1: one group per output channel. `v1`: zeros stored minus one (see the module docstring)."""

    scheme: str
    name: str
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    v1: bool

    def is_quantized(self, reader: TensorReader, hf_prefix: str) -> bool:
        return has_tensor(reader, f"{hf_prefix}.qweight")

    def read(self, reader: TensorReader, hf_prefix: str) -> IntWeight:
        p, per = hf_prefix, 32 // self.bits
        qweight = read_tensor(reader, f"{p}.qweight", ((None, None),), (torch.int32,), "GPTQ packed weight")
        k, n = qweight.shape[0] * per, qweight.shape[1]
        g = k if self.group_size == -1 else self.group_size
        if k % g or n % per:
            raise shape_error(reader, f"{p}.qweight", f"[k / {per}, n] with k a multiple of group_size={g} and n "
                                                     f"a multiple of {per}")
        groups = k // g
        scales = read_tensor(reader, f"{p}.scales", ((groups, n),), FLOAT_DTYPES, "GPTQ scales [k / g, n]")
        qzeros = read_tensor(reader, f"{p}.qzeros", ((groups, n // per),), (torch.int32,), "GPTQ zeros")
        q = unpack_words(qweight, self.bits, dim=0).T                       # [n, k]
        words = add_per_field(qzeros, self.bits, 1) if self.v1 else qzeros
        zero = unpack_words(words, self.bits, dim=1).T                      # [n, G]
        perm = self._perm(reader, p, k, g)
        if perm is not None:
            q = q[:, perm]                                                  # [n, k] groups now contiguous
        return _int_weight(q, scales.float().T, zero, g, self.bits, perm)

    def _perm(self, reader: TensorReader, p: str, k: int, g: int) -> torch.Tensor | None:
        if not has_tensor(reader, f"{p}.g_idx"):
            return None
        g_idx = read_tensor(reader, f"{p}.g_idx", ((k,),), INT_DTYPES, "GPTQ group of each input row")
        try:
            return act_order_perm(g_idx, g)
        except ValueError as e:
            raise shape_error(reader, f"{p}.g_idx", f"a group index per row; {e}") from None


def _int_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int, bits: int,
                perm: torch.Tensor | None) -> IntWeight:
    """Symmetric form (signed `q`, no zero) when every zero is the midpoint, as GPTQ `sym: true` writes them."""
    mid = 1 << (bits - 1)
    if bool((zero == mid).all()):
        return IntWeight(q - mid, scale.contiguous(), None, g, bits, perm)
    return IntWeight(q, scale.contiguous(), zero.contiguous(), g, bits, perm)


def _checkpoint_format(qc: Fields) -> bool:
    """True for v1. transformers lets the legacy `checkpoint_format` win over `format`."""
    key = "checkpoint_format" if qc.has("checkpoint_format") else "format"
    return qc.choice(key, CHECKPOINT_FORMATS, "gptq") == "gptq"


def parse_gptq(qc: Fields) -> GptqQuant:
    bits = qc.choice("bits", BITS)
    group_size = qc.integer("group_size", -1)
    if group_size != -1 and group_size <= 0:
        raise qc.error("group_size", group_size, "a positive number of input columns, or -1 (per channel)")
    qc.choice("pack_dtype", ("int32",), "int32")
    qc.refuse_set("is_marlin_format", "Marlin-repacked GPTQ is not supported; use the plain gptq checkpoint")
    qc.refuse_set("dynamic", "per-module overrides of GPTQ bits / group size are not supported")
    sym, desc_act = qc.flag("sym", True), qc.flag("desc_act", False)
    v1 = _checkpoint_format(qc)
    name = f"gptq-int{bits}-" + ("ch" if group_size == -1 else f"g{group_size}")
    name += ("-act" if desc_act else "") + ("" if sym else "-asym") + ("" if v1 else "-v2")
    return GptqQuant(scheme=f"int{bits}", name=name, bits=bits, group_size=group_size, sym=sym,
                     desc_act=desc_act, v1=v1)
