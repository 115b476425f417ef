"""`QuantizedMoE`: a MoE backend whose experts are quantized linears (one pair per expert, any scheme).

    eager      only the active experts: pairs sorted by expert, one quantized gate_up and down per active expert
               (as `engine.moe.paths.loop`; a host sync for the per-expert counts); on CUDA, int4 and mxfp4
               experts run as two grouped Triton GEMMs instead (moe_grouped.py: no host sync)
    compiled   sync-free with static shapes: every expert over every token, weighted 0 where not chosen
               (E/k times the FLOPs, and every expert's weights read once per step)

Routing stays in the model (`SparseMoE.router`, unquantized, as vLLM does); this backend only runs experts.

NOTE: a compiled path that reads only the chosen experts, each (token, expert) pair gathering its expert's int8 rows
and scales for a matrix-vector product (the float `gather` path of engine/moe/paths.py on int8 bytes), was built and
measured against the dense path with the bundled model (int8, compiled decode step, 1 thread, medians of 3
interleaved rounds, ms per step): batch 1 0.71 vs 0.66, 4 2.40 vs 1.89, 8 4.01 vs 3.46, 32 12.1 vs 12.0. The
experts fit in cache and `torch._weight_int8pack_mm` beats the gathered products, so it was not kept.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from engine.moe.backend import MoEBackend
from engine.moe.paths import silu_and_mul
from engine.quant.linear import QuantLinear, quantized_linear
from engine.quant.moe_grouped import GroupedExperts
from engine.quant.packed import QuantizedWeight


class QuantizedMoE(MoEBackend):
    """`w13[e]` maps H -> 2I (gate rows then up rows), `w2[e]` maps I -> H; the `MoEBackend` contract holds."""

    def __init__(self, w13: Sequence[nn.Module], w2: Sequence[nn.Module]) -> None:
        # NOTE: MoEBackend.__init__ stores float stacks; this backend has none, so it starts from nn.Module.
        nn.Module.__init__(self)
        if len(w13) != len(w2) or not w13:
            raise ValueError(f"quantized experts: need as many w13 as w2 modules (> 0), got {len(w13)} and {len(w2)}")
        for e, (up, down) in enumerate(zip(w13, w2)):
            if up.out_features != 2 * down.in_features or up.in_features != down.out_features:
                raise ValueError(f"quantized expert {e}: w13 must be [2I, H] and w2 [H, I], got "
                                 f"[{up.out_features}, {up.in_features}] and [{down.out_features}, "
                                 f"{down.in_features}]")
        self.w13, self.w2 = nn.ModuleList(w13), nn.ModuleList(w2)
        self.grouped = GroupedExperts.stack(w13, w2)      # CUDA int4 / mxfp4 experts; None elsewhere

    @property
    def num_experts(self) -> int:
        return len(self.w13)

    def expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        return self.w2[e](silu_and_mul(self.w13[e](xs)))                         # [n, H]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        topk_weights = topk_weights.to(x.dtype)
        if torch.compiler.is_compiling():
            return self.forward_dense(x, topk_ids, topk_weights)
        if self.grouped is not None:
            return self.grouped.forward(x, topk_ids, topk_weights)
        return self.forward_active(x, topk_ids, topk_weights)

    def forward_active(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Only the experts some token chose (host sync)."""
        if topk_ids.shape[0] == 1:                                               # one token: its k experts
            weights = topk_weights.view(-1)                                      # [k]
            parts = [self.expert(e, x) * weights[r] for r, e in enumerate(topk_ids.view(-1).tolist())]
            return torch.stack(parts).sum(0)                                     # [1, H]
        k = topk_ids.shape[1]
        ids = topk_ids.reshape(-1)                                               # [P]
        order = torch.argsort(ids, stable=True)                                  # [P] pairs grouped by expert
        counts = torch.bincount(ids, minlength=self.num_experts).tolist()       # host sync
        token_of = order // k                                                    # [P]
        xs = x[token_of]                                                         # [P, H]
        out = torch.empty_like(xs)                                               # [P, H]
        start = 0
        for e, count in enumerate(counts):
            if count:
                out[start:start + count] = self.expert(e, xs[start:start + count])
                start += count
        out = out * topk_weights.reshape(-1)[order].unsqueeze(-1)                # [P, H]
        return torch.zeros_like(x).index_add_(0, token_of, out)                  # [T, H]

    def forward_dense(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every expert over every token; no host sync, static shapes (the compiled decode step's path)."""
        gates = x.new_zeros(x.shape[0], self.num_experts).scatter_add_(1, topk_ids, topk_weights)   # [T, E]
        out = torch.zeros_like(x)                                                # [T, H]
        for e in range(self.num_experts):
            out = out + self.expert(e, x) * gates[:, e:e + 1]
        return out


def quantized_experts(w13: Sequence[QuantizedWeight], w2: Sequence[QuantizedWeight],
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> QuantizedMoE:
    """A MoE backend from per-expert quantized weights: `w13[e]` `[2I, H]` (gate rows then up rows, e.g.
    `concat_rows([gate, up])`), `w2[e]` `[H, I]`; activations in `dtype` on `device`."""
    ups: list[QuantLinear] = [quantized_linear(qw, None, dtype, device) for qw in w13]
    downs: list[QuantLinear] = [quantized_linear(qw, None, dtype, device) for qw in w2]
    return QuantizedMoE(ups, downs)
