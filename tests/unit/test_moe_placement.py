"""Expert placement and EPLB rebalancing (engine/moe/placement.py): exact layouts, validation, moves, load windows."""
from __future__ import annotations

import pytest

from engine.moe.placement import (ExpertPlacement, LoadWindow, Move, contiguous, imbalance, rank_loads,
                                  rebalance)


def zipf(num_experts: int, exponent: float = 1.0) -> list[float]:
    return [1.0 / (e + 1) ** exponent for e in range(num_experts)]


def test_contiguous_layout_exact_slots():
    placement = contiguous(5, 2, redundant_per_rank=1)
    assert placement.slots_per_rank == 4
    assert placement.slot_expert == (0, 1, 2, -1, 3, 4, -1, -1)
    assert placement.num_replicas() == (1, 1, 1, 1, 1)


def test_contiguous_layout_without_redundancy_fills_every_slot():
    assert contiguous(8, 4).slot_expert == (0, 1, 2, 3, 4, 5, 6, 7)


@pytest.mark.parametrize("slots, message", [
    ((0, 1, 2), "expected world_size"),
    ((0, 1, 2, 4), r"must be in \[0, 4\)"),
    ((0, 0, 2, 3), "holds an expert twice"),
    ((0, 1, 2, -1), r"experts \[3\] have none"),
])
def test_placement_rejects_invalid_slots(slots, message):
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(4, 2, 2, slots)


def test_placement_rejects_zero_ranks():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ExpertPlacement(1, 0, 1, ())


def test_replicas_and_local_experts_with_redundant_slot():
    placement = ExpertPlacement(3, 2, 2, (0, 1, 2, 0))
    assert placement.replicas(0) == (0, 3)
    assert placement.replicas(2) == (2,)
    assert placement.rank_of(3) == 1
    assert placement.local_experts(1) == (2, 0)
    assert placement.num_replicas() == (2, 1, 1)


def test_moved_from_unchanged_layout_is_all_local():
    placement = contiguous(4, 2)
    assert placement.moved_from(placement) == [Move(0, 0, 0, 0, 0), Move(0, 1, 1, 0, 1),
                                               Move(1, 0, 2, 1, 0), Move(1, 1, 3, 1, 1)]


def test_moved_from_lists_transfers_and_local_reorders():
    """Expert 2 moves to rank 0 (from rank 1); expert 0 stays on rank 0 but changes local slot; the slot for
    expert 3 on rank 1 takes the lowest rank holding it."""
    old = ExpertPlacement(4, 2, 3, (0, 1, -1, 2, 3, -1))
    new = ExpertPlacement(4, 2, 3, (2, 0, 1, 3, 0, -1))
    assert new.moved_from(old) == [Move(0, 0, 2, 1, 0), Move(0, 1, 0, 0, 0), Move(0, 2, 1, 0, 1),
                                   Move(1, 0, 3, 1, 1), Move(1, 1, 0, 0, 0)]
    assert [m.is_local for m in new.moved_from(old)] == [False, True, True, True, False]


def test_moved_from_rejects_other_world_size():
    with pytest.raises(ValueError, match="must match"):
        contiguous(4, 2).moved_from(contiguous(4, 4))


def test_rebalance_zipf_load_balances_within_ten_percent():
    load = zipf(64)
    before = imbalance(rank_loads(contiguous(64, 2, redundant_per_rank=4), load))
    after_placement = rebalance(load, 2, 36)
    after = imbalance(rank_loads(after_placement, load))
    assert before > 1.5
    assert after <= 1.1
    assert all(n >= 1 for n in after_placement.num_replicas())
    assert after_placement.num_replicas()[0] == 2      # the hottest expert sits on both ranks
    assert sum(after_placement.num_replicas()) == 72   # the 8 spare slots are all used


def test_rebalance_is_deterministic():
    load = zipf(64, 1.3)
    assert rebalance(load, 4, 18) == rebalance(list(load), 4, 18)


def test_rebalance_exact_small_layout():
    """Spares: 0 (10 -> 5 per replica), then 1 (6 -> 3). Order by per-replica load: 0, 0, 1, 1, 2, 3; each onto
    the least-loaded rank that lacks it, ties to rank 0: loads 5|5, 8|8, 10|8, 10|9."""
    placement = rebalance([10.0, 6.0, 2.0, 1.0], 2, 3)
    assert placement.slot_expert == (0, 1, 2, 0, 1, 3)
    assert rank_loads(placement, [10.0, 6.0, 2.0, 1.0]) == [10.0, 9.0]


def test_rebalance_caps_replicas_at_world_size():
    placement = rebalance([5.0, 1.0], 2, 4)
    assert placement.num_replicas() == (2, 2)
    assert placement.slot_expert.count(-1) == 4


def test_rebalance_single_rank_holds_everything_once():
    placement = rebalance([3.0, 1.0, 2.0], 1, 4)
    assert placement.slot_expert == (0, 2, 1, -1)


def test_rebalance_zero_load_falls_back_to_contiguous():
    assert rebalance([0.0] * 6, 2, 4).slot_expert == (0, 1, 2, -1, 3, 4, 5, -1)


@pytest.mark.parametrize("load, ranks, slots, message", [
    ([1.0] * 5, 2, 2, "cannot hold 5 experts"),
    ([1.0, -1.0], 2, 1, "finite and >= 0"),
])
def test_rebalance_rejects_bad_input(load, ranks, slots, message):
    with pytest.raises(ValueError, match=message):
        rebalance(load, ranks, slots)


def test_imbalance_of_zero_load_is_one():
    assert imbalance([0.0, 0.0]) == 1.0
    assert imbalance([3.0, 1.0]) == 1.5


def test_load_window_sums_last_window_adds():
    window = LoadWindow(3, window=2)
    window.add([1, 0, 2])
    window.add([0, 5, 1])
    assert window.total() == [1, 5, 3]
    window.add([4, 4, 4])
    assert window.total() == [4, 9, 5]
    assert len(window) == 2


def test_load_window_rejects_wrong_length():
    with pytest.raises(ValueError, match="expected num_experts = 3"):
        LoadWindow(3, 4).add([1, 2])
