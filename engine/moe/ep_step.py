"""`ExpertParallelStep`: one engine step of an expert-parallel model as one collective schedule on every rank.

    begin(rows)      join_step: does any rank run a forward (and how many rows at most), does any rank want a
                     rebalance; if so, rebalance first (all ranks, same placement)
    forward          the model's sparse layers exchange tokens (expert_parallel.py)
      or idle()      a rank without requests joins each sparse layer's exchange with no tokens
    end()            counts the forward; an automatic rebalance is due every `eplb_interval` forwards

Rebalancing (EPLB): the sliding windows of expert load are summed over the ranks (one all-reduce), every rank runs
the same deterministic `placement.rebalance` per layer, and the experts that change rank move over the group
(ep_weights.py). Requests in flight continue: replicas hold the same weights, so outputs do not change.
"""
from __future__ import annotations

import collections
import logging
from typing import NamedTuple

import torch

from engine.config import MoEConfig
from engine.moe.ep_group import EPGroup
from engine.moe.expert_parallel import ExpertParallelMoE
from engine.moe.placement import imbalance, rank_loads, rebalance

log = logging.getLogger(__name__)


class RebalanceResult(NamedTuple):
    layers: int
    experts_moved: int           # experts that arrived on some rank, over all layers and ranks
    imbalance_before: float      # mean over layers of max/mean expected load per rank, under the old placement
    imbalance_after: float       # the same under the new one


class ExpertParallelStep:
    def __init__(self, group: EPGroup, layers: list[ExpertParallelMoE], config: MoEConfig, top_k: int,
                 dtype: torch.dtype) -> None:
        self.group, self.layers, self.config = group, layers, config
        self.top_k, self.dtype = top_k, dtype
        self.forwards = 0                       # forwards run (idle ones too): the same count on every rank
        self.rebalance_requested = False
        self.last_rebalance: RebalanceResult | None = None
        self.rebalances = 0
        self.experts_moved = 0                  # over all rebalances
        self.rank_window: collections.deque[list[int]] = collections.deque(maxlen=config.eplb_window)
        self._pairs_reported = 0

    def begin(self, rows: int) -> bool:
        """Join this step; True when some rank runs a forward (this rank then runs its forward, or `idle`)."""
        due = self.config.eplb_interval > 0 and self.forwards > 0 and self.forwards % self.config.eplb_interval == 0
        computed = sum(layer.pairs_computed for layer in self.layers)
        plan = self.group.join_step(rows, self.rebalance_requested or due, computed - self._pairs_reported)
        self._pairs_reported = computed
        if any(self.group.last_pairs):
            self.rank_window.append(self.group.last_pairs)
        if plan.rebalance:
            self.rebalance_requested = False
            self.rebalance()
        return plan.rows > 0

    def idle(self) -> None:
        for layer in self.layers:
            layer.idle(self.top_k, self.dtype)

    def end(self) -> None:
        self.forwards += 1
        self.group.end_step()

    def rank_imbalance(self) -> float:
        """max / mean of the pairs each rank computed over the last `eplb_window` steps (1.0 when none)."""
        totals = [sum(column) for column in zip(*self.rank_window)]
        return imbalance(totals) if totals else 1.0

    def request_rebalance(self) -> None:
        """Rebalance before the next step (agreed by every rank in `begin`)."""
        self.rebalance_requested = True

    def rebalance(self) -> RebalanceResult:
        """Collective: every rank, between two forwards."""
        load = torch.tensor([layer.window.total() for layer in self.layers], dtype=torch.float64,
                            device=self.group.device)                                           # [L, E]
        load = self.group.all_reduce_sum(load).cpu()
        before, after, moved = [], [], 0
        for layer, layer_load in zip(self.layers, load.tolist()):
            placement = rebalance(layer_load, self.group.world_size, layer.slots_per_rank)
            before.append(imbalance(rank_loads(layer.placement, layer_load)))
            after.append(imbalance(rank_loads(placement, layer_load)))
            moved += layer.apply_placement(placement)
        moved_total = int(self.group.all_reduce_sum(torch.tensor([moved], dtype=torch.int64,
                                                                 device=self.group.device)).item())
        n = max(len(self.layers), 1)
        result = RebalanceResult(len(self.layers), moved_total, sum(before) / n, sum(after) / n)
        self.last_rebalance, self.rebalances = result, self.rebalances + 1
        self.experts_moved += moved_total
        log.info("expert rebalance: %d experts moved over %d layers; expected imbalance %.3f -> %.3f",
                 result.experts_moved, result.layers, result.imbalance_before, result.imbalance_after)
        return result
