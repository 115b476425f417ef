"""fp8 (e4m3fn) weights, one scale per output channel, amax / 448 (vLLM's `fp8`: W8A8 with per-token activation
scales computed at run time by the module)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.packed import Fp8Weight
from engine.quant.schemes.base import QuantScheme, check_matrix

FP8_MAX = 448.0     # largest finite float8_e4m3fn


def to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even into e4m3fn, saturating (the cast alone turns overflow into NaN)."""
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """|w - dequantize()| <= max(|w| * 2**-4, scale * 2**-10) element-wise (half an e4m3 step: 3 mantissa bits,
    subnormal spacing 2**-9)."""
    check_matrix(w, "fp8")
    w = w.float().contiguous()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)    # [n]
    return Fp8Weight(to_fp8(w / scale[:, None]), scale)


@dataclass(frozen=True)
class Fp8Scheme(QuantScheme):
    name = "fp8"

    def quantize(self, w: torch.Tensor) -> Fp8Weight:
        return quantize_fp8(w)
