"""Rotary position embeddings: inverse frequencies per scaling type, and a precomputed cos/sin table.

The table is indexed by absolute position once per step (shared by every layer), so the hot path does one
gather and two multiply-adds per q/k tensor.

Dynamic NTK is computed per sequence, never from what other requests did. transformers rebuilds the frequencies
at every forward from that forward's `max(position) + 1`: generate's one prompt forward rotates every prompt
token with the base for the prompt length L, and each one-token decode forward rotates its token at p with the
base for p + 1. Strata gives the token at position p of a sequence the length `max(L, p + 1)`, whichever step
computes it (one prefill, a chunk, the tail after a prefix-cache hit, a recompute after preemption):

    position  0 ................ L-1 | L     L+1   ...
    length    L ................ L   | L+1   L+2   ...      (lengths <= max_position_embeddings: default RoPE)

so chunked and prefix-cached prefills equal transformers' single-forward prefill. L comes from the scheduled
sequence's `prompt_len`; without it, from the step (`start_pos + len(token_ids)`, exact when the prompt is
computed in one step: see `ntk_floor`). The KV of a prompt longer than max_position_embeddings then depends on
L, which is why the prefix cache must key such blocks by L (`ModelSpec.prefix_cache_salt`).

    rotate_half(x) * sin  ==  swap_halves(x) * signed_sin      (exactly: negation is exact in floating point)
    x = | x1 | x2 |   swap_halves(x) = | x2 | x1 |   signed_sin = | -sin1 | sin2 |
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from engine.batch import ScheduledSeq
from engine.models.spec import RopeSpec


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _llama3(rope: RopeSpec, dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    factor, low, high = rope.get("factor"), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", max_pos)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(rope: RopeSpec, factor: float) -> float:
    given, mscale, mscale_all = rope.get("attention_factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if given is not None:
        return float(given)
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn(rope: RopeSpec, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    old_len = rope.get("original_max_position_embeddings", max_pos)
    factor = rope.get("factor") or max_pos / old_len
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, dim, rope.theta, old_len)
    high = _yarn_correction_dim(beta_slow, dim, rope.theta, old_len)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim/2]
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, _yarn_attention_factor(rope, factor)


def _dynamic(rope: RopeSpec, dim: int, max_pos: int, seq_len: int) -> torch.Tensor:
    # NOTE: within max_position_embeddings dynamic NTK equals the default RoPE (as in transformers); past it the
    # base grows with the sequence length (see the module docstring for whose length).
    factor, seq_len = rope.get("factor"), max(seq_len, max_pos)
    base = rope.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def _dynamic_per_token(rope: RopeSpec, dim: int, max_pos: int, lengths: torch.Tensor) -> torch.Tensor:
    """Inverse frequencies `[T, dim/2]` for int64 `lengths [T]`, in transformers' float32 tensor arithmetic (its
    generate passes the length as a tensor), so the tokens match its rotation to the last bit where it can."""
    factor, lengths = rope.get("factor"), lengths.clamp(min=max_pos)
    base = rope.theta * ((factor * lengths / max_pos) - (factor - 1)) ** (dim / (dim - 2))         # [T] float32
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=lengths.device).float() / dim    # [dim/2]
    return 1.0 / (base[:, None] ** exponents[None, :])                                           # [T, dim/2]


def ntk_floor(seq: ScheduledSeq) -> int:
    """L of the module docstring: the length every token of `seq` at a position below it is rotated for."""
    # NOTE: a batch built by hand may leave prompt_len 0: the step's end then stands in for it (exact when the
    # prompt is computed in one step)
    return seq.prompt_len or seq.start_pos + len(seq.token_ids)


def inv_freq_and_scale(rope: RopeSpec, dim: int, max_pos: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim/2]` and the cos/sin scale for this rope type."""
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.get("factor"), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, dim, max_pos), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_pos)
    if rope.rope_type == "dynamic":
        return _dynamic(rope, dim, max_pos, seq_len), 1.0
    return _base_inv_freq(rope.theta, dim), 1.0


class RotaryTable:
    """cos/sin for positions `[0, length)`, grown on demand (doubling) when a step reaches past the end.

    For dynamic NTK the table holds the default (base theta) rotation, which every token whose length is within
    max_position_embeddings uses; `lookup_dynamic` computes the others per token."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_pos: int, device: torch.device,
                 dtype: torch.dtype, initial_length: int = 4096) -> None:
        self.rope, self.head_dim, self.max_pos = rope, head_dim, max_pos
        self.device, self.dtype = device, dtype
        self.dynamic = rope.rope_type == "dynamic"
        self.length = 0
        self._build(min(max(initial_length, 1), max_pos))

    def _build(self, length: int) -> None:
        # seq_len = max_pos: the table never depends on how long any sequence has grown (only dynamic reads it)
        inv_freq, scale = inv_freq_and_scale(self.rope, self.head_dim, self.max_pos, self.max_pos)
        pos = torch.arange(length, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]                          # [length, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                           # [length, dim]
        self.cos = (emb.cos() * scale).to(self.device, self.dtype)
        self.sin = (emb.sin() * scale).to(self.device, self.dtype)
        half = self.head_dim // 2
        self.signed_sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)   # [length, dim]
        self.length = length

    def ensure(self, length: int) -> None:
        if length > self.length:
            self._build(max(length, 2 * self.length))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[tokens, 1, head_dim]` for int64 `positions [tokens]` (call `ensure` first)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def lookup_signed(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin `[tokens, 1, head_dim]` for `apply_rotary` (call `ensure` first)."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def lookup_dynamic(self, positions: torch.Tensor,
                       seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin `[tokens, 1, head_dim]` of dynamic NTK for the flat `positions` of `seqs` (in order), each
        token rotated for its own sequence's length (module docstring)."""
        floors = [ntk_floor(s) for s in seqs]
        longest = max(max(f, s.start_pos + len(s.token_ids)) for f, s in zip(floors, seqs))
        self.ensure(min(longest, self.max_pos))
        if longest <= self.max_pos:
            return self.lookup_signed(positions)                       # the common case: no token is scaled
        counts = torch.tensor([len(s.token_ids) for s in seqs])
        floor = torch.repeat_interleave(torch.tensor(floors), counts).to(positions.device)      # [T]
        lengths = torch.maximum(floor, positions + 1)                                           # [T]
        cos, signed_sin = self._rotation(positions, _dynamic_per_token(self.rope, self.head_dim, self.max_pos,
                                                                       lengths))
        # NOTE: unscaled tokens keep the table's values exactly, so a short request's tokens do not depend on
        # whether a long one shares its step.
        scaled = (lengths > self.max_pos)[:, None]                                              # [T, 1]
        table = positions.clamp(max=self.length - 1)
        cos = torch.where(scaled, cos, self.cos[table])                                         # [T, D]
        signed_sin = torch.where(scaled, signed_sin, self.signed_sin[table])
        return cos.unsqueeze(1), signed_sin.unsqueeze(1)

    def _rotation(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin `[T, D]` for `positions [T]` with per-token `inv_freq [T, D/2]` (as `_build`)."""
        freqs = positions.float()[:, None] * inv_freq                                           # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                                 # [T, D]
        sin, half = emb.sin(), self.head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)                         # [T, D]
        return emb.cos().to(self.dtype), signed_sin.to(self.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x `[tokens, heads, head_dim]` rotated by the half-split convention of Llama/Qwen checkpoints; `signed_sin`
    from `RotaryTable.lookup_signed`. Bit-identical to `x * cos + rotate_half(x) * sin`, in three ops, not five."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)               # [tokens, heads, head_dim] copy
    return (x * cos).add_(swapped.mul_(signed_sin))
