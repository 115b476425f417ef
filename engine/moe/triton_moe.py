"""Fused MoE on CUDA: two Triton kernels over expert-sorted (token, expert) pairs, no host sync.

    align_pairs:  pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M (pad id = P), and the
                  expert of every BLOCK_M block (E for blocks past the end): torch ops, static shapes.
    gate_up:      per (block, BLOCK_N columns of I): x rows of the block's pairs times the expert's gate and up
                  rows, silu(gate) * up fused in the epilogue -> act [P, I]
    down:         per (block, BLOCK_N columns of H): act rows times the expert's down rows, times the routing
                  weight -> out [P, H] in float32; the k pairs of each token are summed after (no atomics, so the
                  result does not depend on the launch order)

    sorted pairs  |e0 e0 e0 pad|e1 pad pad pad|e3 e3 e3 e3|e3 pad pad pad|  (BLOCK_M = 4; e2 has no pair)
    block_expert  |     0      |      1      |     3     |      3       | E E ...  (unused blocks exit at once)

The kernels are written for this project in the spirit of vLLM's fused_moe (grouped GEMM over sorted tokens).
`LocalMoE` picks them on CUDA. Tests run them on CPU under the Triton interpreter (`TRITON_INTERPRET=1`), which is
why the kernels are jitted on first use rather than at import (the test sets the variable after import), why they
call only core `tl` builtins (`tl.full`, not `tl.zeros`; no `tl.sigmoid`: those helpers are `@triton.jit` functions,
jitted for the GPU when triton was imported, which the interpreter then refuses to call), and why `UPCAST` exists:
the interpreter's `tl.dot` on bf16 operands returns garbage, so there both sides go to float32.
NOTE: block sizes are not tuned on a GPU yet (none was lent while this was written).
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


class AlignedPairs(NamedTuple):
    pair_ids: torch.Tensor       # [blocks * BLOCK_M] int64, pair index (token * k + rank) or P for padding
    block_expert: torch.Tensor   # [blocks] int64, the expert of each block, E past the last used block


class BlockConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int


def triton_available() -> bool:
    return triton is not None


def default_config(num_pairs: int, num_experts: int) -> BlockConfig:
    """Small M blocks while an expert sees few rows (decode), larger ones once they fill."""
    return BlockConfig(16, 64, 64) if num_pairs <= 4 * num_experts else BlockConfig(64, 64, 32)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Sort the T*k pairs by expert and pad every expert's run to a multiple of `block_m` (see the picture)."""
    ids = topk_ids.reshape(-1)                                                     # [P]
    num_pairs = ids.numel()
    order = torch.argsort(ids, stable=True)                                        # [P]
    expert_of = ids[order]                                                         # [P] sorted
    experts = torch.arange(num_experts, device=ids.device)                         # [E]
    starts = torch.searchsorted(expert_of, experts)                                # [E]
    counts = torch.searchsorted(expert_of, experts, right=True) - starts           # [E]
    padded = (counts + block_m - 1) // block_m * block_m                           # [E]
    padded_ends = torch.cumsum(padded, 0)                                          # [E]
    rank = torch.arange(num_pairs, device=ids.device) - starts[expert_of]          # [P] row within its expert
    position = padded_ends[expert_of] - padded[expert_of] + rank                   # [P] padded slot
    # NOTE: every expert adds at most block_m - 1 padding rows, so this many blocks always suffice.
    blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int64, device=ids.device)
    pair_ids.index_copy_(0, position, order)
    block_start = torch.arange(blocks, device=ids.device) * block_m                # [blocks]
    return AlignedPairs(pair_ids, torch.searchsorted(padded_ends, block_start, right=True))


def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, pair_ids_ptr, block_expert_ptr,
                    num_pairs, top_k, hidden, inter, num_experts,
                    stride_xt, stride_we, stride_wn, stride_wk, stride_at,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for one block of pairs."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pair = tl.load(pair_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))   # [BM]
    valid = pair < num_pairs
    token = pair // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                             # [BN] in [0, I)
    w_base = w13_ptr + expert * stride_we
    gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)                                                   # [BK]
        a = tl.load(x_ptr + token[:, None] * stride_xt + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < hidden), other=0.0)              # [BM, BK]
        w_mask = (ks[:, None] < hidden) & (cols[None, :] < inter)
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter) * stride_wn + ks[:, None] * stride_wk, mask=w_mask,
                       other=0.0)                                                         # [BK, BN] each
        if UPCAST:
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        gate = tl.dot(a, w_gate, gate, input_precision="ieee")
        up = tl.dot(a, w_up, up, input_precision="ieee")
    act = gate / (1.0 + tl.exp(-gate)) * up                                               # [BM, BN]
    tl.store(act_ptr + pair[:, None] * stride_at + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < inter))


def _down_kernel(act_ptr, w2_ptr, weight_ptr, out_ptr, pair_ids_ptr, block_expert_ptr,
                 num_pairs, hidden, inter, num_experts,
                 stride_at, stride_we, stride_wn, stride_wk, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """out[pair, n] = weight[pair] * (act[pair] . w2[e, n]) for one block of pairs, in float32."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pair = tl.load(pair_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))   # [BM]
    valid = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                             # [BN] in [0, H)
    w_base = w2_ptr + expert * stride_we
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)                                                   # [BK]
        a = tl.load(act_ptr + pair[:, None] * stride_at + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < inter), other=0.0)               # [BM, BK]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(ks[:, None] < inter) & (cols[None, :] < hidden), other=0.0)     # [BK, BN]
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    weight = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)             # [BM]
    tl.store(out_ptr + pair[:, None] * stride_ot + cols[None, :], acc * weight[:, None],
             mask=valid[:, None] & (cols[None, :] < hidden))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> tuple:
    """(gate_up, down), jitted for the interpreter or the GPU; `interpret` only keys the cache (triton reads the
    environment when jitting)."""
    return triton.jit(_gate_up_kernel), triton.jit(_down_kernel)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, config: BlockConfig | None = None) -> torch.Tensor:
    """The MoEBackend computation (`[T, H]` in x's dtype) with the two kernels above."""
    if triton is None:
        raise RuntimeError("the triton MoE path needs the `triton` package (Linux)")
    (tokens, k), (experts, _, hidden), inter = topk_ids.shape, w13.shape, w2.shape[2]
    num_pairs = tokens * k
    config = config or default_config(num_pairs, experts)
    x = x.contiguous()
    weights = topk_weights.reshape(-1).contiguous()                                # [P]
    aligned = align_pairs(topk_ids, experts, config.block_m)
    blocks = aligned.block_expert.numel()
    act = x.new_empty(num_pairs, inter)                                            # [P, I]
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)     # [P, H]
    gate_up, down = _kernels(_interpreting())
    upcast = _interpreting() or x.dtype == torch.float32
    gate_up[(blocks, triton.cdiv(inter, config.block_n))](
        x, w13, act, aligned.pair_ids, aligned.block_expert, num_pairs, k, hidden, inter, experts,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST=upcast)
    down[(blocks, triton.cdiv(hidden, config.block_n))](
        act, w2, weights, out, aligned.pair_ids, aligned.block_expert, num_pairs, hidden, inter, experts,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, UPCAST=upcast)
    return out.view(tokens, k, hidden).sum(dim=1).to(x.dtype)                      # [T, H]


@torch.library.custom_op("strata::fused_moe_triton", mutates_args=())
def fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """`fused_moe_triton` as one opaque op, so a compiled (and CUDA-graphed) decode step traces through it."""
    return fused_moe_triton(x, w13, w2, topk_ids, topk_weights)


@fused_moe_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
      topk_weights: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
