"""MXFP4 weights (OCP Microscaling v1.0): e2m1 elements, one e8m0 power-of-two scale per 32 input columns.

The block exponent is the smallest one that fits the block's amax into e2m1's largest value, 6.0:
`e = ceil(log2(amax / 6))`. (The spec's suggested `floor(log2(amax)) - 2` saturates values in (6, 8) * 2**e to 6;
the fitted exponent never clips, at the cost of one step coarser grids for some blocks.) Elements then round to
the nearest e2m1 value, ties to the even code, as the spec's conversion does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.packed import E2M1_VALUES, MX_BLOCK, Mxfp4Weight
from engine.quant.schemes.base import QuantScheme, check_matrix

E2M1_MAX = E2M1_VALUES[-1]
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))   # 7 rounding boundaries


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values already within [-6, 6] -> 4-bit codes (uint8): sign in bit 3, nearest magnitude (ties to
    the even code) in bits 0-2."""
    mag = x.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    lower = torch.bucketize(mag, mids, right=False)               # a tie goes down
    upper = torch.bucketize(mag, mids, right=True)                # a tie goes up
    code = torch.where(lower % 2 == 0, lower, upper)              # on a tie exactly one is even; else they agree
    return (code | ((x < 0) & (code > 0)).to(code.dtype) << 3).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> Mxfp4Weight:
    """`w [n, k]` (k a multiple of 32) -> packed codes `[n, k // 2]` and e8m0 scales `[n, k // 32]`."""
    check_matrix(w, "mxfp4")
    n, k = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"mxfp4: in_features {k} must be a multiple of the MX block size {MX_BLOCK}")
    blocks = w.float().contiguous().reshape(n, k // MX_BLOCK, MX_BLOCK)                                 # [n, B, 32]
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0 ** -126)                                # [n, B]
    exp = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)                        # [n, B]
    codes = e2m1_codes(blocks / torch.exp2(exp)[..., None]).reshape(n, k)                 # [n, k]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)                                        # [n, k/2]
    return Mxfp4Weight(packed, (exp + 127).to(torch.uint8))


@dataclass(frozen=True)
class Mxfp4Scheme(QuantScheme):
    name = "mxfp4"

    def quantize(self, w: torch.Tensor) -> Mxfp4Weight:
        return quantize_mxfp4(w)
