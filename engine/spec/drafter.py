"""The drafter interface: propose up to k tokens per decoding request; the target verifies them (verify.py).

A drafter sees requests as bookkeeping (their token ids) and returns `Proposal`s. A deterministic drafter (n-gram
lookup, a greedy draft) returns no distribution: its tokens are point masses, which verification treats exactly as
rejection sampling with q = one-hot. A sampling drafter returns q, the distribution each token was drawn from.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple, Sequence

import torch

from engine.request import Request


class Proposal(NamedTuple):
    token_ids: list[int]                 # proposed continuation, [] when the drafter has nothing
    probs: torch.Tensor | None = None    # [len(token_ids), vocab] float32 q of each draw; None: point masses


class DraftInput(NamedTuple):
    request: Request
    num_tokens: int                      # how many to propose (>= 1)
    sampled: bool                        # draw from q (the request samples) rather than take q's argmax


class StepFeatures(NamedTuple):
    """The target's last hidden states (before its final norm) of one verified step, for drafters that read them:
    `hidden[rows[i]:rows[i] + counts[i]]` are positions `starts[i] ..` of `request_ids[i]`."""

    request_ids: list[str]
    starts: list[int]
    rows: list[int]
    counts: list[int]
    hidden: torch.Tensor                 # [tokens of the step, H]


class Drafter(ABC):
    """Contracts: `propose` returns one Proposal per input, each at most `num_tokens` long, and never changes a
    request; a drafter keeps its own state per request id until `release(request_id)` (safe for unknown ids)."""

    name: str = ""
    needs_features: bool = False         # wants `observe` with the target's hidden states after every step

    @abstractmethod
    def propose(self, inputs: Sequence[DraftInput], seeds: Sequence[int | None]) -> list[Proposal]:
        """`seeds[i]`: the request's seed (sampled drafts draw U(seed, position, stream) then), or None."""

    def observe(self, features: StepFeatures) -> None:
        """The target computed these positions (only the verified ones are listed)."""

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop its state."""
