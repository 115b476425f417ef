"""The paged KV cache: one block-major tensor (DESIGN §4)

    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block's K and V for every layer is one contiguous span: one transfer descriptor, one stored object.
Each layer sees two strided views (K and V) `[num_blocks, block_size, kv_heads, head_dim]` of it, made once here
so the hot path does not re-slice them every step; no copy is made.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.num_layers, self.block_size = num_blocks, num_layers, block_size
        self.tensor = torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.tensor[:, i, 0], self.tensor[:, i, 1]) for i in range(num_layers)]  # each [nb, bs, Hkv, D]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block across all layers: `[num_layers, 2, block_size, kv_heads, head_dim]`."""
        return tuple(self.tensor.shape[1:])

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def _ids(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if ids.dim() != 1:
            raise ValueError(f"block_ids must be a flat list of ints, got shape {list(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block_ids must be in [0, {self.num_blocks}), got {ids.tolist()}")
        return ids.to(self.tensor.device)

    def read_blocks(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """A contiguous copy `[n, num_layers, 2, block_size, kv_heads, head_dim]` of the given blocks."""
        return self.tensor.index_select(0, self._ids(block_ids))

    def write_blocks(self, block_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite the given blocks with `data [n, *block_shape]` (same dtype; any device)."""
        ids = self._ids(block_ids)
        expected = (ids.numel(), *self.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks data must have shape {list(expected)}, got {list(data.shape)}")
        if data.dtype != self.tensor.dtype:
            raise ValueError(f"write_blocks data must have dtype {self.tensor.dtype}, got {data.dtype}")
        self.tensor.index_copy_(0, ids, data.to(self.tensor.device))
