"""Packing a rank's tokens for the all-to-all of an expert-parallel layer, and unpacking what arrives.

A token goes once to every rank that holds one of its chosen experts (not once per expert, as DeepEP sends it), with
the local expert slots and routing weights it needs there. Every rank sends every other rank a block of exactly
`rows` rows (the most tokens any rank's forward has this step, agreed in `EPGroup.join_step`), so the all-to-all
needs no count exchange; unused rows are padding (every slot -1).

    one row on the wire (uint8):  | x [H] in the model dtype | slots [k] int32 (-1: none) | weights [k] float32 |

    send  [N, rows, row_bytes]    block j: the tokens that need rank j, in token order, then padding
    recv  [N, rows, row_bytes]    block j: what rank j sent here
    back  [N, rows, H]            block j: this rank's tokens' partial outputs from rank j's experts
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Dispatch(NamedTuple):
    send: torch.Tensor          # [N, rows, row_bytes] uint8
    token_of: torch.Tensor      # [N * rows] int64: the source token of each row (T for padding)


class Arrived(NamedTuple):
    """The (row, slot, weight) pairs that arrived: compute each pair's expert, sum per row."""

    x: torch.Tensor             # [N * rows, H]
    row: torch.Tensor           # [P] int64
    slot: torch.Tensor          # [P] int64: local expert slot on this rank
    weight: torch.Tensor        # [P] float32


def row_bytes(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    return hidden * dtype.itemsize + 8 * top_k


def pack(x: torch.Tensor, dest: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, world: int,
         rows: int) -> Dispatch:
    """x `[T, H]`; per pair `[T, k]`: dest rank (-1: not sent), local slot there, routing weight."""
    tokens, hidden = x.shape
    k = dest.shape[1]
    if tokens > rows:
        raise ValueError(f"expert-parallel dispatch: {tokens} tokens exceed the step's agreed {rows} rows")
    ranks = torch.arange(world, device=x.device)
    touched = (dest.unsqueeze(-1) == ranks).any(dim=1)                             # [T, N]
    pos = touched.long().cumsum(dim=0) - 1                                         # [T, N] row within block j
    t_idx, j_idx = touched.nonzero(as_tuple=True)                                  # [R] each
    flat = j_idx * rows + pos[t_idx, j_idx]                                        # [R] into N*rows
    send_x = x.new_zeros(world * rows, hidden)
    send_x[flat] = x[t_idx]
    token_of = torch.full((world * rows,), tokens, dtype=torch.int64, device=x.device)
    token_of[flat] = t_idx
    meta_slot = torch.full((world * rows, k), -1, dtype=torch.int32, device=x.device)
    meta_w = torch.zeros(world * rows, k, dtype=torch.float32, device=x.device)
    pt, pc = (dest >= 0).nonzero(as_tuple=True)                                    # [P] each
    pj = dest[pt, pc]
    pflat = pj * rows + pos[pt, pj]                                                # [P]
    meta_slot[pflat, pc] = slot[pt, pc].to(torch.int32)
    meta_w[pflat, pc] = weight[pt, pc].float()
    wire = torch.cat([send_x.view(torch.uint8), meta_slot.view(torch.uint8), meta_w.view(torch.uint8)], dim=1)
    return Dispatch(wire.view(world, rows, -1), token_of)


def unpack(recv: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype) -> Arrived:
    """`recv [N, rows, row_bytes]` -> the rows' x and their valid (row, slot, weight) pairs."""
    flat = recv.reshape(-1, recv.shape[-1])                                         # [N*rows, row_bytes]
    xb = hidden * dtype.itemsize
    x = flat[:, :xb].contiguous().view(dtype)                                      # [N*rows, H]
    slots = flat[:, xb:xb + 4 * top_k].contiguous().view(torch.int32)              # [N*rows, k]
    weights = flat[:, xb + 4 * top_k:].contiguous().view(torch.float32)            # [N*rows, k]
    row, c = (slots >= 0).nonzero(as_tuple=True)                                   # [P] each
    return Arrived(x, row, slots[row, c].long(), weights[row, c])


def combine(back: torch.Tensor, token_of: torch.Tensor, tokens: int) -> torch.Tensor:
    """`back [N, rows, H]` partial outputs -> `[T, H]`: each token's partials summed (padding rows dropped)."""
    hidden = back.shape[-1]
    out = back.new_zeros(tokens + 1, hidden)
    return out.index_add_(0, token_of, back.reshape(-1, hidden))[:tokens]          # [T, H]
