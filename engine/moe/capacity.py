"""Optional per-expert capacity for one MoE step: each expert takes at most `capacity` (token, expert) pairs.

Priority (GShard): every token's first choice is admitted before any token's second choice, and so on; within one
choice, tokens go in batch order. Pair (token t, choice i) has priority i*T + t:

    ids [T, k] --t()--> [k, T] --reshape(-1)--> [ choice 0: t0 t1 .. t(T-1) | choice 1: t0 .. t(T-1) | ... ]

Each expert admits the first `capacity` pairs routed to it in that order. The pairs past capacity overflow:
  "drop": the pair's weight becomes 0 and its id stays (a valid index whose product is scaled to nothing, so the
          token keeps only the residual stream for that pair). The kept weights are NOT renormalised, and
          `normalize` is ignored. Vectorised (one-hot cumsum), no host sync: it runs under torch.compile.
  "next": rounds j = 0, 1, .. E-1 over each token's experts sorted by prob (ties: lower id). In round j a token's
          first overflowing pair (in priority order) tries the token's j-th expert unless the token already uses
          it; the pairs trying one expert are admitted in priority order while it has room. An admitted pair
          takes that expert's id and its prob as weight. Pairs still overflowing after the last round are dropped
          as above. With `normalize`, each token that had an overflowing pair gets its weights rebuilt as the probs
          of its kept experts over their sum (top-k renormalisation); other tokens keep their input weights.
          NOTE: one host sync per round (to stop early), so "next" is for eager steps.
Only one pair of a token tries per round: the token's other overflowing pairs would try the same expert, which
either the first one takes or has no room.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch

OVERFLOW_POLICIES = ("drop", "next")


class CapacityResult(NamedTuple):
    ids: torch.Tensor           # [T, k] int64; a dropped pair keeps a valid id (its original)
    weights: torch.Tensor       # [T, k] input dtype; 0 for dropped pairs
    dropped: torch.Tensor       # 0-dim int64: pairs that ended with weight 0 for lack of room
    rerouted: torch.Tensor      # 0-dim int64: pairs moved to another expert ("next" only)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """ceil(factor * T * k / E) pairs per expert, at least 1 when there are tokens (0 when there are none)."""
    if num_tokens < 0 or top_k < 1 or num_experts < 1:
        raise ValueError(f"need num_tokens >= 0, top_k >= 1, num_experts >= 1; got {num_tokens}, {top_k}, "
                         f"{num_experts}")
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"capacity factor must be a finite number > 0, got {factor}")
    if num_tokens == 0:
        return 0
    # NOTE: Fraction(str(factor)) is the decimal the user wrote, so 1.1 * 10 pairs gives 11, not float's 12.
    return max(1, math.ceil(Fraction(str(factor)) * num_tokens * top_k / num_experts))


def apply_capacity(probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, capacity: int, overflow: str,
                   normalize: bool) -> CapacityResult:
    """Cap every expert at `capacity` pairs; see the module docstring for priority and the overflow policies.

    probs `[T, E]` float32 softmax probs, ids `[T, k]` int64, weights `[T, k]` (any float dtype, kept).
    """
    _check(probs, ids, weights, capacity, overflow)
    num_tokens, top_k = ids.shape
    num_experts = probs.shape[1]
    room = torch.full((num_experts,), capacity, dtype=torch.int64, device=ids.device)      # [E]
    everyone = torch.ones(top_k * num_tokens, dtype=torch.bool, device=ids.device)          # [k*T]
    kept = _admit(ids.t().reshape(-1), everyone, room, num_experts)                         # [k*T]
    kept = kept.view(top_k, num_tokens).t()                                                 # [T, k]
    if overflow == "drop":
        none = torch.zeros((), dtype=torch.int64, device=ids.device)
        return CapacityResult(ids, weights.masked_fill(~kept, 0), (~kept).sum(), none)
    return _reroute(probs, ids, weights, kept, capacity, normalize)


def _check(probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, capacity: int, overflow: str) -> None:
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be [T, k] int64, got {tuple(ids.shape)} {ids.dtype}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights must match ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if probs.dim() != 2 or probs.shape[0] != ids.shape[0]:
        raise ValueError(f"probs must be [T={ids.shape[0]}, E], got {tuple(probs.shape)}")


def _admit(ids: torch.Tensor, active: torch.Tensor, room: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Which of the `active` pairs (ids `[P]`, in priority order) are among the first room[e] active pairs routed
    to their expert e."""
    experts = torch.arange(num_experts, device=ids.device)
    onehot = (ids[:, None] == experts) & active[:, None]                # [P, E]
    seen = onehot.to(torch.int32).cumsum(0, dtype=torch.int32)           # [P, E] active pairs so far per expert
    place = seen.gather(1, ids[:, None]).squeeze(1)                      # [P] 1-based place within its expert
    return active & (place <= room[ids])                                 # [P]


def _reroute(probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor, capacity: int,
             normalize: bool) -> CapacityResult:
    """The "next" policy's rounds, after the first pass admitted `kept` `[T, k]`."""
    num_tokens, top_k = ids.shape
    num_experts = probs.shape[1]
    taken = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    room = capacity - taken.index_add_(0, ids.reshape(-1), kept.reshape(-1).long())        # [E]
    by_prob = probs.argsort(dim=-1, descending=True, stable=True)                           # [T, E]
    pending, moved, new_ids = ~kept, torch.zeros_like(kept), ids.clone()                    # [T, k] each
    for j in range(num_experts):
        if not bool(pending.any()):
            break
        cand = by_prob[:, j]                                                                # [T]
        unused = (new_ids != cand[:, None]).all(dim=-1, keepdim=True)                       # [T, 1]
        tries = pending & (pending.cumsum(dim=-1) == 1) & unused                            # [T, k] first pending
        won = _admit(cand.repeat(top_k), tries.t().reshape(-1), room, num_experts)          # [k*T]
        won = won.view(top_k, num_tokens).t()                                               # [T, k]
        room -= torch.zeros_like(room).index_add_(0, cand.repeat(top_k), won.t().reshape(-1).long())
        new_ids = torch.where(won, cand[:, None], new_ids)
        pending, moved = pending & ~won, moved | won
    chosen = probs.gather(1, new_ids)                                                       # [T, k] float32
    new_weights = torch.where(moved, chosen.to(weights.dtype), weights.masked_fill(pending, 0))
    if normalize:
        kept_probs = chosen.masked_fill(pending, 0)                                         # [T, k]
        total = kept_probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        touched = (~kept).any(dim=-1, keepdim=True)                                         # [T, 1]
        new_weights = torch.where(touched, (kept_probs / total).to(weights.dtype), new_weights)
    return CapacityResult(new_ids, new_weights, pending.sum(), moved.sum())
