"""int4 weights, asymmetric, group-wise (W4A16): per group of `group_size` input columns a float scale and an
integer zero point in 0..15, w ~= (q - zero) * scale with q in 0..15."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.packed import IntWeight
from engine.quant.schemes.base import QuantScheme, check_matrix

QMAX = 15


def quantize_int4(w: torch.Tensor, group_size: int) -> IntWeight:
    """Round-to-nearest over each group's [min(w, 0), max(w, 0)] (0 stays exact, as GPTQ's grid keeps it):
    |w - dequantize()| <= scale / 2 element-wise, scale = (max - min) / 15 of the group."""
    check_matrix(w, "int4")
    n, k = w.shape
    if k % group_size:
        fits = [g for g in (32, 64, 128) if k % g == 0]
        raise ValueError(f"int4: in_features {k} is not a multiple of quant_group_size {group_size}; "
                         f"use one of {fits or 'none: this layer cannot be int4-quantized'}")
    groups = w.float().contiguous().reshape(n, k // group_size, group_size)                             # [n, G, g]
    lo = groups.amin(dim=-1).clamp(max=0.0)                                                # [n, G]
    hi = groups.amax(dim=-1).clamp(min=0.0)                                                # [n, G]
    scale = ((hi - lo) / QMAX).clamp(min=torch.finfo(torch.float32).tiny)                  # [n, G]
    zero = torch.round(-lo / scale).clamp(0, QMAX)                                         # [n, G]
    q = torch.round(groups / scale[..., None]) + zero[..., None]                           # [n, G, g]
    q = q.clamp(0, QMAX).to(torch.int32).reshape(n, k)                                     # [n, k]
    return IntWeight(q, scale, zero.to(torch.int32), group_size=group_size, bits=4)


@dataclass(frozen=True)
class Int4Scheme(QuantScheme):
    name = "int4"

    def quantize(self, w: torch.Tensor) -> IntWeight:
        return quantize_int4(w, self.group_size)
