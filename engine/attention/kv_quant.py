"""Quantized (fp8 e4m3 / int8) KV: the per-layer cache views, the write rule and the dequantizing gather, in torch.

This is the reference the Triton kernels implement. One scale per (block, KV head), separately for K and V:

    dequantized value = q.float() * scale[block, head]          QMAX = 448 (fp8 e4m3), 127 (int8)
    quant(y) = round-half-even(clamp(y, -127, 127)) as int8  |  clamp(y, -448, 448) as float8_e4m3fn

Write rule, for one call writing T rows (k or v `[T, Hkv, D]`) at (block b_t, offset o_t), per written (b, h):

    fresh     = offset 0 is among the offsets written into b in this call (a block's first write always is)
    old       = 0 if fresh else scale[b, h]
    new       = max(old, amax over the rows written into b and over head_dim of |x| / QMAX)
    slots of b not written now:   q' = quant(q.float() * (old / new)), but 0 when fresh (never stale bytes:
                                  they could be NaN) or when new == 0
    rows written now:             q  = quant(x / new), but 0 when new == 0 (+0: fp8 has a -0 byte too)
    scale[b, h] = new

When the scale does not grow, old / new == 1 and the re-quantization is exactly the identity; a decode that
appends one token therefore re-quantizes only its own block's other slots, and only when that block's amax grows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
QUANTIZED_DTYPES = tuple(QMAX)


class QuantizedLayerKV(NamedTuple):
    """One layer's view of a quantized paged cache (all strided views of the cache's one uint8 tensor)."""

    k: torch.Tensor          # [num_blocks, block_size, Hkv, D] float8_e4m3fn or int8
    v: torch.Tensor          # [num_blocks, block_size, Hkv, D]
    k_scale: torch.Tensor    # [num_blocks, Hkv] float32
    v_scale: torch.Tensor    # [num_blocks, Hkv] float32


class WritePlan(NamedTuple):
    """Which blocks one call writes: the same for K and V and for every layer of a step (made once per step)."""

    blocks: torch.Tensor     # [T] block id of each written row
    offsets: torch.Tensor    # [T] its offset in that block
    unique: torch.Tensor     # [U] distinct block ids written
    inverse: torch.Tensor    # [T] index into `unique` of each written row
    fresh: torch.Tensor      # [U] bool: offset 0 of the block is written in this call


def is_quantized(cache: object) -> bool:
    return isinstance(cache, QuantizedLayerKV)


def quantize(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`y` float32, already divided by its scale, to `dtype` (saturating)."""
    qmax = QMAX[dtype]
    clamped = y.clamp(-qmax, qmax)
    return clamped.round().to(dtype) if dtype == torch.int8 else clamped.to(dtype)


def write_plan(blocks: torch.Tensor, offsets: torch.Tensor) -> WritePlan:
    """The plan for writing rows at (`blocks[t]`, `offsets[t]`), `[T]` each."""
    unique, inverse = torch.unique(blocks, return_inverse=True)                           # [U], [T]
    starts = torch.zeros(unique.shape[0], dtype=torch.int32, device=blocks.device)
    starts.index_add_(0, inverse, (offsets == 0).to(torch.int32))
    return WritePlan(blocks, offsets, unique, inverse, starts > 0)


def write(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, plan: WritePlan) -> torch.Tensor:
    """Write rows `x [T, Hkv, D]` into one layer's K (or V) `cache [nb, bs, Hkv, D]` with `scale [nb, Hkv]`.
    Returns the ids `[P]` of the blocks whose other slots were re-quantized or zeroed (fresh, or scale grown)."""
    dtype, hkv = cache.dtype, x.shape[1]
    raw = cache.view(torch.uint8)     # NOTE: copies move bytes: CPU torch has no index_copy_ etc. for float8
    rows = x.float()                                                                      # [T, Hkv, D]
    amax = torch.zeros(plan.unique.shape[0], hkv, dtype=torch.float32, device=x.device)
    per_row = rows.abs().amax(-1)                                                         # [T, Hkv]
    amax.scatter_reduce_(0, plan.inverse[:, None].expand_as(per_row), per_row, "amax")    # [U, Hkv]
    old = scale.index_select(0, plan.unique).masked_fill(plan.fresh[:, None], 0.0)      # [U, Hkv]
    new = torch.maximum(old, amax / QMAX[dtype])                                          # [U, Hkv]
    requantized = _requantize(raw, dtype, plan, old, new)
    grown = new > 0
    divisor = torch.where(grown, new, 1.0).index_select(0, plan.inverse)                  # [T, Hkv]
    scaled = (rows / divisor[:, :, None]).masked_fill(~grown.index_select(0, plan.inverse)[:, :, None], 0.0)
    raw[plan.blocks, plan.offsets] = quantize(scaled, dtype).view(torch.uint8)
    scale.index_copy_(0, plan.unique, new)
    return requantized


def _requantize(raw: torch.Tensor, dtype: torch.dtype, plan: WritePlan, old: torch.Tensor,
                new: torch.Tensor) -> torch.Tensor:
    """Re-quantize the slots of the written blocks from scale `old` to `new` (`[U, Hkv]`); zero a fresh block's.

    Only blocks that are fresh or whose scale grows are touched: for the others old / new == 1 and the rule is
    exactly the identity, which is what skipping them gives (a decode step usually skips every block; this host
    check is the price, and the reason a steady decode costs one row write per layer)."""
    # NOTE: a fresh block this call writes whole (a prefill's full blocks) keeps no slot: skipping it gives the
    # same bytes, and a long prefill then re-quantizes at most its last block instead of all of them
    written = torch.bincount(plan.inverse, minlength=plan.unique.shape[0])                # [U] rows per block
    whole = plan.fresh & (written == raw.shape[1])                                        # [U]
    changed = (plan.fresh & ~whole)[:, None] | (~plan.fresh[:, None] & (new != old))      # [U, Hkv]
    picked = changed.any(1).nonzero().flatten()                                           # [P]
    if picked.numel() == 0:
        return picked
    blocks, old, new = plan.unique[picked], old[picked], new[picked]
    fresh, grown = plan.fresh[picked], new > 0                                            # [P], [P, Hkv]
    ratio = old / torch.where(grown, new, 1.0)                                            # [P, Hkv]
    kept = raw.index_select(0, blocks).view(dtype).float() * ratio[:, None, :, None]      # [P, bs, Hkv, D]
    # NOTE: explicit zeros for a fresh block (its stale bytes may be NaN, and NaN * 0 is NaN) and for scale 0
    kept = kept.masked_fill(~(grown & ~fresh[:, None])[:, None, :, None], 0.0)
    raw.index_copy_(0, blocks, quantize(kept, dtype).view(torch.uint8))
    return blocks


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: QuantizedLayerKV, plan: WritePlan) -> torch.Tensor:
    """`write` for K and V; returns the ids of the blocks whose older slots changed (in K or V)."""
    changed_k = write(k, cache.k, cache.k_scale, plan)
    changed_v = write(v, cache.v, cache.v_scale, plan)
    if changed_v.numel() == 0:
        return changed_k
    return changed_v if changed_k.numel() == 0 else torch.unique(torch.cat((changed_k, changed_v)))


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values [n, bs, Hkv, D]` with their blocks' `scales [n, Hkv]` as `dtype` (float32 arithmetic)."""
    return (values.float() * scales[:, None, :, None]).to(dtype)


def gather_rows(values: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The slots (`blocks [n]`, `offsets [n]`) of one layer's K (or V), dequantized: `[n, Hkv, D]` in `dtype`."""
    picked = values.view(torch.uint8)[blocks, offsets].view(values.dtype)                # [n, Hkv, D]
    return (picked.float() * scales.index_select(0, blocks)[:, :, None]).to(dtype)


def gather(values: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `block_ids [n]` of one layer's K (or V), dequantized: `[n, bs, Hkv, D]` in `dtype`."""
    picked = values.view(torch.uint8).index_select(0, block_ids).view(values.dtype)       # [n, bs, Hkv, D]
    return dequantize(picked, scales.index_select(0, block_ids), dtype)
