"""Quantized paged KV cache on CUDA: a Triton write kernel and a Triton decode-attention kernel, with torch references.

Per layer the cache is `k_q, v_q [num_blocks, block_size, kv_heads, head_dim]` (float8_e4m3fn or int8; strided
views into one uint8 buffer, so every kernel takes strides) and `k_scale, v_scale [num_blocks, kv_heads]` float32;
a value is `q * scale[block, head]`. QMAX is 448 (e4m3) or 127 (int8).

Write rule, per written (block b, head h), over the rows of this call that land in b:

    fresh      = offset 0 is among them (the block starts over: its other slots become 0)
    old_scale  = 0 if fresh else scale[b, h]
    new_scale  = max(old_scale, max |new| / QMAX)          all-zero data keeps scale 0 and stores +0
    slots      | kept: quant(q * (old_scale / new_scale)) | written: quant(x / new_scale) | kept ... |

with quant = clamp to [-QMAX, QMAX], then round half to even (int8) or to the nearest-even e4m3. A scale only
grows while a block fills, so earlier rows lose at most the precision of the largest one.

The write kernel runs one program per (run of rows into one block, head). A run is found with torch ops (no host
sync, so a CUDA graph can hold it): rows into one block are consecutive in the batch and their offsets are
consecutive (a sequence's new tokens sit at consecutive positions), so a run is (first row, row count).

The decode kernel runs one program per (sequence, kv head): the head's GQA group of queries against the
sequence's blocks, K and V cast from their codes and scaled per block, online softmax in float32.

    keys of query p = ctx - 1:  | 0 ... ctx-1-w | ctx-w ... ctx-1 |      (window w; none: all of 0 ... ctx-1)
                                |    hidden     |     visible     |

As in engine/moe/triton_moe.py the kernels are jitted on first use (tests switch the interpreter on per test) and
call only core `tl` builtins; `UPCAST` exists because the interpreter's bf16 `tl.dot` returns garbage.
NOTE: the e4m3 encoding is done with integer and float ops, not `.to(tl.float8e4nv)`: triton 3.9's interpreter
casts 1.0625 to 1.125 (ties not to even), 1.95 to 1.0 (a lost mantissa carry) and 0.001 to 0 (no subnormals), and
one encoding everywhere keeps the GPU's bytes the ones the CPU tests check.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency
    triton = None
    tl = None

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


class WriteRuns(NamedTuple):
    first_row: torch.Tensor   # [T] int32, first batch row of each run (T for unused entries)
    count: torch.Tensor       # [T] int32, rows in the run; 0 past the last run


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _interpreting())


def _qmax(dtype: torch.dtype) -> float:
    if dtype not in QMAX:
        raise ValueError(f"quantized KV cache dtype must be float8_e4m3fn or int8, got {dtype}")
    return QMAX[dtype]


def _next_pow2(n: int, least: int = 16) -> int:
    """tl.arange needs powers of two and tl.dot at least 16 along every dimension."""
    return max(least, triton.next_power_of_2(n))


# -------------------------------------------------------------------------------------------- torch references

def quantize_ref(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 already divided by the scale -> codes: clamp, then round half to even (int8) or cast (e4m3)."""
    qmax = _qmax(dtype)
    clamped = values.clamp(-qmax, qmax)
    return clamped.to(dtype) if dtype == torch.float8_e4m3fn else torch.round(clamped).to(dtype)


def write_quantized_kv_ref(cache_q: torch.Tensor, cache_scale: torch.Tensor, new: torch.Tensor,
                           block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """The write rule (module docstring), one block at a time. cache_q `[NB, BS, H, D]`, cache_scale `[NB, H]`,
    new `[T, H, D]`, block_ids / offsets `[T]`."""
    qmax = _qmax(cache_q.dtype)
    for block in dict.fromkeys(block_ids.tolist()):                                 # host sync: reference only
        rows = (block_ids == block).nonzero().flatten()
        offs = offsets[rows].long()
        x = new[rows].float()                                                      # [n, H, D]
        fresh = bool((offs == 0).any())
        old_scale = torch.zeros_like(cache_scale[block]) if fresh else cache_scale[block].clone()   # [H]
        new_scale = torch.maximum(old_scale, x.abs().amax(dim=(0, 2)) / qmax)                      # [H]
        safe = torch.where(new_scale > 0, new_scale, torch.ones_like(new_scale))
        if fresh:
            values = torch.zeros(cache_q.shape[1:], dtype=torch.float32, device=x.device)          # [BS, H, D]
        else:
            values = cache_q[block].float() * (old_scale / safe)[None, :, None]                    # [BS, H, D]
        values[offs] = x / safe[None, :, None]
        values = values.masked_fill((new_scale == 0)[None, :, None], 0.0)                          # +0, not -0
        cache_q[block] = quantize_ref(values, cache_q.dtype)
        cache_scale[block] = new_scale


def dequantize_blocks(cache_q: torch.Tensor, cache_scale: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`[n, BS, H, D]` float32 of the given blocks."""
    return cache_q[blocks].float() * cache_scale[blocks].float()[:, None, :, None]


def paged_decode_attention_quant_ref(q: torch.Tensor, k_q: torch.Tensor, v_q: torch.Tensor, k_scale: torch.Tensor,
                                     v_scale: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     sm_scale: float, window: int | None = None) -> torch.Tensor:
    """Dequantize each sequence's blocks, gather its keys, softmax attention in float32: `[B, Hq, D]` in q's dtype."""
    out = torch.zeros_like(q)
    group, block_size = q.shape[1] // k_q.shape[2], k_q.shape[1]
    for b, ctx in enumerate(context_lens.tolist()):                                 # host sync: reference only
        if ctx == 0:
            continue
        blocks = block_tables[b, :-(-ctx // block_size)].long()
        lo = max(ctx - window, 0) if window else 0
        k = dequantize_blocks(k_q, k_scale, blocks).flatten(0, 1)[lo:ctx]          # [n, Hkv, D]
        v = dequantize_blocks(v_q, v_scale, blocks).flatten(0, 1)[lo:ctx]          # [n, Hkv, D]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [n, Hq, D]
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale            # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------------- kernels
# NOTE: tl.max / tl.sum / tl.cdiv are @triton.jit helpers, jitted for the GPU when triton was imported, which the
# interpreter refuses to call when TRITON_INTERPRET is set later (as tests do). tl.reduce is a builtin the
# interpreter patches, and with triton's own combine functions it takes its numpy fast path; on the GPU this is
# exactly what tl.max and tl.sum compile to. (Private names of triton 3.x: a version bump that renames them fails
# the interpreter tests at once.)

def _write_kernel(cache_ptr, scale_ptr, new_ptr, block_ids_ptr, offsets_ptr, first_row_ptr, count_ptr, head_dim,
                  stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_sh, stride_nt, stride_nh, stride_nd,
                  BLOCK_SIZE: tl.constexpr, BS_P2: tl.constexpr, D_P2: tl.constexpr, QMAX: tl.constexpr,
                  FP8: tl.constexpr):
    """The write rule for one (run of rows into one block, head): the whole block is rewritten."""
    run, h = tl.program_id(0), tl.program_id(1)
    count = tl.load(count_ptr + run)
    if count == 0:
        return
    row0 = tl.load(first_row_ptr + run)
    block = tl.load(block_ids_ptr + row0).to(tl.int64)
    off0 = tl.load(offsets_ptr + row0).to(tl.int32)
    slots, dims = tl.arange(0, BS_P2), tl.arange(0, D_P2)
    in_block = (slots < BLOCK_SIZE)[:, None] & (dims < head_dim)[None, :]                 # [BS, D]
    is_new = (slots >= off0) & (slots < off0 + count)                                      # [BS]
    written = is_new[:, None] & in_block                                                  # [BS, D]
    x = tl.load(new_ptr + (row0 + slots - off0)[:, None] * stride_nt + h * stride_nh + dims[None, :] * stride_nd,
                mask=written, other=0.0).to(tl.float32)                                  # [BS, D] by slot
    fresh = off0 == 0
    scale_at = scale_ptr + block * stride_sb + h * stride_sh
    old_scale = tl.where(fresh, 0.0, tl.load(scale_at))
    # NOTE: div_rn, not `/`: on the GPU `/` is an approximate division, and the bytes must match the reference.
    amax = tl.reduce(tl.abs(x), None, tl.standard._elementwise_max)
    new_scale = tl.maximum(old_scale, tl.math.div_rn(amax, QMAX))
    safe = tl.where(new_scale > 0, new_scale, 1.0)
    cache = (cache_ptr + block * stride_cb + slots[:, None] * stride_cs + h * stride_ch
             + dims[None, :] * stride_cd)                                                 # [BS, D] pointers
    # a fresh block's unwritten slots hold whatever an earlier owner left (even NaN codes): never read them.
    # NOTE: a slot bound, not `& ~fresh`: the interpreter turns a scalar bool broadcast into an int32 mask.
    old_end = tl.where(fresh, 0, BLOCK_SIZE)
    kept = tl.load(cache, mask=((is_new == 0) & (slots < old_end))[:, None] & in_block, other=0.0).to(tl.float32)
    values = tl.where(written, tl.math.div_rn(x, safe), kept * tl.math.div_rn(old_scale, safe))   # [BS, D]
    # scale 0: every code +0 (x / 1 and q * 0 could be -0.0, which e4m3 stores as its own byte)
    values = tl.where(new_scale > 0, tl.minimum(tl.maximum(values, -QMAX), QMAX), 0.0)
    if FP8:
        # round |v| to 3 mantissa bits: ulp = 2 ** (e - 3), e = floor(log2 |v|) but at least -6 (e4m3's
        # subnormals share the smallest normal binade's ulp, 2 ** -9); scaling by powers of two is exact
        mag = tl.abs(values)
        e = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        inv_ulp = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)
        ulp = ((127 - 3 + e) << 23).to(tl.float32, bitcast=True)
        t = mag * inv_ulp
    else:
        t = values
    # round half to even, from floor (the interpreter has no rint)
    f = tl.floor(t)
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((t - f > 0.5) | ((t - f == 0.5) & odd), f + 1.0, f)
    if FP8:
        m = r * ulp                                                                       # rounded |v|, exact
        m_bits = m.to(tl.int32, bitcast=True)
        code = tl.where(m >= 0.015625, ((((m_bits >> 23) & 0xFF) - 120) << 3) | ((m_bits >> 20) & 7),
                        (m * 512.0).to(tl.int32))                                         # normal | subnormal
        code = code | (((values.to(tl.int32, bitcast=True) >> 31) & 1) << 7)            # sign, -0 included
        tl.store(cache, code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), mask=in_block)
    else:
        tl.store(cache, r.to(tl.int8), mask=in_block)
    tl.store(scale_at, new_scale)


def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, ctx_ptr, out_ptr, sm_scale, window, group,
                   head_dim, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                   stride_tb, stride_ob, stride_oh,
                   BLOCK_SIZE: tl.constexpr, BS_P2: tl.constexpr, G_P2: tl.constexpr, D_P2: tl.constexpr,
                   WINDOWED: tl.constexpr, UPCAST: tl.constexpr):
    """out[b, heads of kv head h] = softmax(q k^T * sm_scale) v over the visible keys; q and out have a
    contiguous last dim."""
    b, h = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    lo = tl.maximum(ctx - window, 0) if WINDOWED else 0                                   # first visible key
    g, slots, dims = tl.arange(0, G_P2), tl.arange(0, BS_P2), tl.arange(0, D_P2)
    q_mask = (g < group)[:, None] & (dims < head_dim)[None, :]                           # [G, D]
    q = tl.load(q_ptr + b * stride_qb + (h * group + g)[:, None] * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)                                                   # [G, D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((G_P2,), float("-inf"), tl.float32)
    l_i = tl.full((G_P2,), 0.0, tl.float32)
    acc = tl.full((G_P2, D_P2), 0.0, tl.float32)
    # NOTE: every block in [lo // BS, cdiv(ctx, BS)) holds a visible key, so m_i is finite after the first one
    for j in range(lo // BLOCK_SIZE, (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
        pos = j * BLOCK_SIZE + slots                                                      # [BS]
        visible = (slots < BLOCK_SIZE) & (pos < ctx) & (pos >= lo)                        # [BS]
        kv_mask = visible[:, None] & (dims < head_dim)[None, :]                           # [BS, D]
        k = tl.load(k_ptr + block * stride_kb + slots[:, None] * stride_ks + h * stride_kh + dims[None, :] * stride_kd,
                    mask=kv_mask, other=0.0).to(q.dtype)                                  # [BS, D] codes
        k_scale = tl.load(ks_ptr + block * stride_ksb + h * stride_ksh)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * (k_scale * sm_scale)        # [G, BS]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))            # [G]
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])                                                    # [G, BS]
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(v_ptr + block * stride_vb + slots[:, None] * stride_vs + h * stride_vh + dims[None, :] * stride_vd,
                    mask=kv_mask, other=0.0).to(q.dtype)                                  # [BS, D] codes
        v_scale = tl.load(vs_ptr + block * stride_vsb + h * stride_vsh)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee") * v_scale
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                                      # ctx 0: zeros
    tl.store(out_ptr + b * stride_ob + (h * group + g)[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> tuple:
    """(write, decode), jitted for the interpreter or the GPU; `interpret` only keys the cache."""
    return triton.jit(_write_kernel), triton.jit(_decode_kernel)


# -------------------------------------------------------------------------------------------------- public API

def write_runs(block_ids: torch.Tensor) -> WriteRuns:
    """Runs of consecutive rows into one block, padded to T entries (count 0 past the last); no host sync.

        block_ids  | 7 7 7 | 2 | 9 9 |      -> first_row | 0 3 4 6 6 6 |, count | 3 1 2 0 0 0 |
    """
    rows = block_ids.numel()
    starts = torch.ones(rows, dtype=torch.bool, device=block_ids.device)
    starts[1:] = block_ids[1:] != block_ids[:-1]
    run_of = torch.cumsum(starts, 0) - 1                                                  # [T]
    arange = torch.arange(rows, device=block_ids.device)
    first = torch.full_like(arange, rows).scatter_reduce_(0, run_of, arange, "amin")      # [T]
    count = torch.zeros_like(arange).scatter_add_(0, run_of, torch.ones_like(arange))     # [T]
    return WriteRuns(first.int(), count.int())


def write_quantized_kv(cache_q: torch.Tensor, cache_scale: torch.Tensor, new: torch.Tensor, block_ids: torch.Tensor,
                       offsets: torch.Tensor) -> None:
    """Write `new [T, Hkv, D]` into slots (block_ids[t], offsets[t]) of `cache_q [NB, BS, Hkv, D]` under the write
    rule (module docstring), updating `cache_scale [NB, Hkv]`. Rows into one block must be consecutive in the batch
    with consecutive offsets (a sequence's new tokens)."""
    qmax = _qmax(cache_q.dtype)
    if new.dim() != 3 or new.shape[1:] != cache_q.shape[2:] or not block_ids.shape == offsets.shape == new.shape[:1]:
        raise ValueError(f"write_quantized_kv: new must be [T, {cache_q.shape[2]}, {cache_q.shape[3]}] with "
                         f"block_ids and offsets [T]; got {list(new.shape)}, {list(block_ids.shape)}, "
                         f"{list(offsets.shape)}")
    if not _use_triton(new):
        return write_quantized_kv_ref(cache_q, cache_scale, new, block_ids, offsets)
    rows, heads, dim = new.shape
    if rows == 0:
        return None
    block_ids, offsets = block_ids.contiguous(), offsets.contiguous()
    runs = write_runs(block_ids)
    _kernels(_interpreting())[0][(rows, heads)](
        cache_q, cache_scale, new, block_ids, offsets, runs.first_row, runs.count, dim,
        *cache_q.stride(), *cache_scale.stride(), *new.stride(),
        BLOCK_SIZE=cache_q.shape[1], BS_P2=_next_pow2(cache_q.shape[1], 1), D_P2=_next_pow2(dim, 1), QMAX=qmax,
        FP8=cache_q.dtype == torch.float8_e4m3fn)
    return None


def paged_decode_attention_quant(q: torch.Tensor, k_q: torch.Tensor, v_q: torch.Tensor, k_scale: torch.Tensor,
                                 v_scale: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 sm_scale: float, window: int | None = None) -> torch.Tensor:
    """One query per sequence (position context_lens[b] - 1) over its quantized paged K/V: q `[B, Hq, D]`,
    block_tables `[B, W]` int32, context_lens `[B]` int32 -> `[B, Hq, D]` in q's dtype."""
    _qmax(k_q.dtype)
    (batch, q_heads, dim), (_, block_size, kv_heads, _) = q.shape, k_q.shape
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    if window is not None and window < 1:
        raise ValueError(f"window must be None (full attention) or at least 1, got {window}")
    if not _use_triton(q):
        return paged_decode_attention_quant_ref(q, k_q, v_q, k_scale, v_scale, block_tables, context_lens,
                                                sm_scale, window)
    if batch == 0:
        return q.clone()
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)                      # [B, Hq, D]
    group = q_heads // kv_heads
    _kernels(_interpreting())[1][(batch, kv_heads)](
        q, k_q, v_q, k_scale, v_scale, block_tables, context_lens, out, sm_scale, window or 0, group, dim,
        q.stride(0), q.stride(1), *k_q.stride(), *v_q.stride(), *k_scale.stride(), *v_scale.stride(),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, BS_P2=_next_pow2(block_size), G_P2=_next_pow2(group), D_P2=_next_pow2(dim),
        WINDOWED=bool(window), UPCAST=_interpreting() or q.dtype == torch.float32)
    return out
