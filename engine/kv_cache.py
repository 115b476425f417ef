"""The paged KV cache: block-major (DESIGN §4), so one block's K and V for every layer is one contiguous span: one
transfer descriptor, one stored object. Each layer sees views of it, made once here so the hot path does not
re-slice them every step; no copy is made.

Unquantized (the model dtype): one typed tensor, each layer a (K, V) pair `[num_blocks, block_size, kv_heads, D]`

    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Quantized (fp8 e4m3 / int8, engine/attention/kv_quant.py): one uint8 tensor `[num_blocks, span]`, each block's span

    | scales: float32 [num_layers, 2, kv_heads] | values: fp8/int8 [num_layers, 2, block_size, kv_heads, head_dim] |

and each layer a `QuantizedLayerKV(k, v, k_scale, v_scale)`. Scales come first so that the codec's `scales` section
followed by its `payload` section is exactly one span (header | tokens | scales | payload, kvstore/codec.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.attention.kv_quant import QUANTIZED_DTYPES, QuantizedLayerKV


class KVCache:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """`dtype`: what K/V are stored in: the model dtype, or float8_e4m3fn / int8 (quantized, with scales)."""
        self.num_blocks, self.num_layers, self.block_size = num_blocks, num_layers, block_size
        self.dtype, self.quantized = dtype, dtype in QUANTIZED_DTYPES
        values = (num_layers, 2, block_size, num_kv_heads, head_dim)
        if not self.quantized:
            self.scale_bytes = 0
            self.tensor = torch.zeros(num_blocks, *values, dtype=dtype, device=device)
            self.layers: list = [(self.tensor[:, i, 0], self.tensor[:, i, 1]) for i in range(num_layers)]
            return
        self.scale_bytes = num_layers * 2 * num_kv_heads * 4
        span = self.scale_bytes + num_layers * 2 * block_size * num_kv_heads * head_dim
        if span % 4:
            raise ValueError(f"a quantized KV block span must be a multiple of 4 bytes (float32 scales), got {span} "
                             f"(head_dim {head_dim} x block_size {block_size} x kv_heads {num_kv_heads} is odd)")
        self.tensor = torch.zeros(num_blocks, span, dtype=torch.uint8, device=device)
        scales = self.tensor[:, :self.scale_bytes].view(torch.float32).view(num_blocks, num_layers, 2, num_kv_heads)
        kv = self.tensor[:, self.scale_bytes:].view(dtype).view(num_blocks, *values)
        self.layers = [QuantizedLayerKV(kv[:, i, 0], kv[:, i, 1], scales[:, i, 0], scales[:, i, 1])
                       for i in range(num_layers)]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as `read_blocks` returns it: `[num_layers, 2, block_size, kv_heads, head_dim]`, or
        `[span]` (bytes) when quantized."""
        return tuple(self.tensor.shape[1:])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's span (scales and values when quantized)."""
        return self.tensor[0].numel() * self.tensor.element_size()

    def _ids(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if ids.dim() != 1:
            raise ValueError(f"block_ids must be a flat list of ints, got shape {list(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block_ids must be in [0, {self.num_blocks}), got {ids.tolist()}")
        return ids.to(self.tensor.device)

    def read_blocks(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """A contiguous copy `[n, *block_shape]` of the given blocks' whole spans (uint8 when quantized)."""
        return self.tensor.index_select(0, self._ids(block_ids))

    def write_blocks(self, block_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite the given blocks' spans with `data [n, *block_shape]` (the cache tensor's dtype; any device)."""
        ids = self._ids(block_ids)
        expected = (ids.numel(), *self.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks data must have shape {list(expected)}, got {list(data.shape)}")
        if data.dtype != self.tensor.dtype:
            raise ValueError(f"write_blocks data must have dtype {self.tensor.dtype}, got {data.dtype}")
        _write_rows(self.tensor, ids, data.to(self.tensor.device))


# NOTE: on the CPU `index_copy_` moves a block's span element by element: 124 fp32 blocks of 64 KiB took 0.66-0.8 ms,
# a slice `copy_` of the same bytes 0.26 ms and `index_copy_` over 16-byte elements 0.41 (1 thread). Blocks a load
# installs are mostly consecutive ids (taken from the free list together), so runs are copied as slices.
_MAX_RUNS_SHARE = 8   # at most one run per this many blocks, else one wide index_copy_


def _write_rows(dst: torch.Tensor, ids: torch.Tensor, data: torch.Tensor) -> None:
    """`dst[ids] = data` along dim 0 (ids distinct)."""
    n = ids.numel()
    if dst.device.type != "cpu" or n == 0:
        dst.index_copy_(0, ids, data)
        return
    flat = ids.tolist()
    starts = [0] + [i for i in range(1, n) if flat[i] != flat[i - 1] + 1]
    if len(starts) * _MAX_RUNS_SHARE <= max(n, _MAX_RUNS_SHARE):
        for a, b in zip(starts, [*starts[1:], n]):
            dst[flat[a]:flat[a] + b - a].copy_(data[a:b])
        return
    wide_dst, wide_data = _wide(dst), _wide(data)
    if wide_dst is not None and wide_data is not None:
        wide_dst.index_copy_(0, ids, wide_data)
    else:
        dst.index_copy_(0, ids, data)


def _wide(rows: torch.Tensor) -> torch.Tensor | None:
    """`rows` `[n, ...]` as `[n, bytes / 16]` of 16-byte elements (a view), or None when its layout has no such
    view (a row not contiguous, or not 16-byte aligned)."""
    try:
        return rows.flatten(1).view(torch.uint8).view(torch.complex128)
    except RuntimeError:
        return None


def gather_rows(rows: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    """`rows[indices]` along dim 0 as a new tensor, copied over 16-byte elements where the rows allow it (on the
    CPU `index_select` of uint8 rows moved ~0.7 ms for 124 rows of 68 KiB, over 16-byte elements ~0.37)."""
    index = torch.as_tensor(indices, dtype=torch.long, device=rows.device)
    wide = _wide(rows) if rows.device.type == "cpu" else None
    if wide is None:
        return rows.index_select(0, index)
    return wide.index_select(0, index).view(rows.dtype).view(len(indices), *rows.shape[1:])
