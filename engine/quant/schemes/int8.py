"""int8 weights, symmetric, one scale per output channel (W8A16): w ~= q * amax(|row|) / 127."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.packed import IntWeight
from engine.quant.schemes.base import QuantScheme, check_matrix

QMAX = 127


def quantize_int8(w: torch.Tensor) -> IntWeight:
    """Round-to-nearest; |w - dequantize()| <= scale / 2 element-wise, scale = amax(|row|) / 127."""
    check_matrix(w, "int8")
    w = w.float().contiguous()
    scale = (w.abs().amax(dim=1, keepdim=True) / QMAX).clamp(min=torch.finfo(torch.float32).tiny)  # [n, 1]
    q = torch.round(w / scale).clamp(-QMAX, QMAX).to(torch.int32)                                 # [n, k]
    return IntWeight(q, scale, None, group_size=w.shape[1], bits=8)


@dataclass(frozen=True)
class Int8Scheme(QuantScheme):
    name = "int8"

    def quantize(self, w: torch.Tensor) -> IntWeight:
        return quantize_int8(w)
