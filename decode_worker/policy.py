"""Conditional disaggregation (DESIGN §2 step 2): which prompts skip the prefill pool and prefill on the decode
worker. Short prompts cost less to compute than to hand over; almost fully cached ones have little left to compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Placement(NamedTuple):
    local: bool          # True: call Generate on the decode worker; False: Prefill, then Decode
    reason: str


@dataclass(frozen=True)
class ConditionalPolicy:
    """`max_local_tokens`: prompts this short prefill locally. `min_cached_fraction`: prompts whose cached share is
    at least this prefill locally, as long as the uncached rest is at most `max_local_uncached_tokens`."""

    max_local_tokens: int = 64
    min_cached_fraction: float = 0.9
    max_local_uncached_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_local_tokens < 0:
            raise ValueError(f"max_local_tokens must be >= 0, got {self.max_local_tokens}")
        if not 0.0 < self.min_cached_fraction <= 1.0:
            raise ValueError(f"min_cached_fraction must be in (0, 1], got {self.min_cached_fraction}")
        if self.max_local_uncached_tokens < 0:
            raise ValueError(f"max_local_uncached_tokens must be >= 0, got {self.max_local_uncached_tokens}")

    def place(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> Placement:
        if num_prompt_tokens <= self.max_local_tokens:
            return Placement(True, f"short prompt ({num_prompt_tokens} <= {self.max_local_tokens} tokens)")
        uncached = num_prompt_tokens - num_cached_tokens
        if (num_cached_tokens >= self.min_cached_fraction * num_prompt_tokens
                and uncached <= self.max_local_uncached_tokens):
            return Placement(True, f"almost fully cached ({num_cached_tokens}/{num_prompt_tokens} tokens)")
        return Placement(False, f"{uncached} uncached tokens: disaggregated prefill")
