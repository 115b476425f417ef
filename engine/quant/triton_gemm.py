"""Matmuls on packed 4-bit weights (int4 with groups, MXFP4), plain and grouped by expert, as Triton kernels.

Layouts (weights are `[N, K]` as `nn.Linear.weight`, packed along K, two codes per byte):

    byte j of a row:  | high nibble: column 2j+1 | low nibble: column 2j |
    int4    w[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g]     q in 0..15, scale/zero float32 [N, K // g]
    mxfp4   w[n, k] = e2m1(code[n, k]) * 2 ** (e8m0[n, k // 32] - 127)  code bit 3 the sign, bits 0-2 the magnitude

The tiled GEMM serves all four forms: it dequantizes a `[BLOCK_K, BLOCK_N]` tile of `w.T` in registers (w is never
materialised) and accumulates `x @ w.T` in float32. The grouped forms take rows of x sorted by expert, rows
`[ends[e-1], ends[e])` times expert e (torch._grouped_mm's `offs`); each expert's rows are cut into BLOCK_M tiles
of their own, mapped with torch ops (no host sync), so a tile never mixes experts:

    rows   | 0  1  2  3 | 4  | 5  6 | 7 ...     ends = [5, 5, 7], BLOCK_M = 4: e0 rows 0-4, e1 none, e2 rows 5-6
    tiles  |   t0: e0   |t1:e0| t2:e2| t3 ...   t3 on: expert E (unused), exit at once; rows past ends[-1] stay 0

On CUDA the public functions run the kernels; on CPU they run the torch references below unless the Triton
interpreter is on (`TRITON_INTERPRET=1`, how the tests run them). As in engine/moe/triton_moe.py the kernel is
jitted on first use and `UPCAST` exists because the interpreter's bf16 `tl.dot` returns garbage.
A plain matmul of at most GEMV_MAX_ROWS rows (decode at small batch) takes a GEMV kernel instead: it reads each
weight row along K once (no tile of w.T read across rows, no tl.dot over 15 padded rows) and splits K across
programs so that one row still fills the GPU; the splits' partial sums are added in a fixed order.
Where BLOCK_K divides the group size (int4 groups of 32/64/128, MXFP4's 32) a tile loads one scale (and zero) per
column, not one per weight. On CUDA, BLOCK_N, BLOCK_K, warps and stages are autotuned per (rows bucket, N, K) from
`CUDA_TILES` (BLOCK_M stays the caller's: the grouped forms cut tiles on the host with it). Measured on an H200
before both (benchmarks/gpu_kernels.py, 4096x4096, one row): int4 613 us and MXFP4 105 us against 28 us in bf16.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from engine.quant.packed import MX_BLOCK, IntWeight, Mxfp4Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency
    triton = None
    tl = None


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int


DEFAULT_TILES = TileConfig(16, 64, 64)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int


GEMV_MAX_ROWS = 4           # x with at most this many rows (decode at small batch) takes the GEMV kernel
GEMV_MAX_SPLIT = 16         # its K splits: the partial sums' slots, one per split
DEFAULT_GEMV = GemvConfig(32, 128, 4)


class ExpertTiles(NamedTuple):
    tile_expert: torch.Tensor   # [tiles] int32, expert of each BLOCK_M row tile, E for unused tiles
    tile_row: torch.Tensor      # [tiles] int32, first row of the tile


def triton_available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _interpreting())


# ---------------------------------------------------------------------------------------------------- layouts

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`[..., K]` integers 0..15 -> `[..., K // 2]` uint8, column 2j in the low nibble of byte j."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: K must be even, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`[..., K // 2]` uint8 -> `[..., K]` int32 codes 0..15 (inverse of `pack_int4`)."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)                      # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2).int()


# -------------------------------------------------------------------------------------------- torch references

def int4_dequantize(qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 `[N, K]`."""
    return IntWeight(unpack_int4(qpacked), scale, zero, group_size, bits=4).dequantize()


def int4_matmul_ref(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    return (x.float() @ int4_dequantize(qpacked, scale, zero, group_size).T).to(x.dtype)


def mxfp4_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # NOTE: Mxfp4Weight.dequantize builds its code table on the CPU, so it dequantizes there.
    w = Mxfp4Weight(blocks.cpu(), scales.cpu()).dequantize().to(x.device)         # [N, K]
    return (x.float() @ w.T).to(x.dtype)


def _grouped_ref(x: torch.Tensor, ends: torch.Tensor, n: int, expert_matmul) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], n)                                               # [P, N]
    start = 0
    for expert, end in enumerate(ends.tolist()):                                   # host sync: reference only
        out[start:end] = expert_matmul(x[start:end], expert)
        start = end
    return out


def int4_grouped_matmul_ref(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                            group_size: int, expert_ends: torch.Tensor) -> torch.Tensor:
    return _grouped_ref(x, expert_ends, qpacked.shape[1], lambda xs, e: int4_matmul_ref(
        xs, qpacked[e], scale[e], zero[e], group_size))


def mxfp4_grouped_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                             expert_ends: torch.Tensor) -> torch.Tensor:
    return _grouped_ref(x, expert_ends, blocks.shape[1], lambda xs, e: mxfp4_matmul_ref(xs, blocks[e], scales[e]))


# ------------------------------------------------------------------------------------------------------ kernel

def _e2m1_py(code):
    """float32 value of 4-bit e2m1 codes (int32): bit 3 the sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are
    half * 0.5 when exp == 0, else (2 + half) * 2 ** (exp - 2)."""
    exp, half = (code & 7) >> 1, code & 1
    mag = tl.where(exp == 0, half, (2 + half) * ((1 << exp) >> 1)).to(tl.float32) * 0.5
    return tl.where(code >= 8, -mag, mag)


def _e8m0_py(e8m0):
    """2 ** (e8m0 - 127) as float32 from int32 bytes.
    NOTE: byte 0 (2 ** -127) decodes to 0 here, byte 255 (NaN) to inf: both absent in real checkpoints; building
    the float from bits keeps every other scale exact."""
    return (e8m0 << 23).to(tl.float32, bitcast=True)


_e2m1, _e8m0 = _e2m1_py, _e8m0_py     # what the kernels call: set per mode by `_helpers`


@functools.lru_cache(maxsize=2)
def _jitted_helpers(interpret: bool) -> tuple:
    return triton.jit(_e2m1_py), triton.jit(_e8m0_py)


def _helpers(interpret: bool) -> None:
    """Point the kernels' helper names at functions jitted in the current mode (like the kernels, jitted on first
    use: under the interpreter a function jitted for the compiler cannot be called, and the reverse)."""
    global _e2m1, _e8m0
    _e2m1, _e8m0 = _jitted_helpers(interpret)

def _quant_matmul_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
                         rows, rows_bucket, n, k, num_experts,
                         stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                         GROUP_SIZE: tl.constexpr, MXFP4: tl.constexpr, GROUPED: tl.constexpr,
                         UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """out[rows of one tile, BLOCK_N columns] = x[rows] @ dequant(w[expert]).T, accumulated in float32.
    x, out and the last dims of w, scale, zero are contiguous; scale and zero share strides."""
    if GROUPED:
        expert = tl.load(tile_expert_ptr + tl.program_id(0))
        if expert >= num_experts:
            return
        row0 = tl.load(tile_row_ptr + tl.program_id(0))
        row_end = tl.load(ends_ptr + expert)
        expert = expert.to(tl.int64)
    else:
        expert = 0
        row0 = tl.program_id(0) * BLOCK_M
        row_end = rows
    m = row0 + tl.arange(0, BLOCK_M)                                                    # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                           # [BN]
    w_base = w_ptr + expert * stride_we + cols[None, :] * stride_wn                     # [1, BN]
    s_base = expert * stride_se + cols[None, :] * stride_sn                             # [1, BN]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)                                                 # [BK]
        a = tl.load(x_ptr + m[:, None] * stride_xm + ks[None, :],
                    mask=(m[:, None] < row_end) & (ks[None, :] < k), other=0.0)         # [BM, BK]
        w_mask = (ks[:, None] < k) & (cols[None, :] < n)                                # [BK, BN]
        byte = tl.load(w_base + ks[:, None] // 2, mask=w_mask, other=0).to(tl.int32)    # [BK, BN]
        code = (byte >> ((ks[:, None] % 2) * 4)) & 0xF
        if GROUP_SIZE % BLOCK_K == 0:       # the tile lies in one group: one scale (and zero) per column
            group = k0 // GROUP_SIZE
            s_mask = cols[None, :] < n                                                  # [1, BN]
        else:
            group = ks[:, None] // GROUP_SIZE                                           # [BK, 1]
            s_mask = w_mask
        if MXFP4:
            e8m0 = tl.load(scale_ptr + s_base + group, mask=s_mask, other=127).to(tl.int32)
            w = _e2m1(code) * _e8m0(e8m0)                                               # [BK, BN]
        else:
            scale = tl.load(scale_ptr + s_base + group, mask=s_mask, other=0.0)
            zero = tl.load(zero_ptr + s_base + group, mask=s_mask, other=0.0)
            w = (code.to(tl.float32) - zero) * scale                                    # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    tl.store(out_ptr + m[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < row_end) & (cols[None, :] < n))


def _quant_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, part_ptr, rows, n, k, stride_xm, stride_wn, stride_sn,
                       GROUP_SIZE: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """part[split, row, BLOCK_N columns] = x[row, the split's K range] @ dequant(w[those columns, same range]).T in
    float32: one program per (column block, split, row), the caller sums the splits (in a fixed order: the result
    does not depend on scheduling). Split s of SPLIT_K covers K in whole BLOCK_K tiles; a program whose split is
    past SPLIT_K (the grid is always GEMV_MAX_SPLIT wide, so every slot is written) stores zeros.

    Unlike the GEMM's `[BK, BN]` tile of w.T, this reads w row by row, `[BN, BK / 2]` bytes along K (contiguous,
    each byte once), splits each byte into its even (low nibble) and odd (high nibble) column, and reduces along K
    with the matching even and odd entries of x: no tl.dot, no padded rows."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BN]
    split, row = tl.program_id(1), tl.program_id(2).to(tl.int64)
    half = tl.arange(0, BLOCK_K // 2)                                                   # [BK/2] bytes of a tile
    per_split = ((k + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K       # whole tiles per split
    k_lo = split * per_split
    k_hi = tl.minimum(k_lo + per_split, k)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn                             # [BN, 1]
    s_rows = cols[:, None].to(tl.int64) * stride_sn                                     # [BN, 1]
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kb = k0 // 2 + half                                                             # [BK/2] byte columns
        k_ok = 2 * kb < k
        mask = (cols[:, None] < n) & k_ok[None, :]                                      # [BN, BK/2]
        byte = tl.load(w_rows + kb[None, :], mask=mask, other=0).to(tl.int32)           # [BN, BK/2]
        x_even = tl.load(x_ptr + row * stride_xm + 2 * kb, mask=k_ok, other=0.0).to(tl.float32)      # [BK/2]
        x_odd = tl.load(x_ptr + row * stride_xm + 2 * kb + 1, mask=k_ok, other=0.0).to(tl.float32)
        if GROUP_SIZE % BLOCK_K == 0:       # the tile lies in one group: one scale (and zero) per column
            group = k0 // GROUP_SIZE
            s_mask = cols[:, None] < n                                                  # [BN, 1]
        else:                               # columns 2j and 2j + 1 share a group (group sizes are even)
            group = (2 * kb[None, :]) // GROUP_SIZE                                     # [1, BK/2]
            s_mask = mask
        if MXFP4:
            scale = _e8m0(tl.load(scale_ptr + s_rows + group, mask=s_mask, other=127).to(tl.int32))
            w_even, w_odd = _e2m1(byte & 0xF) * scale, _e2m1(byte >> 4) * scale         # [BN, BK/2]
        else:
            scale = tl.load(scale_ptr + s_rows + group, mask=s_mask, other=0.0)
            zero = tl.load(zero_ptr + s_rows + group, mask=s_mask, other=0.0)
            w_even = ((byte & 0xF).to(tl.float32) - zero) * scale                       # [BN, BK/2]
            w_odd = ((byte >> 4).to(tl.float32) - zero) * scale
        # NOTE: tl.reduce with triton's combine function is tl.sum (see engine/attention/triton_kv_quant.py: the
        # interpreter cannot call tl.sum when TRITON_INTERPRET is set after triton's import)
        acc += tl.reduce(w_even * x_even[None, :] + w_odd * x_odd[None, :], 1, tl.standard._sum_combine)
    tl.store(part_ptr + (split * rows + row) * n + cols, acc, mask=cols < n)


# (BLOCK_N, BLOCK_K, warps, stages) tried on CUDA; BLOCK_K 32 keeps MXFP4 and int4-g32 on per-column scales.
CUDA_TILES = ((32, 64, 4, 4), (64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3),
              (32, 128, 4, 4), (64, 32, 4, 4), (128, 32, 4, 4), (256, 32, 8, 3))


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> tuple:
    """(the kernel with the caller's block sizes, the same autotuned over `CUDA_TILES` per rows bucket, N, K and
    group size, or None for the interpreter); `interpret` keys the cache (triton reads the environment)."""
    kernel = triton.jit(_quant_matmul_kernel)
    if interpret:
        return kernel, None
    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
               for bn, bk, w, st in CUDA_TILES]
    tuned = triton.autotune(configs, key=["rows_bucket", "n", "k", "GROUP_SIZE", "MXFP4", "GROUPED"])(
        triton.jit(_quant_matmul_kernel))
    return kernel, tuned


# (BLOCK_N, BLOCK_K, SPLIT_K, warps) of the GEMV tried on CUDA: few columns per program and K split so that one
# row's matrix-vector product still fills every SM. Few on purpose: each is a compile at the first call per shape.
GEMV_CUDA_TILES = ((32, 128, 1, 4), (32, 128, 4, 4), (32, 128, 8, 4), (32, 256, 4, 4), (64, 128, 2, 4),
                   (64, 256, 1, 8), (16, 256, 8, 2), (16, 128, 16, 2))


@functools.lru_cache(maxsize=2)
def _gemv_kernels(interpret: bool) -> tuple:
    """(the GEMV kernel with the caller's sizes, the same autotuned over `GEMV_CUDA_TILES`, or None)."""
    kernel = triton.jit(_quant_gemv_kernel)
    if interpret:
        return kernel, None
    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps)
               for bn, bk, split, warps in GEMV_CUDA_TILES]
    return kernel, triton.autotune(configs, key=["n", "k", "GROUP_SIZE", "MXFP4"])(
        triton.jit(_quant_gemv_kernel))


def _launch_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                 mxfp4: bool, config: GemvConfig | None) -> torch.Tensor:
    """x `[M <= GEMV_MAX_ROWS, K]`, w `[N, K // 2]`, scale (and zero) `[N, K // g]`: `[M, N]` in x's dtype."""
    (rows, k), n = x.shape, w.shape[0]
    x, w, scale = x.contiguous(), w.contiguous(), scale.contiguous()
    zero = scale if zero is None else zero.contiguous()                            # mxfp4: never read
    parts = torch.empty(GEMV_MAX_SPLIT, rows, n, dtype=torch.float32, device=x.device)   # every slot written
    args = (x, w, scale, zero, parts, rows, n, k, x.stride(0), w.stride(0), scale.stride(0))
    flags = dict(GROUP_SIZE=group_size, MXFP4=mxfp4)
    interpret = _interpreting()
    _helpers(interpret)
    plain, tuned = _gemv_kernels(interpret)
    if tuned is None or config is not None:
        bn, bk, split = config or DEFAULT_GEMV
        if not 1 <= split <= GEMV_MAX_SPLIT:
            raise ValueError(f"GemvConfig.split_k must be in 1..{GEMV_MAX_SPLIT}, got {split}")
        plain[(triton.cdiv(n, bn), GEMV_MAX_SPLIT, rows)](*args, **flags, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
    else:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), GEMV_MAX_SPLIT, rows)](*args, **flags)
    return parts.sum(0).to(x.dtype)


def expert_tiles(expert_ends: torch.Tensor, rows: int, block_m: int) -> ExpertTiles:
    """Cut each expert's rows into BLOCK_M tiles (see the picture); static shapes, no host sync.
    NOTE: an expert with c rows needs ceil(c / BLOCK_M) <= c / BLOCK_M + 1 tiles, so cdiv(rows, BLOCK_M) + E
    tiles always suffice."""
    ends = expert_ends.long()                                                      # [E]
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))                             # [E]
    tiles = (ends - starts + block_m - 1) // block_m                               # [E]
    tile_ends = torch.cumsum(tiles, 0)                                             # [E]
    t = torch.arange(triton.cdiv(rows, block_m) + ends.numel(), device=ends.device)  # [max tiles]
    expert = torch.searchsorted(tile_ends, t, right=True)                          # [max tiles], E when unused
    e = expert.clamp(max=ends.numel() - 1)
    row = starts[e] + (t - tile_ends[e] + tiles[e]) * block_m
    return ExpertTiles(expert.int(), row.int())


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
            ends: torch.Tensor | None, mxfp4: bool, config: TileConfig | GemvConfig | None) -> torch.Tensor:
    """x `[M, K]`, w `[E, N, K // 2]`, scale (and zero) `[E, N, K // g]`; ends None: one expert, every row. One
    expert and at most GEMV_MAX_ROWS rows (or a GemvConfig) take the GEMV kernel, the rest the tiled GEMM."""
    if ends is None and x.shape[0] and (isinstance(config, GemvConfig) or
                                        config is None and x.shape[0] <= GEMV_MAX_ROWS):
        return _launch_gemv(x, w[0], scale[0], None if zero is None else zero[0], group_size, mxfp4, config)
    bm, bn, bk = config or DEFAULT_TILES
    if config is None and ends is None and x.shape[0] > 32 and x.is_cuda:
        bm = 64                                 # many rows: taller tiles (the grouped forms keep 16, see above)
    (rows, k), (experts, n, _) = x.shape, w.shape
    x, w, scale = x.contiguous(), w.contiguous(), scale.contiguous()
    zero = scale if zero is None else zero.contiguous()                            # mxfp4: never read
    grouped = ends is not None
    if grouped:
        out = x.new_zeros(rows, n)                                                 # [P, N]; rows past ends[-1]: 0
        tiles = expert_tiles(ends, rows, bm)
        ends = ends.to(torch.int32).contiguous()
    else:
        out = x.new_empty(rows, n)                                                 # [M, N]
        ends, tiles = out, ExpertTiles(out, out)                                   # never read when not GROUPED
    if rows == 0:
        return out
    interpret = _interpreting()
    upcast = interpret or x.dtype == torch.float32
    m_tiles = tiles.tile_expert.numel() if grouped else triton.cdiv(rows, bm)
    args = (x, w, scale, zero, out, tiles.tile_expert, tiles.tile_row, ends, rows, 1 << (rows - 1).bit_length(), n,
            k, experts, x.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), out.stride(0))
    flags = dict(GROUP_SIZE=group_size, MXFP4=mxfp4, GROUPED=grouped, UPCAST=upcast, BLOCK_M=bm)
    _helpers(interpret)
    plain, tuned = _kernels(interpret)
    if tuned is None or config is not None:      # the caller's tiles (the tests pick small ones)
        plain[(m_tiles, triton.cdiv(n, bn))](*args, **flags, BLOCK_N=bn, BLOCK_K=bk)
    else:
        tuned[lambda meta: (m_tiles, triton.cdiv(n, meta["BLOCK_N"]))](*args, **flags)
    return out


# -------------------------------------------------------------------------------------------------- public API

def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group_size: int, name: str) -> None:
    """w `[E, N, K // 2]`, scale `[E, N, K // group_size]`; a clear error beats a kernel reading out of bounds."""
    k = x.shape[-1]
    if x.dim() != 2 or w.shape[-1] * 2 != k or w.dtype != torch.uint8:
        raise ValueError(f"{name}: x must be [M, K] and the packed weight uint8 [.., N, K // 2]; got x "
                         f"{list(x.shape)}, weight {list(w.shape)} {w.dtype}")
    if group_size <= 0 or k % group_size or tuple(scale.shape) != (*w.shape[:-1], k // group_size):
        raise ValueError(f"{name}: K={k} must be a multiple of group_size={group_size} and the scales "
                         f"[.., N, K // group_size]; got scales {list(scale.shape)}")


def int4_matmul(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int, config: TileConfig | GemvConfig | None = None) -> torch.Tensor:
    """x `[M, K]` (fp32/bf16/fp16) @ int4 w `[N, K]`.T -> `[M, N]` in x's dtype; qpacked `[N, K // 2]` uint8,
    scale and zero `[N, K // group_size]` float32. `config`: the GEMM's tiles or the GEMV's (None: by M)."""
    _check(x, qpacked, scale, group_size, "int4_matmul")
    if not _use_triton(x):
        return int4_matmul_ref(x, qpacked, scale, zero, group_size)
    return _launch(x, qpacked[None], scale[None], zero[None], group_size, None, False, config)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 config: TileConfig | GemvConfig | None = None) -> torch.Tensor:
    """x `[M, K]` @ MXFP4 w `[N, K]`.T -> `[M, N]` in x's dtype; blocks `[N, K // 2]`, scales `[N, K // 32]` uint8."""
    _check(x, blocks, scales, MX_BLOCK, "mxfp4_matmul")
    if not _use_triton(x):
        return mxfp4_matmul_ref(x, blocks, scales)
    return _launch(x, blocks[None], scales[None], None, MX_BLOCK, None, True, config)


def int4_grouped_matmul(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        group_size: int, expert_ends: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """x `[P, K]` sorted by expert, rows `[ends[e-1], ends[e])` times expert e's int4 weight (qpacked
    `[E, N, K // 2]`, scale/zero `[E, N, K // g]`) -> `[P, N]`; rows past `ends[-1]` are 0."""
    _check(x, qpacked, scale, group_size, "int4_grouped_matmul")
    if not _use_triton(x):
        return int4_grouped_matmul_ref(x, qpacked, scale, zero, group_size, expert_ends)
    return _launch(x, qpacked, scale, zero, group_size, expert_ends, False, config)


def mxfp4_grouped_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert_ends: torch.Tensor,
                         config: TileConfig | None = None) -> torch.Tensor:
    """x `[P, K]` sorted by expert times each expert's MXFP4 weight (blocks `[E, N, K // 2]`, scales
    `[E, N, K // 32]`) -> `[P, N]`; rows past `ends[-1]` are 0."""
    _check(x, blocks, scales, MX_BLOCK, "mxfp4_grouped_matmul")
    if not _use_triton(x):
        return mxfp4_grouped_matmul_ref(x, blocks, scales, expert_ends)
    return _launch(x, blocks, scales, None, MX_BLOCK, expert_ends, True, config)
