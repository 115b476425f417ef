"""Softmax top-k routing, as Mixtral and Qwen-MoE checkpoints were trained with."""
from __future__ import annotations

import torch


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (weights `[T, k]` in `out_dtype`, expert ids `[T, k]` int64) for router_logits `[T, E]`.

    Softmax in float32 over all experts, then top-k; `normalize` rescales the k weights to sum to one
    (Mixtral always, Qwen-MoE when `norm_topk_prob`).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)   # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)                      # [T, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights.dtype == out_dtype else weights.to(out_dtype)), ids
