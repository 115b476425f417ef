"""The ways `LocalMoE` can run a batch through its experts (its "paths"); `plan.py` picks one per shape.

Every path takes x `[T, H]`, stacked w13 `[E, 2I, H]` (gate rows then up rows) and w2 `[E, H, I]`, topk_ids
`[T, k]` int64 and topk_weights `[T, k]` in x's dtype, and returns `[T, H]` in x's dtype: for every token the sum
over its k experts of `weight * down(silu(gate(x)) * up(x))`.

    path      host sync   shapes           work per layer
    loop      yes         data-dependent   one F.linear pair per active expert (the baseline; eager only)
    dense     no          static           every token through every expert (E/k x the FLOPs), others weighted 0
    gather    no          static           each (token, expert) pair indexes its expert's weights and runs a
                                           matrix-vector product; eager copies the slices, Inductor fuses the
                                           index into its reduction and reads each slice once per pair
    grouped   no          static           pairs sorted by expert, one grouped GEMM (torch._grouped_mm) per
                                           projection: every active expert's weights read once
    padded    no          static           pairs scattered into `[E, T, H]` slots (capacity T), one bmm per
                                           projection (dense's FLOPs plus the scatter; needs distinct ids per row)
    cpu       no          static           Strata's C++ kernel (engine/cpu_kernels): pairs sorted by expert, each
                                           expert's weights read once against all its rows, fp32 accumulation

The Triton kernel for CUDA lives in `triton_moe.py`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from engine import cpu_kernels

MoEPathFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[..., 2I]` (gate then up) -> `[..., I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _expert(w13: torch.Tensor, w2: torch.Tensor, expert: int, xs: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul(F.linear(xs, w13[expert])), w2[expert])          # [n, H]


def loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
         topk_weights: torch.Tensor) -> torch.Tensor:
    """The per-expert Python loop Strata ran before the fused paths; kept as the baseline and as the oracle."""
    if topk_ids.shape[0] == 1:
        # NOTE: one token: its k experts in rank order, no sort/count/scatter.
        weights = topk_weights.view(-1)                                            # [k]
        out = None
        for rank, expert in enumerate(topk_ids.view(-1).tolist()):                # host sync
            part = _expert(w13, w2, expert, x).mul_(weights[rank])                 # [1, H]
            out = part if out is None else out.add_(part)
        return out
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)                                                     # [P]
    order = torch.argsort(ids, stable=True)                                        # [P] pairs grouped by expert
    counts = torch.bincount(ids, minlength=w13.shape[0]).tolist()                 # host sync
    token_of = order // k                                                          # [P]
    xs = x[token_of]                                                               # [P, H]
    out = torch.empty_like(xs)                                                     # [P, H]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[start:start + count] = _expert(w13, w2, expert, xs[start:start + count])
            start += count
    out = out * topk_weights.reshape(-1)[order].unsqueeze(-1)                      # [P, H]
    return torch.zeros_like(x).index_add_(0, token_of, out)                        # [T, H]


def dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
          topk_weights: torch.Tensor) -> torch.Tensor:
    """Every token through every expert: one GEMM up, one bmm down; experts a token did not pick weigh 0."""
    tokens, (experts, two_i, hidden) = x.shape[0], w13.shape
    gate_up = F.linear(x, w13.reshape(experts * two_i, hidden)).view(tokens, experts, two_i)  # [T, E, 2I]
    gates = x.new_zeros(tokens, experts).scatter_add_(1, topk_ids, topk_weights)              # [T, E]
    act = silu_and_mul(gate_up) * gates.unsqueeze(-1)                                         # [T, E, I]
    return torch.bmm(act.transpose(0, 1), w2.transpose(1, 2)).sum(0)                         # [E, T, H] -> [T, H]


def gather(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> torch.Tensor:
    """Each pair's expert weights indexed, then batched matrix-vector products (fused by Inductor)."""
    tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1)                                                     # [P]
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)                               # [P, H, 1]
    act = silu_and_mul(torch.bmm(w13[ids], xs).squeeze(-1)).unsqueeze(-1)          # [P, I, 1]
    out = torch.bmm(w2[ids], act).view(tokens, k, w2.shape[1])                     # [T, k, H]
    return (out * topk_weights.unsqueeze(-1)).sum(dim=1)                           # [T, H]


@torch.library.custom_op("strata::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of `a [P, K]` in groups ending at `ends [E]` (int32), group g times `b[g] [K, N]`: `[P, N]`."""
    # NOTE: torch 2.13's meta function for _grouped_mm accepts only bf16, so a float32 graph calls it through an
    # opaque custom op; eager calls it directly (the custom op costs ~20 us a call).
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return _grouped_mm_op(a, b, ends)
    return torch._grouped_mm(a, b, offs=ends)


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm takes fp32/bf16/fp16 with every stride a multiple of 16 bytes; on CUDA, bf16 on a Hopper
    (sm90) or newer GPU."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.dtype == torch.float16 and not x.is_cuda:
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    size = x.element_size()
    inter, hidden = w2.shape[2], w2.shape[1]
    strides = [*w13.stride(), *w2.stride(), hidden, 2 * inter, inter]
    return all(s * size % 16 == 0 for s in strides if s != 1)


def _sort_pairs(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [P] pairs sorted by expert (stable), expert of each sorted pair [P], arange(E))."""
    ids = topk_ids.reshape(-1)                                                     # [P]
    order = torch.argsort(ids, stable=True)                                        # [P]
    return order, ids[order], torch.arange(experts, device=ids.device)


def _combine(out: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, tokens: int) -> torch.Tensor:
    """`out [P, H]` in expert order -> the weighted sum over each token's k pairs `[T, H]`."""
    # NOTE: weight-and-index_add, as the loop does: measured (1 thread, E=8, H=I=256, T=64 and 1024) it beats
    # un-permuting to [T, k, H] and summing over k by 5-15% eager and compiled.
    weighted = out * topk_weights.reshape(-1)[order].unsqueeze(-1)                 # [P, H]
    return out.new_zeros(tokens, out.shape[1]).index_add_(0, order // topk_weights.shape[1], weighted)


def grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
    """Pairs sorted by expert, one grouped GEMM per projection; no host sync, every shape static (P = T*k)."""
    k = topk_ids.shape[1]
    order, expert_of, arange = _sort_pairs(topk_ids, w13.shape[0])
    ends = torch.searchsorted(expert_of, arange, right=True).to(torch.int32)       # [E] end of each group
    xs = x[order // k]                                                             # [P, H]
    act = silu_and_mul(grouped_mm(xs, w13.transpose(1, 2), ends))                  # [P, I]
    return _combine(grouped_mm(act, w2.transpose(1, 2), ends), order, topk_weights, x.shape[0])


def padded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> torch.Tensor:
    """Pairs scattered into `[E, T, H]` slots, one bmm per projection.

    NOTE: the capacity is T rows per expert, enough only because a token's k ids are distinct (top-k's are).
    """
    (tokens, k), (experts, _, hidden) = topk_ids.shape, w13.shape
    order, expert_of, arange = _sort_pairs(topk_ids, experts)
    starts = torch.searchsorted(expert_of, arange)                                 # [E] first sorted pair
    rank = torch.arange(order.numel(), device=x.device) - starts[expert_of]       # [P] row within its expert
    slot = expert_of * tokens + rank                                               # [P] into E*T slots
    slots = x.new_zeros(experts * tokens, hidden).index_copy_(0, slot, x[order // k])  # [E*T, H]
    act = silu_and_mul(torch.bmm(slots.view(experts, tokens, hidden), w13.transpose(1, 2)))  # [E, T, I]
    out = torch.bmm(act, w2.transpose(1, 2)).view(experts * tokens, hidden)[slot]  # [P, H] expert order
    return _combine(out, order, topk_weights, tokens)


def cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor) -> torch.Tensor:
    """Strata's CPU kernel (float32 or bfloat16, one dtype; `cpu_kernels.usable` says whether it runs here)."""
    return cpu_kernels.moe(x, w13, w2, topk_ids, topk_weights)


PATHS: dict[str, MoEPathFn] = {"loop": loop, "dense": dense, "gather": gather, "grouped": grouped,
                               "padded": padded, "cpu": cpu}
SYNC_FREE = frozenset({"dense", "gather", "grouped", "padded", "triton", "cpu"})
