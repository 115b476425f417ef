"""Format-neutral quantized weights: what a checkpoint reader produces and what a quantized module is built from.

    IntWeight    w[n, k] ~= (q[n, k] - zero[n, k // g]) * scale[n, k // g]     int8 (per channel) and int4 (groups)
    Fp8Weight    w[n, k] ~= fp8[n, k] * scale[n]                               e4m3, per output channel
    Mxfp4Weight  w[n, k] ~= e2m1(nibble[n, k]) * 2 ** (e8m0[n, k // 32] - 127) OCP MX: 32-element blocks

A reader of a published format (compressed-tensors, GPTQ, AWQ, MXFP4 checkpoints) only unpacks into these; a
scheme (engine/quant/schemes) only packs these into its kernel's layout. `dequantize()` is the reference both are
tested against. Matrices are `[out_features, in_features]`, as `nn.Linear.weight` (and each expert of a stack).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MX_BLOCK = 32
# e2m1 code -> value: bit 3 is the sign, bits 0-2 index these magnitudes (OCP Microscaling spec, FP4 E2M1).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class IntWeight:
    """Integers with a scale (and zero point) per group of `group_size` input columns.

    - `q` `[n, k]` int32 holding the integer values: signed (-128..127) when `zero` is None, else unsigned
      (0 .. 2**bits - 1) with `zero` the integer zero point.
    - `scale` `[n, k // group_size]` float32; `zero` `[n, k // group_size]` int32 or None (symmetric).
    - `group_size == k`: one scale per output channel.
    - `perm` `[k]` int64 or None: GPTQ act-order. Column j of `q` multiplies input feature `perm[j]`, so
      `y = x[:, perm] @ dequantize().T`.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    bits: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % self.group_size or tuple(self.scale.shape) != (n, k // self.group_size):
            raise ValueError(f"IntWeight: scale must be [{n}, {k} // group_size={self.group_size}], got "
                             f"{list(self.scale.shape)}")
        if self.zero is not None and tuple(self.zero.shape) != tuple(self.scale.shape):
            raise ValueError(f"IntWeight: zero must match scale's shape {list(self.scale.shape)}, got "
                             f"{list(self.zero.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 `[n, k]` in `q`'s column order (apply `perm` to the input, not to this)."""
        q = self.q.float()                                                    # [n, k]
        if self.zero is not None:
            q = q - self.zero.float().repeat_interleave(self.group_size, dim=1)
        return q * self.scale.float().repeat_interleave(self.group_size, dim=1)


@dataclass(frozen=True)
class Fp8Weight:
    """`weight` `[n, k]` float8_e4m3fn and `scale` `[n]` float32 (per output channel; a per-tensor scale is
    broadcast to `[n]` by the reader)."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]


@dataclass(frozen=True)
class Mxfp4Weight:
    """`blocks` `[n, k // 2]` uint8, two e2m1 codes per byte (element 2j in the low nibble, 2j+1 in the high one);
    `scales` `[n, k // 32]` uint8 e8m0 exponents (value 2 ** (e - 127))."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        lo, hi = self.blocks & 0x0F, self.blocks >> 4                          # [n, k/2] codes each
        codes = torch.stack((lo, hi), dim=-1).reshape(n, k).long()            # [n, k]
        table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                             device=self.blocks.device)
        values = table[codes]                                                 # [n, k]
        exps = self.scales.float().repeat_interleave(MX_BLOCK, dim=1) - 127   # [n, k]
        return values * torch.exp2(exps)


QuantizedWeight = IntWeight | Fp8Weight | Mxfp4Weight


def _same(values: list, what: str) -> None:
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"concat_rows: every part must have the same {what}, got {values}")


def _concat_int(parts: list[IntWeight]) -> IntWeight:
    _same([(p.bits, p.group_size, p.zero is None, p.shape[1]) for p in parts],
          "(bits, group_size, symmetric, in_features)")
    perms = [p.perm for p in parts]
    if any((a is None) != (b is None) or (a is not None and not torch.equal(a, b)) for a, b in zip(perms, perms[1:])):
        # NOTE: GPTQ orders columns by the Hessian of the layer's INPUT, which q/k/v (and gate/up) share, so
        # real checkpoints agree; differing orders cannot share one matmul.
        raise ValueError("concat_rows: parts have different act-order perms; they cannot share one matmul")
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
    return IntWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero,
                     parts[0].group_size, parts[0].bits, parts[0].perm)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack quantized weights along the output dim (q|k|v into qkv, gate|up into gate_up), as `torch.cat(dim=0)`
    of their dequantized matrices. All parts must be the same type and layout (bits, group size, symmetry, k)."""
    if not weights:
        raise ValueError("concat_rows: needs at least one weight")
    kinds = {type(w) for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"concat_rows: parts mix types {sorted(k.__name__ for k in kinds)}")
    if len(weights) == 1:
        return weights[0]
    if isinstance(weights[0], IntWeight):
        return _concat_int(weights)
    _same([w.shape[1] for w in weights], "in_features")
    if isinstance(weights[0], Fp8Weight):
        return Fp8Weight(torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights]))
    return Mxfp4Weight(torch.cat([w.blocks for w in weights]), torch.cat([w.scales for w in weights]))
