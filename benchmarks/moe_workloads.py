"""moe_bench's inputs: the MoE layer shapes it measures and the routing workloads it feeds them.

    route(tokens, experts, top_k, skew, seed)   `Routing`: router probs, top-k ids and weights of `tokens` tokens

Workloads (softmax top-k of router logits, normalised weights, as Qwen3-MoE routes):
  skew 0    uniform: logits are standard Gumbel noise, so every expert is equally likely to be chosen.
  skew s    Zipf: logits are s * log(1 / popularity rank) + Gumbel noise. Top-k of log p + Gumbel noise draws k
            distinct experts, one after another, each with probability proportional to p among those left
            (the Gumbel top-k trick), so expert popularity follows Zipf(s).
Popularity order (`hot_order`): "ids" makes expert 0 the hottest, then 1, ...: the worst case for the contiguous
layout of expert parallelism (rank 0 holds every hot expert); "random" takes one fixed permutation of the ids, as a
trained model's hot experts are spread (on 2 ranks the halves then carry similar load).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.moe.router import route_topk


class BenchShape(NamedTuple):
    experts: int
    top_k: int
    hidden: int
    inter: int
    layers: int


SHAPES = {"bundled": BenchShape(8, 2, 256, 256, 4),      # models/strata-moe-tiny: 4 sparse layers
          "big": BenchShape(64, 8, 1024, 512, 1)}        # a Qwen3-30B-A3B-like layer at a quarter of its width
TINY = BenchShape(16, 4, 128, 64, 1)                     # --quick stand-in for "big": same code paths, tiny
HOT_ORDER_SEED = 1234                                    # the permutation of experts by popularity


class Routing(NamedTuple):
    probs: torch.Tensor         # [T, E] float32 softmax of the router logits
    ids: torch.Tensor           # [T, k] int64, distinct per token
    weights: torch.Tensor       # [T, k] in the requested dtype, summing to 1 per token


HOT_ORDERS = ("ids", "random")


def zipf_log_popularity(experts: int, skew: float, hot_order: str = "ids") -> torch.Tensor:
    """`[E]` log of each expert's unnormalised Zipf popularity (0 everywhere when skew is 0)."""
    if hot_order not in HOT_ORDERS:
        raise ValueError(f"hot_order must be one of {HOT_ORDERS}, got {hot_order!r}")
    order = torch.arange(experts)
    if hot_order == "random":
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(HOT_ORDER_SEED))
    rank = torch.empty(experts, dtype=torch.float64)
    rank[order] = torch.arange(1, experts + 1, dtype=torch.float64)        # expert order[0] is the hottest
    return (-skew * rank.log()).float()


def route(tokens: int, experts: int, top_k: int, skew: float, seed: int, dtype: torch.dtype = torch.float32,
          hot_order: str = "ids") -> Routing:
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(tokens, experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
    gumbel = -(-uniform.log()).log()                                         # [T, E] standard Gumbel
    logits = zipf_log_popularity(experts, skew, hot_order) + gumbel         # [T, E]
    weights, ids = route_topk(logits, top_k, True, dtype)                   # [T, k] each
    return Routing(torch.softmax(logits, dim=-1), ids, weights)


def expert_weights(shape: BenchShape, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random stacked experts of one layer: `w13 [E, 2I, H]`, `w2 [E, H, I]` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.inter
    return ((torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype),
            (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype))
