"""Where each MoE expert lives across expert-parallel ranks, and how to rebalance it from observed load (EPLB).

Pure bookkeeping (ints and floats, no torch): every process computes the same layout from the same load.
Physical slots are rank-major; `slot_expert[p]` is the logical expert slot p holds, -1 when empty:

    rank 0               rank 1               N = 2 ranks, S = 3 slots per rank
    [ p0  p1  p2 ]       [ p3  p4  p5 ]       slot p lives on rank p // S at local index p % S

`rebalance(load, N, S)`, a greedy in the style of DeepSeek's EPLB:
  a. replicas: every expert gets one; the N*S - E spare slots go one at a time to the expert with the largest
     load / replicas (ties: lowest id). An expert never gets more than N replicas (one per rank), so once every
     expert has N the remaining slots stay empty.
  b. placement: replicas, sorted by per-replica load descending (ties: expert id), go one at a time to the rank
     with the least assigned load that has a free slot and does not hold that expert yet (ties: lowest rank).
     NOTE: a rank is skipped when taking the replica would leave the replicas still to place with no valid
     layout (too few ranks with free slots for some expert's replicas). This safety net keeps rebalance total;
     in 120k random trials the plain greedy never needed it, so the layout is the greedy's.
  c. within a rank, slots fill in placement order; leftover slots are -1.
Zero total load carries no signal, so it falls back to the contiguous layout with the spare slots empty.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Sequence

EMPTY = -1


class Move(NamedTuple):
    """Copy `expert`'s weights from (src_rank, src_local_slot) of the old layout into (dst_rank, dst_local_slot)."""
    dst_rank: int
    dst_local_slot: int
    expert: int
    src_rank: int
    src_local_slot: int

    @property
    def is_local(self) -> bool:
        """The weights are already on dst_rank: no transfer, at most a copy between local slots."""
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class ExpertPlacement:
    """Logical expert of each physical slot, rank-major (see the module docstring)."""
    num_experts: int
    world_size: int
    slots_per_rank: int
    slot_expert: tuple[int, ...]

    def __post_init__(self) -> None:
        # NOTE: a list would make the frozen placement mutable through its field; store a tuple.
        object.__setattr__(self, "slot_expert", tuple(self.slot_expert))
        for name in ("num_experts", "world_size", "slots_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.slot_expert) != self.world_size * self.slots_per_rank:
            raise ValueError(f"slot_expert has {len(self.slot_expert)} entries, expected world_size * "
                             f"slots_per_rank = {self.world_size * self.slots_per_rank}")
        bad = [e for e in self.slot_expert if not EMPTY <= e < self.num_experts]
        if bad:
            raise ValueError(f"slot_expert ids must be in [0, {self.num_experts}) or {EMPTY} (empty), got {bad[0]}")
        for rank in range(self.world_size):
            held = [e for e in self.local_experts(rank) if e != EMPTY]
            if len(held) != len(set(held)):
                raise ValueError(f"rank {rank} holds an expert twice: {held}; one replica per rank at most")
        missing = [e for e, n in enumerate(self.num_replicas()) if n == 0]
        if missing:
            raise ValueError(f"every expert needs at least one slot; experts {missing} have none")

    def replicas(self, expert: int) -> tuple[int, ...]:
        """Physical slots holding `expert`, ascending."""
        return tuple(p for p, e in enumerate(self.slot_expert) if e == expert)

    def rank_of(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The S experts of `rank`'s local slots in order, -1 for empty."""
        start = rank * self.slots_per_rank
        return self.slot_expert[start:start + self.slots_per_rank]

    def num_replicas(self) -> tuple[int, ...]:
        counts = [0] * self.num_experts
        for e in self.slot_expert:
            if e != EMPTY:
                counts[e] += 1
        return tuple(counts)

    def moved_from(self, old: ExpertPlacement) -> list[Move]:
        """One Move for EVERY non-empty slot of this layout, ordered by (dst_rank, dst_local_slot).

        The source is the same rank when `old` already had the expert there (`is_local`), else the lowest rank
        (then lowest local slot) holding it in `old`. Listing local moves too lets a rank rebuild its whole slot
        stack from the list alone; the transfers are the moves that are not local.
        """
        if (old.num_experts, old.world_size) != (self.num_experts, self.world_size):
            raise ValueError(f"old layout has {old.num_experts} experts on {old.world_size} ranks, this one "
                             f"{self.num_experts} on {self.world_size}; they must match")
        old_where = old._where()
        moves = []
        for p, expert in enumerate(self.slot_expert):
            if expert == EMPTY:
                continue
            rank, local = divmod(p, self.slots_per_rank)
            homes = old_where[expert]
            src_rank, src_local = next(((r, s) for r, s in homes if r == rank), homes[0])
            moves.append(Move(rank, local, expert, src_rank, src_local))
        return moves

    def _where(self) -> list[list[tuple[int, int]]]:
        """(rank, local slot) pairs holding each expert, ascending."""
        where: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for p, expert in enumerate(self.slot_expert):
            if expert != EMPTY:
                where[expert].append(divmod(p, self.slots_per_rank))
        return where


def contiguous(num_experts: int, world_size: int, redundant_per_rank: int = 0) -> ExpertPlacement:
    """Rank r holds experts [r*B, (r+1)*B) in order, B = ceil(E/N); S = B + redundant_per_rank, unused slots -1."""
    if redundant_per_rank < 0:
        raise ValueError(f"redundant_per_rank must be >= 0, got {redundant_per_rank}")
    block = math.ceil(num_experts / world_size)
    return _blocks(num_experts, world_size, block + redundant_per_rank)


def _blocks(num_experts: int, world_size: int, slots_per_rank: int) -> ExpertPlacement:
    block = math.ceil(num_experts / world_size)
    slots = []
    for rank in range(world_size):
        held = list(range(rank * block, min((rank + 1) * block, num_experts)))
        slots += held + [EMPTY] * (slots_per_rank - len(held))
    return ExpertPlacement(num_experts, world_size, slots_per_rank, tuple(slots))


def rebalance(load: Sequence[float], world_size: int, slots_per_rank: int) -> ExpertPlacement:
    """The layout that spreads `load` (per logical expert, e.g. tokens routed) evenly; see the module docstring."""
    num_experts = len(load)
    if num_experts < 1 or world_size < 1 or slots_per_rank < 1:
        raise ValueError(f"need >= 1 expert, rank and slot; got {num_experts}, {world_size}, {slots_per_rank}")
    if world_size * slots_per_rank < num_experts:
        raise ValueError(f"{world_size} ranks x {slots_per_rank} slots cannot hold {num_experts} experts; "
                         f"slots_per_rank must be >= {math.ceil(num_experts / world_size)}")
    if any(not math.isfinite(x) or x < 0 for x in load):
        raise ValueError("load must be finite and >= 0 for every expert")
    if sum(load) == 0:
        return _blocks(num_experts, world_size, slots_per_rank)
    counts = _replica_counts(load, world_size, world_size * slots_per_rank)
    ranks = _place(load, counts, world_size, slots_per_rank)
    slots = [e for held in ranks for e in held + [EMPTY] * (slots_per_rank - len(held))]
    return ExpertPlacement(num_experts, world_size, slots_per_rank, tuple(slots))


def _replica_counts(load: Sequence[float], world_size: int, total_slots: int) -> list[int]:
    """Step a: one replica each, then each spare slot to the expert with the most load per replica."""
    counts = [1] * len(load)
    for _ in range(total_slots - len(load)):
        # NOTE: max() keeps the first of equal keys, so ties go to the lowest id.
        open_ = [e for e in range(len(load)) if counts[e] < world_size]
        if not open_:
            break
        best = max(open_, key=lambda e: load[e] / counts[e])
        counts[best] += 1
    return counts


def _place(load: Sequence[float], counts: list[int], world_size: int, slots_per_rank: int) -> list[list[int]]:
    """Steps b and c: the experts of each rank, in placement order."""
    order = sorted(range(len(load)), key=lambda e: (-load[e] / counts[e], e))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    rank_load = [0.0] * world_size
    for i, expert in enumerate(order):
        later = sorted((counts[e] for e in order[i + 1:]), reverse=True)
        for left in range(counts[expert], 0, -1):
            free = [r for r in range(world_size) if len(ranks[r]) < slots_per_rank and expert not in ranks[r]]
            free.sort(key=lambda r: (rank_load[r], r))
            rank = next(r for r in free if _fits(ranks, r, left - 1, expert, later, slots_per_rank))
            ranks[rank].append(expert)
            rank_load[rank] += load[expert] / counts[expert]
    return ranks


def _fits(ranks: list[list[int]], taken: int, left: int, expert: int, later: list[int], slots: int) -> bool:
    """Whether, after rank `taken` takes a replica of `expert`, the `left` others and `later` (replica counts of
    the experts still to place, descending) can still be placed, one replica per rank at most.

    Placing `left` first on the ranks with the most free slots keeps the most room; the rest is the Gale-Ryser
    condition: the k largest counts fit in sum over ranks of min(free, k), for every k.
    """
    free = [slots - len(held) - (r == taken) for r, held in enumerate(ranks)]
    open_ = sorted((r for r in range(len(ranks)) if r != taken and free[r] > 0 and expert not in ranks[r]),
                   key=lambda r: -free[r])
    if len(open_) < left:
        return False
    for r in open_[:left]:
        free[r] -= 1
    # NOTE: min(free, k) == free once k >= slots, so past that only the total needs checking.
    need = 0
    for k, count in enumerate(later[:slots], start=1):
        need += count
        if need > sum(min(f, k) for f in free):
            return False
    return sum(later) <= sum(free)


def rank_loads(placement: ExpertPlacement, load: Sequence[float]) -> list[float]:
    """Expected load of each rank when each expert's load splits evenly over its replicas."""
    if len(load) != placement.num_experts:
        raise ValueError(f"load has {len(load)} entries, expected num_experts = {placement.num_experts}")
    replicas = placement.num_replicas()
    return [sum(load[e] / replicas[e] for e in placement.local_experts(r) if e != EMPTY)
            for r in range(placement.world_size)]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads: 1.0 is perfect balance (and the value when every load is zero)."""
    if not loads:
        raise ValueError("loads must name at least one rank")
    mean = sum(loads) / len(loads)
    return 1.0 if mean == 0 else max(loads) / mean


class LoadWindow:
    """Per-expert token counts summed over the last `window` forwards; O(E) per add (running sums + deque)."""

    def __init__(self, num_experts: int, window: int) -> None:
        if num_experts < 1 or window < 1:
            raise ValueError(f"num_experts and window must be >= 1, got {num_experts} and {window}")
        self.num_experts = num_experts
        self.window = window
        self._steps: deque[tuple[int, ...]] = deque()
        self._sums = [0] * num_experts

    def add(self, counts: Sequence[int]) -> None:
        if len(counts) != self.num_experts:
            raise ValueError(f"counts has {len(counts)} entries, expected num_experts = {self.num_experts}")
        step = tuple(int(c) for c in counts)
        self._steps.append(step)
        self._sums = [s + c for s, c in zip(self._sums, step)]
        if len(self._steps) > self.window:
            oldest = self._steps.popleft()
            self._sums = [s - c for s, c in zip(self._sums, oldest)]

    def total(self) -> list[int]:
        return list(self._sums)

    def __len__(self) -> int:
        return len(self._steps)
