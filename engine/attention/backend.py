"""The attention backend contract and its registry (STYLE habit 6).

A backend turns one `StepBatch` into its own per-step metadata (index tensors built once, shared by all layers),
and then, layer by layer, writes the step's new K/V into the paged cache and attends each query causally over its
sequence's whole history through the sequence's block table.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from engine.attention.kv_quant import QuantizedLayerKV
from engine.batch import StepBatch


class AttentionBackend(ABC):
    """Contract:

    - `build_metadata` reads only ints from the batch and makes every index tensor the step needs, on `device`;
      it does not touch the cache. The result is opaque to callers and valid for this step only.
    - `forward` first writes `k`, `v` (rows in batch token order) into the cache slots
      `block_table[pos // block_size] * block_size + pos % block_size`, then returns the attention output
      `[tokens, num_heads, head_dim]` in the same row order. Query at position p sees keys at positions <= p of
      its own sequence only; with `window=w` only those in (p - w, p] (Mistral's sliding window: w keys, its own
      included), in every path (fresh or chunked prefill, prefix hit, decode). It writes no cache slot other than
      the step's own (a quantized cache: no block other than those, see below). A backend that cannot honour a window raises; it never attends to the full history instead.
    - The layer cache is either `(K, V)`, each `[num_blocks, block_size, Hkv, D]` in the model dtype, or a
      `QuantizedLayerKV(k, v, k_scale, v_scale)` (kv_quant.py): fp8 e4m3 / int8 values of that shape plus float32
      scales `[num_blocks, Hkv]`, all strided views of one uint8 block-major span. A quantized cache is written
      with kv_quant's write rule (per (block, head) scale that only grows within a block; a block's first write
      zeroes its other slots) and read dequantized (q.float() * scale) on every path; a backend that cannot
      read one raises.
    - A backend may keep state derived from the cache across steps (torch: the running decode batch's K/V, see
      decode_buffer.py); `build_metadata` is then called once per step, before that step's `forward` calls.
      `invalidate` drops such state; callers call it after writing the cache outside `forward` or after a step
      that failed part-way.
    """

    name: str = ""

    @abstractmethod
    def build_metadata(self, batch: StepBatch, block_size: int, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> Any:
        """`dtype`: the model's activation dtype (for masks and any float metadata)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | QuantizedLayerKV, meta: Any, scale: float,
                window: int | None = None) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` (may be strided views), cache: this layer's (K, V) views, each
        `[num_blocks, block_size, Hkv, D]`, of the block-major cache, or its `QuantizedLayerKV`; `window`: this
        layer's sliding window (None: full causal attention)."""

    def invalidate(self) -> None:
        """The cache was written outside `forward` (e.g. blocks copied in): drop anything derived from it."""


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    ATTENTION_BACKENDS[name] = factory


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    import engine.attention.torch_paged  # noqa: F401  (registers 'torch')
    if name == "triton":
        import engine.attention.triton_paged  # noqa: F401  (registers 'triton'; imports triton)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; registered: {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()
