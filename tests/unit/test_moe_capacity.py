"""Per-expert capacity (engine/moe/capacity.py): GShard priority, drop and next-best overflow, exact values."""
from __future__ import annotations

import pytest
import torch

from engine.moe.capacity import apply_capacity, expert_capacity


def make_routing(tokens: int, experts: int, top_k: int, seed: int = 0):
    """Softmax probs and Mixtral-style renormalised top-k weights/ids."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return probs, ids, weights / weights.sum(-1, keepdim=True)


def tensor_ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("tokens, top_k, experts, factor, expected", [
    (10, 2, 8, 1.0, 3), (10, 1, 1, 1.1, 11), (1, 1, 64, 1.0, 1), (0, 2, 8, 1.25, 0), (16, 2, 8, 1.25, 5)])
def test_expert_capacity_rounds_up(tokens, top_k, experts, factor, expected):
    assert expert_capacity(tokens, top_k, experts, factor) == expected


def test_expert_capacity_rejects_nonpositive_factor():
    with pytest.raises(ValueError, match="capacity factor"):
        expert_capacity(4, 2, 8, 0.0)


def test_drop_keeps_first_choices_before_second_choices():
    """Capacity 2. Expert 0: t0c0, t1c0 kept; t2c0, t3c1 dropped. Expert 1: t3c0 (a first choice) is kept ahead
    of t0c1 and t2c1 although token 3 comes last in the batch; t2c1 is the third and is dropped."""
    ids = tensor_ids([[0, 1], [0, 2], [0, 1], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.8, 0.2]])
    probs = torch.full((4, 3), 1 / 3)
    result = apply_capacity(probs, ids, weights, 2, "drop", normalize=True)
    assert torch.equal(result.ids, ids)
    assert torch.equal(result.weights, torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.0, 0.0], [0.8, 0.0]]))
    assert result.dropped.item() == 3 and result.rerouted.item() == 0
    assert result.dropped.dtype == torch.int64 and result.dropped.dim() == 0


def test_drop_admits_exactly_capacity_pairs_per_expert():
    probs, ids, weights = make_routing(64, 8, 2)
    result = apply_capacity(probs, ids, weights, 5, "drop", normalize=False)
    per_expert = torch.bincount(ids[result.weights > 0], minlength=8)
    demand = torch.bincount(ids.reshape(-1), minlength=8)
    assert torch.equal(per_expert, demand.clamp(max=5))
    assert result.dropped.item() == int((demand - 5).clamp(min=0).sum())


def test_drop_keeps_weight_dtype():
    probs, ids, weights = make_routing(8, 4, 2)
    result = apply_capacity(probs, ids, weights.to(torch.bfloat16), 1, "drop", normalize=False)
    assert result.weights.dtype == torch.bfloat16


def test_next_reroutes_to_next_best_unused_expert_and_renormalises():
    """Capacity 2: token 2's pairs both overflow (experts 0 and 1 are full). Its next-best experts by prob are 2
    then 3; renormalised 0.2, 0.1 -> 2/3, 1/3. Tokens 0 and 1 keep their input weights exactly."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.35, 0.05, 0.2], [0.45, 0.25, 0.2, 0.1]])
    ids = tensor_ids([[0, 1], [0, 1], [0, 1]])
    weights = torch.tensor([[0.625, 0.375], [0.6, 0.4], [0.55, 0.45]])
    result = apply_capacity(probs, ids, weights, 2, "next", normalize=True)
    assert torch.equal(result.ids, tensor_ids([[0, 1], [0, 1], [2, 3]]))
    torch.testing.assert_close(result.weights, torch.tensor([[0.625, 0.375], [0.6, 0.4], [2 / 3, 1 / 3]]))
    assert result.rerouted.item() == 2 and result.dropped.item() == 0


def test_next_without_normalize_uses_prob_and_drops_when_full():
    """Capacity 1, two experts, all three tokens pick expert 0: token 1 moves to expert 1 (weight = its prob
    0.3); token 2 finds expert 1 full too and is dropped, keeping id 0."""
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    ids = tensor_ids([[0], [0], [0]])
    weights = torch.tensor([[0.6], [0.7], [0.9]])
    result = apply_capacity(probs, ids, weights, 1, "next", normalize=False)
    assert torch.equal(result.ids, tensor_ids([[0], [1], [0]]))
    assert torch.equal(result.weights, torch.tensor([[0.6], [0.3], [0.0]]))
    assert result.rerouted.item() == 1 and result.dropped.item() == 1


def test_next_gives_contested_expert_to_earlier_choice():
    """Capacity 1, experts 0-3 full after the first pass. Token 1's first choice and token 0's second choice both
    overflow and both next want expert 4: the first choice wins although token 0 comes first in the batch."""
    ids = tensor_ids([[0, 1], [0, 2], [1, 3]])
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05], [0.4, 0.1, 0.3, 0.15, 0.05], [0.2, 0.4, 0.1, 0.25, 0.05]])
    weights = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    result = apply_capacity(probs, ids, weights, 1, "next", normalize=False)
    assert torch.equal(result.ids, tensor_ids([[0, 1], [4, 2], [1, 3]]))
    assert torch.equal(result.weights, torch.tensor([[0.5, 0.0], [0.05, 0.5], [0.5, 0.5]]))
    assert result.rerouted.item() == 1 and result.dropped.item() == 1


@pytest.mark.parametrize("overflow", ["drop", "next"])
def test_large_capacity_leaves_routing_unchanged(overflow):
    probs, ids, weights = make_routing(32, 8, 2, seed=3)
    result = apply_capacity(probs, ids, weights, 64, overflow, normalize=True)
    assert torch.equal(result.ids, ids) and torch.equal(result.weights, weights)
    assert result.dropped.item() == 0 and result.rerouted.item() == 0


def test_apply_capacity_rejects_unknown_policy():
    probs, ids, weights = make_routing(4, 4, 2)
    with pytest.raises(ValueError, match="overflow must be one of"):
        apply_capacity(probs, ids, weights, 2, "spill", normalize=False)


def test_drop_under_compile_matches_eager():
    """fullgraph=True: the drop policy has no host sync and no graph break."""
    probs, ids, weights = make_routing(16, 4, 2, seed=5)

    def drop(p: torch.Tensor, i: torch.Tensor, w: torch.Tensor):
        return apply_capacity(p, i, w, 6, "drop", normalize=False)

    compiled = torch.compile(drop, fullgraph=True, dynamic=False)
    eager, traced = drop(probs, ids, weights), compiled(probs, ids, weights)
    assert torch.equal(traced.weights, eager.weights) and torch.equal(traced.dropped, eager.dropped)


def test_next_never_overfills_an_expert_or_repeats_one_within_a_token():
    """Random routing where experts 3 and 5 have room left after the first pass: invariants, not exact values."""
    probs, ids, weights = make_routing(48, 8, 3, seed=7)
    result = apply_capacity(probs, ids, weights, 16, "next", normalize=True)
    assert result.rerouted.item() > 0
    kept = result.weights > 0
    assert int(torch.bincount(result.ids[kept], minlength=8).max()) <= 16
    for row, keep in zip(result.ids, kept):
        assert len(set(row[keep].tolist())) == int(keep.sum())
    assert int(kept.sum()) + result.dropped.item() == 48 * 3
    torch.testing.assert_close(result.weights.sum(-1)[kept.any(-1)], torch.ones(int(kept.any(-1).sum())))
