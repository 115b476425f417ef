"""Byte codes -> floats on CPU by one table lookup per PAIR of elements (MXFP4 and FP8 weights).

CPU has no fp4 matmul kernel, and its fp8 ones (`torch._scaled_mm`, `.to(float)`) are scalar loops: 3072 x 1024
e4m3 -> float32 takes 9 ms, `_scaled_mm` 14-23 ms (1 thread). A gather from a table is ~1 ms:

    mxfp4   index = e8m0 scale * 256 + byte        byte = codes of elements 2j (low nibble), 2j+1 (high)
            table[index] = (e2m1(lo) * 2**(s-127), e2m1(hi) * 2**(s-127))     (the block's scale folded in)
    fp8     index = the two bytes of elements 2j, 2j+1 read as one uint16
            table[index] = (e4m3(low byte), e4m3(high byte))

Each table (65536 pairs: 512 KB in float32) is stored with a value pair viewed as one int64 (int32 for 16-bit
dtypes), so a single `index_select` writes both values. Measured, a 3072 x 1024 weight on 1 thread: mxfp4 1.0 ms
fp32 and 0.9 ms bf16, vs 4.5-24 ms for a float-indexed lookup plus a scale multiply and 2.2 ms for Inductor's
code of the same gather; hence the lookups are custom ops, opaque to the compiler. Every value is exact in any
activation dtype that can hold it (e2m1 and e4m3 have 1 and 3 mantissa bits).
"""
from __future__ import annotations

import torch

from engine.quant.packed import E2M1_VALUES, MX_BLOCK

_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
_PAIR_INT = {4: torch.int64, 2: torch.int32}      # element size -> the int that holds two values


def _pairs(values: torch.Tensor) -> torch.Tensor:
    """`[256]` values per byte -> `[65536, 2]` (value of the low byte, value of the high byte)."""
    return torch.stack((values.repeat(256), values.repeat_interleave(256)), dim=-1)


def _mx_values() -> torch.Tensor:
    e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)   # [16]
    pair = torch.stack((e2m1.repeat(16), e2m1.repeat_interleave(16)), dim=-1)            # [256, 2] lo, hi
    scale = torch.exp2(torch.arange(256, dtype=torch.float64) - 127)                      # [256]
    return (scale[:, None, None] * pair[None]).reshape(256 * 256, 2)                     # [65536, 2]


def _fp8_values() -> torch.Tensor:
    return _pairs(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double())   # [65536, 2]


def dequant_table(kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[65536, 2]` values in `dtype` for `kind` "mxfp4" or "fp8" (built once, shared by every module)."""
    key = (kind, dtype, torch.device(device))
    if key not in _TABLES:
        values = _mx_values() if kind == "mxfp4" else _fp8_values()
        _TABLES[key] = values.to(dtype).to(device)
    return _TABLES[key]


def _lookup(index: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    pairs = table.view(_PAIR_INT[table.element_size()]).view(-1)                             # [65536]
    return pairs.index_select(0, index.reshape(-1)).view(table.dtype).view(n, -1)            # [n, k]


@torch.library.custom_op("strata::mxfp4_dequant", mutates_args=())
def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """blocks `[n, k / 2]` uint8, scales `[n, k / 32]` uint8, the "mxfp4" table -> `[n, k]` in its dtype."""
    n = blocks.shape[0]
    index = (scales.to(torch.int32) * 256).view(n, -1, 1) + blocks.view(n, -1, MX_BLOCK // 2)   # [n, k/32, 16]
    return _lookup(index, table, n)


@mxfp4_dequant.register_fake
def _(blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return blocks.new_empty(blocks.shape[0], 2 * blocks.shape[1], dtype=table.dtype)


@torch.library.custom_op("strata::fp8_dequant", mutates_args=())
def fp8_dequant(weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """weight `[n, k]` float8_e4m3fn (k even, contiguous), the "fp8" table -> `[n, k]` in its dtype (unscaled)."""
    n = weight.shape[0]
    index = weight.view(torch.uint8).view(torch.uint16).to(torch.int32)                      # [n, k/2]
    return _lookup(index, table, n)


@fp8_dequant.register_fake
def _(weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(weight.shape, dtype=table.dtype)
