"""`DecodeBuffer`: the running decode batch's K/V kept contiguous between steps, so a steady-state decode step
appends one token per sequence instead of re-gathering every block of every sequence from the paged cache.

The paged cache stays the source of truth. A step *continues* the last one when it is a pure decode of the same
requests in the same order, each one position further, with the old blocks unchanged in each block table; any
other step (new or finished requests, a prefill, a cache write outside forward) rebuilds the buffer from the cache
with one gather per layer, which is what every step cost before (measured, 1 thread, batch 32, context 96: the
two K/V gathers were ~0.7 ms of a ~4 ms layer).

    per layer, K and V each:  [rows, Hkv, capacity, D]   (the layout SDPA reads, no copy per step)
    row b:  | 0 .. start_pos-1 (kept from earlier steps) | start_pos (written this step) | stale or zero ... |
                                                                                          ^ masked out
    A sliding-window layer keeps every position too; its step mask also hides positions <= start_pos - window
    (torch_paged.WindowMasks), so the buffer's layout and continuation rule do not depend on windows.

A quantized cache (fp8/int8 with per-block scales) is buffered dequantized, in the model dtype. Its write rule
re-quantizes a block's older slots when the block's scale grows, so a continuing step re-copies each row's whole
current block (block_size positions, dequantized) instead of appending one token; the buffer stays exact, and no
other block changes (torch_paged._copy_current_blocks).

NOTE: the cost is memory: a second, padded copy of the running batch's K/V for every layer (rows x capacity
positions, capacity = the longest context rounded up to 256), kept between steps and never shrunk. For the
bundled model at 32 sequences of <= 256 tokens that is 32 MiB; a memory budget should count it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import ScheduledSeq

_CAPACITY_STEP = 256    # positions; capacity grows in these steps so that a rebuild for growth is rare


@dataclass(frozen=True)
class DecodeRows:
    """Host-side identity of one pure-decode step: what the next step must extend to continue it."""

    request_ids: tuple[str, ...]
    start_pos: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]      # each row's blocks up to and including its current one

    def continued_by(self, other: DecodeRows) -> bool:
        return (self.request_ids == other.request_ids
                and all(p + 1 == q for p, q in zip(self.start_pos, other.start_pos))
                and all(new[:len(old)] == old for old, new in zip(self.tables, other.tables)))


class DecodeBuffer:
    """Contract: `plan` is called once per step (with None for a step that is not a pure decode) before any
    layer's `keys_values`; a buffer it answers `True` for holds, for every row and layer, the K/V of positions
    `< start_pos` exactly as the cache does. `invalidate` must be called after any cache write outside forward."""

    def __init__(self) -> None:
        self._last: DecodeRows | None = None
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # cache view data_ptr -> (K, V) buffers
        self.rows = self.capacity = 0

    def invalidate(self) -> None:
        self._last = None

    def plan(self, seqs: list[ScheduledSeq] | None, block_size: int) -> bool:
        """Record this step; True when it continues the last one (append), False when the buffer must be rebuilt."""
        if seqs is None:
            self._last = None
            return False
        rows = DecodeRows(tuple(s.request_id for s in seqs), tuple(s.start_pos for s in seqs),
                          tuple(tuple(s.block_table[: s.start_pos // block_size + 1]) for s in seqs))
        needed = max(len(t) for t in rows.tables) * block_size
        grow = len(seqs) > self.rows or needed > self.capacity
        if grow:
            self.rows = max(len(seqs), self.rows)
            self.capacity = max(self.capacity, -(-needed // _CAPACITY_STEP) * _CAPACITY_STEP)
            self._layers.clear()
        last, self._last = self._last, rows
        return not grow and last is not None and last.continued_by(rows)

    def layer(self, cache_view: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) buffers `[rows, Hkv, capacity, D]` in `dtype` (the model's) of the layer whose K cache view is
        `cache_view`."""
        key = cache_view.data_ptr()
        if key not in self._layers:
            _, _, hkv, dim = cache_view.shape
            # NOTE: zeros, not empty: masked positions still enter q.k, and garbage could be NaN.
            self._layers[key] = tuple(cache_view.new_zeros(self.rows, hkv, self.capacity, dim, dtype=dtype)
                                      for _ in range(2))
        return self._layers[key]
