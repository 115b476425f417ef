"""The quantized MoE on CUDA as two grouped Triton GEMMs per layer (`triton_gemm.int4_grouped_matmul` /
`mxfp4_grouped_matmul`): every (token, expert) pair sorted by expert, each expert's weights read once, no host sync,
static shapes — the grouped form of `engine.moe.paths.grouped` over packed experts.

`GroupedExperts.stack(w13, w2)` stacks the experts' packed buffers into `[E, ...]` tensors and points every expert
module's buffers at its slice of the stack, so the stacked layout costs no second copy of the weights.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn

from engine.moe.paths import _combine, _sort_pairs, silu_and_mul

INT4_BUFFERS = ("qpacked", "scale", "zero")
MXFP4_BUFFERS = ("blocks", "scales")


class GroupedExperts(NamedTuple):
    """Stacked packed experts: `kind` "int4" (qpacked, scale, zero) or "mxfp4" (blocks, scales), per projection."""

    kind: str
    w13: tuple[torch.Tensor, ...]     # each [E, 2I, ...]
    w2: tuple[torch.Tensor, ...]      # each [E, H, ...]
    group_size: int

    @classmethod
    def stack(cls, w13: Sequence[nn.Module], w2: Sequence[nn.Module]) -> GroupedExperts | None:
        """The stacked form when every expert has the CUDA Triton layout of one kind; None otherwise."""
        kind = _kind(list(w13) + list(w2))
        if kind is None:
            return None
        names = INT4_BUFFERS if kind == "int4" else MXFP4_BUFFERS
        group = w13[0].group_size if kind == "int4" else 32
        if kind == "int4" and any(m.group_size != group for m in list(w13) + list(w2)):
            return None
        return cls(kind, _stack(w13, names), _stack(w2, names), group)

    def project(self, x: torch.Tensor, which: tuple[torch.Tensor, ...], ends: torch.Tensor) -> torch.Tensor:
        from engine.quant.triton_gemm import int4_grouped_matmul, mxfp4_grouped_matmul
        if self.kind == "int4":
            return int4_grouped_matmul(x, *which, self.group_size, ends)
        return mxfp4_grouped_matmul(x, *which, ends)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The `MoEBackend` contract: x `[T, H]`, topk_ids / topk_weights `[T, k]` -> `[T, H]`."""
        k, experts = topk_ids.shape[1], self.w13[0].shape[0]
        order, expert_of, arange = _sort_pairs(topk_ids, experts)
        ends = torch.searchsorted(expert_of, arange, right=True).to(torch.int32)    # [E] end of each group
        xs = x[order // k]                                                          # [P, H]
        act = silu_and_mul(self.project(xs, self.w13, ends))                        # [P, I]
        return _combine(self.project(act, self.w2, ends), order, topk_weights, x.shape[0])


def _kind(modules: list[nn.Module]) -> str | None:
    from engine.quant.linear import Int4Linear, Mxfp4Linear
    if all(isinstance(m, Int4Linear) and m.on_cuda and m.perm is None for m in modules):
        return "int4"
    if all(isinstance(m, Mxfp4Linear) and m.on_cuda for m in modules):
        return "mxfp4"
    return None


def _stack(modules: Sequence[nn.Module], names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    stacks = []
    for name in names:
        stacked = torch.stack([getattr(m, name) for m in modules])                  # [E, ...]
        for e, m in enumerate(modules):
            setattr(m, name, stacked[e])        # NOTE: a view: the experts now share the stack's storage
        stacks.append(stacked)
    return tuple(stacks)
