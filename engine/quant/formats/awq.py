"""AWQ checkpoints (`quant_method: "awq"`, AutoAWQ's GEMM layout), 4-bit with zero points.

    {prefix}.qweight  int32 [k, n / 8]    8 output columns per word, interleaved (below)
    {prefix}.qzeros   int32 [G, n / 8]    same interleave; G = k / group_size; zeros stored as they are
    {prefix}.scales   fp16  [G, n]

    W[o, c] = scales[c // g, o] * (q[c, o] - zero[c // g, o])

The interleave: nibble i of word w holds output column 8w + AWQ_ORDER[i] (AutoAWQ WQLinear_GEMM.from_linear), so
after a plain unpack (packing.py) column 8w + c is found at nibble AWQ_REVERSE_ORDER[c].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.weights import TensorReader
from engine.quant.formats.base import CheckpointQuant
from engine.quant.formats.fields import Fields
from engine.quant.formats.packing import unpack_words
from engine.quant.formats.tensors import FLOAT_DTYPES, has_tensor, read_tensor, shape_error
from engine.quant.packed import IntWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
BITS = (4,)
VERSIONS = ("gemm",)


def _deinterleave(values: torch.Tensor) -> torch.Tensor:
    """`[rows, n]` unpacked AWQ nibbles -> the same values in natural column order."""
    n = values.shape[1]
    per = len(AWQ_ORDER)
    index = (torch.arange(n // per)[:, None] * per + torch.tensor(AWQ_REVERSE_ORDER)[None, :]).flatten()  # [n]
    return values[:, index]


@dataclass(frozen=True)
class AwqQuant(CheckpointQuant):
    scheme: str
    name: str
    bits: int
    group_size: int

    def is_quantized(self, reader: TensorReader, hf_prefix: str) -> bool:
        return has_tensor(reader, f"{hf_prefix}.qweight")

    def read(self, reader: TensorReader, hf_prefix: str) -> IntWeight:
        p, per, g = hf_prefix, 32 // self.bits, self.group_size
        qweight = read_tensor(reader, f"{p}.qweight", ((None, None),), (torch.int32,), "AWQ packed weight")
        k, n = qweight.shape[0], qweight.shape[1] * per
        if k % g:
            raise shape_error(reader, f"{p}.qweight", f"[k, n / {per}] with k a multiple of group_size={g}")
        groups = k // g
        scales = read_tensor(reader, f"{p}.scales", ((groups, n),), FLOAT_DTYPES, "AWQ scales [k / g, n]")
        qzeros = read_tensor(reader, f"{p}.qzeros", ((groups, n // per),), (torch.int32,), "AWQ zeros")
        q = _deinterleave(unpack_words(qweight, self.bits, dim=1)).T          # [n, k]
        zero = _deinterleave(unpack_words(qzeros, self.bits, dim=1)).T        # [n, G]
        return IntWeight(q.contiguous(), scales.float().T.contiguous(), zero.contiguous(), g, self.bits)


def _version(qc: Fields) -> str:
    """transformers v5 writes `format` and the legacy `version`; the legacy one wins, as transformers reads it."""
    key = "version" if qc.has("version") or not qc.has("format") else "format"
    return qc.choice(key, VERSIONS, "gemm")


def parse_awq(qc: Fields) -> AwqQuant:
    bits = qc.choice("bits", BITS)
    group_size = qc.integer("group_size")
    if group_size <= 0:
        raise qc.error("group_size", group_size, "a positive number of input columns")
    qc.choice("zero_point", (True,), True)
    _version(qc)
    # `backend` otherwise names a run-time kernel, not a layout; llm-awq packs differently.
    if str(qc.get("backend", "")).lower() == "llm-awq":
        raise qc.error("backend", "llm-awq", "any backend but 'llm-awq' (its packing is not AutoAWQ GEMM's)")
    return AwqQuant(scheme=f"int{bits}", name=f"awq-int{bits}-g{group_size}", bits=bits, group_size=group_size)
