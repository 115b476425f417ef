"""`ExpertParallelMoE`: the `expert_parallel` MoE backend. A sparse layer's experts are spread over the ranks of an
`EPGroup`; each rank keeps only its slots and runs them with a `LocalMoE` over its own slot stack.

    forward(x [T, H], ids [T, k], weights [T, k]) on every rank, every step (T may be 0):
      1. each (token, expert) pair picks a replica of its expert (placement.py); its rank and local slot
      2. dispatch: all-to-all of the tokens to the ranks that hold their experts (ep_dispatch.py)
      3. each rank runs the pairs that arrived through its local experts and sums them per row
      4. combine: all-to-all of the partial outputs back; each token sums its partials -> [T, H]

The checkpoint loads into full stacks `w13 [E, 2I, H]`, `w2 [E, H, I]` (the loader's contract); `post_load` keeps
this rank's slots and drops the rest. A replica of a hot expert is the same weights in another slot, so which replica
a pair uses changes nothing but the rank that does the work (and float summation order: within 1e-5 in float32).

Under torch.compile the layer is one opaque custom op (`strata::ep_moe`): the exchange has data-dependent sizes.
"""
from __future__ import annotations

import collections
import itertools
import weakref
from typing import Callable

import torch

from engine.config import MoEConfig
from engine.moe.backend import MoEBackend, MoESetup, register_moe_backend
from engine.moe.ep_dispatch import combine, pack, unpack
from engine.moe.ep_group import EPGroup
from engine.moe.ep_weights import exchange_experts
from engine.moe.local import LocalMoE
from engine.moe.placement import ExpertPlacement, LoadWindow, contiguous

_LAYERS: weakref.WeakValueDictionary[int, ExpertParallelMoE] = weakref.WeakValueDictionary()  # op handle -> layer
_HANDLES = itertools.count()


class ExpertParallelMoE(MoEBackend):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, group: EPGroup, config: MoEConfig) -> None:
        super().__init__(w13, w2)
        self.group, self.config = group, config
        self._num_experts = w13.shape[0]
        self.hidden, self.device = w2.shape[1], w13.device
        self.placement = contiguous(self._num_experts, group.world_size, config.num_redundant_experts)
        self.inner: MoEBackend | None = None            # this rank's slots, after post_load
        self.window = LoadWindow(self._num_experts, config.eplb_window)
        self.pairs_computed = 0                          # pairs this rank's experts ran, cumulative
        self.pairs_window: collections.deque[int] = collections.deque(maxlen=config.eplb_window)  # per forward
        self.handle = next(_HANDLES)
        _LAYERS[self.handle] = self
        self._tables()

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank

    # ---- weights ------------------------------------------------------------------------------------------

    def post_load(self) -> None:
        """Keep this rank's slots of the full stacks the loader filled (idempotent)."""
        if self.inner is not None:
            return
        w13, w2 = self.w13.detach(), self.w2.detach()                              # [E, 2I, H], [E, H, I]
        local = list(self.placement.local_experts(self.group.rank))
        self.inner = LocalMoE(_gather_slots(w13, local), _gather_slots(w2, local))
        self.w13 = self.w2 = None       # NOTE: the full stacks go; only the slots stay on this rank

    def set_inner(self, inner: MoEBackend) -> None:
        """Replace the local executor (a quantized one: `engine.quant.apply`); same slots, same order."""
        self.inner = inner

    def adopt_all(self, make: Callable[[list[int]], MoEBackend]) -> None:
        """Take this rank's slots from an executor of every expert that `make(expert ids)` builds (a checkpoint's
        quantized experts); an empty slot gets expert 0's weights (no pair ever routes to it)."""
        self.inner = make([max(e, 0) for e in self.placement.local_experts(self.group.rank)])
        self.w13 = self.w2 = None

    def apply_placement(self, placement: ExpertPlacement) -> int:
        """Move to `placement` (every rank at once, same placement): experts this rank lacks arrive from the
        ranks that hold them, float or quantized. Returns how many experts arrived here."""
        self.inner, arrived = exchange_experts(self.group, self.placement, placement, self.inner)
        self.placement = placement
        self._tables()
        return arrived

    def _tables(self) -> None:
        """Replica lookup tensors: `rep_count [E]`, `rep_slot [E, max replicas]` (physical slots)."""
        replicas = [self.placement.replicas(e) for e in range(self._num_experts)]
        width = max(map(len, replicas))
        self.rep_count = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=self.device)
        self.rep_slot = torch.tensor([list(r) + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64,
                                     device=self.device)

    # ---- forward ------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.strata.ep_moe(x, topk_ids, topk_weights, self.handle)
        return self.run(x, topk_ids, topk_weights)

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.inner is None:
            raise RuntimeError("expert-parallel layer used before post_load kept its slots")
        keep = topk_weights != 0                                                   # [T, k] dropped pairs: 0
        if not self.group.exchanging:
            return self._run_offline(x, topk_ids, topk_weights, keep)
        if not self.group.in_step:
            raise RuntimeError("expert-parallel layer called outside a joined step (EPGroup.join_step)")
        self._count(topk_ids, keep)
        dest, slot = self._route(topk_ids, keep)                                   # [T, k] each
        dispatch = pack(x, dest, slot, topk_weights, self.group.world_size, self.group.step_rows)
        recv = self.group.all_to_all(dispatch.send)                                # [N, rows, row_bytes]
        partial = self._compute(recv, topk_ids.shape[1], x.dtype)                  # [N*rows, H]
        back = self.group.all_to_all(partial.view(self.group.world_size, -1, self.hidden))
        return combine(back, dispatch.token_of, x.shape[0])                        # [T, H]

    def idle(self, top_k: int, dtype: torch.dtype) -> None:
        """Join this layer's exchange with no tokens (a rank with no requests this step)."""
        empty = torch.empty(0, self.hidden, dtype=dtype, device=self.device)
        self.run(empty, torch.empty(0, top_k, dtype=torch.int64, device=self.device),
                 torch.empty(0, top_k, dtype=dtype, device=self.device))

    def _route(self, ids: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each kept pair's replica (round robin over a token's index, offset by rank): (dest rank, local slot)."""
        token = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device).unsqueeze(1)   # [T, 1]
        choice = (token + self.group.rank) % self.rep_count[ids]                   # [T, k]
        physical = self.rep_slot[ids, choice]                                      # [T, k]
        per_rank = self.slots_per_rank
        dest = torch.where(keep, physical // per_rank, torch.full_like(physical, -1))
        return dest, physical % per_rank

    def _compute(self, recv: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
        arrived = unpack(recv, self.hidden, top_k, dtype)
        pairs = arrived.row.numel()
        self.pairs_computed += pairs
        self.pairs_window.append(pairs)
        if not pairs:
            return arrived.x.new_zeros(arrived.x.shape)                            # [N*rows, H]
        weight = arrived.weight.to(dtype)
        if isinstance(self.inner, LocalMoE):
            return self.inner.run_pairs(arrived.x, arrived.row, arrived.slot, weight)
        y = self.inner(arrived.x[arrived.row], arrived.slot.unsqueeze(1), weight.unsqueeze(1))   # [P, H]
        return arrived.x.new_zeros(arrived.x.shape).index_add_(0, arrived.row, y)

    def _run_offline(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor:
        """No exchange (warm-up): the pairs whose expert has a slot here; the rest contribute zeros."""
        local = self.placement.local_experts(self.group.rank)
        slot_of = torch.full((self._num_experts,), -1, dtype=torch.int64, device=ids.device)
        for s, e in enumerate(local):
            if e >= 0 and slot_of[e] < 0:
                slot_of[e] = s
        slots = slot_of[ids]                                                       # [T, k]
        use = keep & (slots >= 0)
        return self.inner(x, torch.where(use, slots, 0), torch.where(use, weights, torch.zeros_like(weights)))

    def _count(self, ids: torch.Tensor, keep: torch.Tensor) -> None:
        self.window.add(torch.bincount(ids[keep], minlength=self._num_experts).tolist())   # [E] this forward


def _gather_slots(stack: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """`stack [E, ...]` -> `[S, ...]` in slot order; an empty slot (-1) is zeros."""
    out = stack.new_zeros(len(experts), *stack.shape[1:])
    for s, e in enumerate(experts):
        if e >= 0:
            out[s] = stack[e]
    return out


def _make(w13: torch.Tensor, w2: torch.Tensor, setup: MoESetup) -> ExpertParallelMoE:
    if setup.group is None:
        raise ValueError("moe backend expert_parallel needs an EPGroup (engine.moe.ep_group) in its MoESetup")
    return ExpertParallelMoE(w13, w2, setup.group, setup.config)


register_moe_backend("expert_parallel", _make)


@torch.library.custom_op("strata::ep_moe", mutates_args=())
def _ep_moe_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    return _LAYERS[handle].run(x, topk_ids, topk_weights)


@_ep_moe_op.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x)
