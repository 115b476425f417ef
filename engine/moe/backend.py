"""The MoE expert-execution contract and its registry (`local`, `expert_parallel`).

Routing is not the backend's business: the model computes top-k ids and weights, the backend runs the experts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from engine.config import MoEConfig


class MoEBackend(nn.Module, ABC):
    """Contract:

    - Built from STACKED expert weights: `w13 [E, 2*I, H]` (gate rows then up rows, as one matmul) and
      `w2 [E, H, I]`. An expert-parallel backend may keep only its own experts' slices.
    - `forward(x [T, H], topk_ids [T, k] int64, topk_weights [T, k])` returns `[T, H]` in x's dtype:
      for every token, sum over its k experts of `weight * down(silu(gate(x)) * up(x))`. A token's k ids are
      distinct (top-k's always are).
    - Tokens are independent: the result for one token does not depend on the others in the batch
      (so batching never changes numerics beyond float rounding). It does not modify its inputs.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2]:
            raise ValueError(f"expert weights must be w13 [E, 2I, H] and w2 [E, H, I], got "
                             f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @abstractmethod
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ...


class MoESetup(NamedTuple):
    """What builds a model's sparse layers: the config, and for `expert_parallel` the group of ranks
    (`engine.moe.ep_group.EPGroup`)."""

    config: MoEConfig = MoEConfig()
    group: Any = None

    @classmethod
    def of(cls, value: MoESetup | str | None) -> MoESetup:
        """A setup from a backend name (the older argument), None (local) or a setup."""
        if isinstance(value, MoESetup):
            return value
        return cls(MoEConfig(backend=value or "local"))


MoEFactory = Callable[[torch.Tensor, torch.Tensor, MoESetup], MoEBackend]
MOE_BACKENDS: dict[str, MoEFactory] = {}


def register_moe_backend(name: str, factory: MoEFactory) -> None:
    MOE_BACKENDS[name] = factory


def make_moe_backend(setup: MoESetup | str, w13: torch.Tensor, w2: torch.Tensor) -> MoEBackend:
    import engine.moe.local  # noqa: F401  (registers 'local')
    import engine.moe.expert_parallel  # noqa: F401  (registers 'expert_parallel')
    setup = MoESetup.of(setup)
    name = setup.config.backend
    if name not in MOE_BACKENDS:
        raise ValueError(f"moe backend {name!r} is unknown; registered: {sorted(MOE_BACKENDS)}")
    return MOE_BACKENDS[name](w13, w2, setup)
