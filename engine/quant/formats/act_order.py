"""GPTQ act-order (`desc_act`): `g_idx[c]` is the quantization group of input column `c`, and the groups are not
contiguous. `IntWeight.perm` expresses the same weights with contiguous groups:

    perm = stable argsort(g_idx)          so  g_idx[perm] == [0]*g + [1]*g + ... + [G-1]*g
    q'[:, j] = q[:, perm[j]]              column j of q' multiplies input feature perm[j]

This is exact (no re-quantization) whenever every group holds exactly `group_size` columns, which GPTQ's act-order
always produces; anything else is refused by the caller.
"""
from __future__ import annotations

import torch


def contiguous_groups(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int64) // group_size                 # [k]


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """None when `g_idx` is already `arange(k) // group_size`; else the int64 `perm` above. ValueError (saying
    why) when the groups cannot be made contiguous with `group_size` columns each."""
    g_idx = g_idx.to(torch.int64)
    expected = contiguous_groups(g_idx.numel(), group_size)
    if torch.equal(g_idx, expected):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], expected):
        counts = torch.bincount(g_idx.clamp(min=0)).tolist()
        raise ValueError(f"its groups do not each hold group_size={group_size} columns (sizes {counts[:8]}...)")
    return perm
