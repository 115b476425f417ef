"""Exact verification of proposed tokens against the target's distribution (Leviathan et al., Chen et al.).

For one request with drafts d_1..d_k drawn from q_1..q_k and the target's distributions p_1..p_{k+1} (rows of the
verify step, each the distribution the sampler would draw from at that position: bans, bias, penalties,
temperature, top-k/p, min-p applied):

    for j = 1..k:   accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
                    on rejection: emit a draw from norm(max(0, p_j - q_j)) and stop
    all accepted:   emit a bonus draw from p_{k+1}

The emitted tokens are distributed exactly as k + 1 (or fewer) draws from the target. Greedy rows are prefix
matching (p is a point mass at the argmax). For point-mass drafts (q_j = one-hot(d_j): n-gram lookup, greedy
drafts) the test is taken in its coupled form: the sampler draws x_j from p_j with the row's own uniform, d_j is
accepted iff x_j == d_j, and a rejection emits x_j itself. That is the same rule (P(accept) = p_j(d_j), and a
rejected x_j is distributed as p_j restricted to tokens != d_j = norm(max(0, p_j - one-hot))), and it emits, for a
seeded request, exactly the tokens the request gives without speculation.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

ACCEPT_STREAM, RESIDUAL_STREAM, DRAFT_STREAM = 1, 2, 3   # seeded_uniform streams (0: the sampler's own draw)


class Verdict(NamedTuple):
    token_ids: list[int]      # accepted drafts, then the correction or bonus token
    num_accepted: int


def verify_point_masses(drafts: Sequence[int], target_draws: Sequence[int]) -> Verdict:
    """Drafts that are point masses against the target's own draws `target_draws` (k + 1 of them)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_draws[accepted]:
        accepted += 1
    return Verdict([*drafts[:accepted], target_draws[accepted]], accepted)


def verify_sampled(drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor, bonus: int,
                   accept_u: Sequence[float], residual_u: Sequence[float], *, broken: bool = False) -> Verdict:
    """Drafts drawn from `q` [k, V] against the target's `p` [k, V] (each row a distribution); `bonus` the
    target's own draw at position k + 1; `accept_u[j]`, `residual_u[j]` uniforms in [0, 1). `broken=True`
    accepts with probability p instead of min(1, p / q): a wrong verifier, for the statistical test to reject."""
    k = len(drafts)
    ids = torch.tensor(drafts, dtype=torch.long, device=p.device).unsqueeze(1)        # [k, 1]
    p_d = p.gather(1, ids).squeeze(1).double().cpu()                                  # [k]
    q_d = q.gather(1, ids).squeeze(1).double().cpu()                                  # [k]
    for j in range(k):
        ratio = p_d[j] if broken else p_d[j] / q_d[j].clamp(min=1e-30)
        if accept_u[j] < ratio:
            continue
        return Verdict([*drafts[:j], residual_draw(p[j], q[j], residual_u[j])], j)
    return Verdict([*drafts, bonus], k)


def residual_draw(p: torch.Tensor, q: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from norm(max(0, p - q)) [V]; p itself if the residual is empty (p <= q everywhere only
    when p == q, where a rejection cannot happen; guarded against rounding)."""
    residual = (p.double() - q.double()).clamp_(min=0.0)                               # [V]
    if float(residual.sum()) <= 0.0:
        residual = p.double()
    cdf = residual.cumsum(0)
    index = torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)
    return int(index.clamp_(max=cdf.shape[0] - 1))
