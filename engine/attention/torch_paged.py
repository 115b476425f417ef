"""Paged attention in plain torch: runs on any device, and is the reference the Triton kernels are checked against.

Decodes (one new token per sequence) go through one batched path: gather every decode sequence's blocks at once,
pad to the longest, mask the padding, one SDPA call. A pure-decode step reads K/V from a `DecodeBuffer` instead,
which only appends the new token when the step continues the last one (decode_buffer.py). Multi-token sequences
(prefill, chunked prefill, verify) loop over sequences; a fresh prefill (start_pos == 0) attends over its own new
K/V with a causal SDPA.

A layer with a sliding window (`forward(..., window=w)`) attends through masks that also hide keys at positions
<= p - w. They are made once per step and window, by the first layer that asks (`TorchPagedMetadata.windows`), and
only where the window is shorter than the context; full-attention layers take exactly the paths above.

    query p, window w:   keys | 0 ... p-w | p-w+1 ... p | p+1 ...
                              |  hidden   |   visible   | hidden (causal)

    flat batch rows:  | seq0 (prefill, rows 0..n0) | seq1 (decode) | seq2 (decode) | seq3 (chunk, start_pos>0) |
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, register_attention_backend
from engine.attention.decode_buffer import DecodeBuffer
from engine.batch import StepBatch


@dataclass(frozen=True)
class PrefillSeq:
    row_start: int
    row_end: int
    context_len: int                    # start_pos + new tokens
    block_ids: torch.Tensor | None      # [ceil(context_len / bs)]; None for a fresh prefill (no cached prefix)
    mask: torch.Tensor | None           # [new, context_len] additive (0 / -inf); None for a fresh prefill


@dataclass(frozen=True)
class TorchPagedMetadata:
    write_blocks: torch.Tensor          # [T] block id of each new token's slot
    write_offsets: torch.Tensor         # [T] offset inside that block
    decode_rows: torch.Tensor | None    # [Bd] rows of decode tokens; None when every row is a decode
    decode_tables: torch.Tensor | None  # [Bd * max_blocks] block ids row by row, padded with 0 (masked out)
    decode_mask: torch.Tensor | None    # [Bd, 1, 1, max_blocks * bs] additive: 0 valid key, -inf padding
    prefills: tuple[PrefillSeq, ...]
    buffer_append: bool | None = None   # pure decode: True append to the DecodeBuffer, False rebuild it
    decode_pos: torch.Tensor | None = None   # [Bd] position of each decode token (for the buffer append)
    decode_ctx: tuple[int, ...] = ()    # context length of each decode row (host ints, for window masks)
    # NOTE: filled during the step, not by build_metadata: the backend learns a layer's window only in forward.
    windows: dict[int, WindowMasks] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowMasks:
    """One sliding window's additive masks (0 / -inf) for one step."""

    decode: torch.Tensor | None                  # [Bd, 1, 1, S] like decode_mask; None when there are no decodes
    prefills: tuple[torch.Tensor | None, ...]    # per PrefillSeq, [n, context_len]; None: plain causal covers it


def _write_indices(batch: StepBatch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset) `[T]` each of every new token's cache slot, without a per-token Python loop."""
    seqs = batch.seqs
    if all(len(s.token_ids) == 1 for s in seqs):       # pure decode: one slot per sequence
        return (torch.tensor([s.block_table[s.start_pos // block_size] for s in seqs], dtype=torch.int64),
                torch.tensor([s.start_pos % block_size for s in seqs], dtype=torch.int64))
    positions: list[int] = []
    for s in seqs:
        positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
    pos = torch.tensor(positions, dtype=torch.int64)                                         # [T]
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])  # [S, W]
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s.token_ids) for s in seqs]))
    return tables[seq_of, pos // block_size], pos % block_size                               # [T] each


def _decode_tensors(tables: list[list[int]], ctx: list[int], block_size: int, device: torch.device,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # [Bd, width]
    key_pos = torch.arange(width * block_size)                                                 # [S]
    valid = key_pos[None, :] < torch.tensor(ctx)[:, None]                                      # [Bd, S]
    # NOTE: additive float mask made once per step; a bool mask is converted by SDPA in every layer.
    mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))           # [Bd, S]
    return padded.flatten().to(device), mask[:, None, None, :].to(device)


def _windowed_decode_mask(mask: torch.Tensor, ctx: tuple[int, ...], window: int) -> torch.Tensor:
    """`mask` `[Bd, 1, 1, S]` with each row's keys at positions < ctx - window hidden as well."""
    if window >= max(ctx):
        return mask
    first = torch.tensor(ctx, device=mask.device) - window                           # [Bd] oldest visible key
    old = torch.arange(mask.shape[-1], device=mask.device)[None, :] < first[:, None]  # [Bd, S]
    return mask.masked_fill(old[:, None, None, :], float("-inf"))


def _windowed_prefill_mask(seq: PrefillSeq, window: int, device: torch.device,
                           dtype: torch.dtype) -> torch.Tensor | None:
    """`[n, context_len]` causal + window mask of one multi-token sequence; its plain mask when the window reaches
    back to position 0 for every query (window >= context_len)."""
    if window >= seq.context_len:
        return seq.mask
    q_pos = torch.arange(seq.context_len - (seq.row_end - seq.row_start), seq.context_len, device=device)  # [n]
    k_pos = torch.arange(seq.context_len, device=device)[None, :]                                    # [1, ctx]
    visible = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)                           # [n, ctx]
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def _window_masks(meta: TorchPagedMetadata, window: int, device: torch.device, dtype: torch.dtype) -> WindowMasks:
    if window not in meta.windows:
        decode = None if meta.decode_mask is None else _windowed_decode_mask(meta.decode_mask, meta.decode_ctx,
                                                                               window)
        meta.windows[window] = WindowMasks(
            decode, tuple(_windowed_prefill_mask(seq, window, device, dtype) for seq in meta.prefills))
    return meta.windows[window]


def _prefill_seq(row: int, start: int, n: int, table: list[int], block_size: int, device: torch.device,
                 dtype: torch.dtype) -> PrefillSeq:
    ctx = start + n
    if start == 0:
        return PrefillSeq(row, row + n, ctx, None, None)
    blocks = torch.tensor(table[: (ctx + block_size - 1) // block_size], dtype=torch.int64, device=device)
    q_pos = torch.arange(start, ctx, device=device)                                 # [n]
    visible = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]           # [n, ctx]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return PrefillSeq(row, row + n, ctx, blocks, mask)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self.buffer = DecodeBuffer()

    def invalidate(self) -> None:
        self.buffer.invalidate()

    def build_metadata(self, batch: StepBatch, block_size: int, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> TorchPagedMetadata:
        blocks, offsets = _write_indices(batch, block_size)
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_ctx: list[int] = []
        prefills: list[PrefillSeq] = []
        row = 0
        for seq in batch.seqs:
            n = len(seq.token_ids)
            ctx = seq.start_pos + n
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(seq.block_table[: (ctx + block_size - 1) // block_size])
                dec_ctx.append(ctx)
            else:
                prefills.append(_prefill_seq(row, seq.start_pos, n, seq.block_table, block_size, device, dtype))
            row += n
        tables = mask = rows = None
        if dec_rows:
            tables, mask = _decode_tensors(dec_tables, dec_ctx, block_size, device, dtype)
            if prefills:
                rows = torch.tensor(dec_rows, dtype=torch.int64, device=device)
        append = self.buffer.plan(None if prefills else batch.seqs, block_size)
        meta = TorchPagedMetadata(blocks.to(device), offsets.to(device), rows, tables, mask, tuple(prefills),
                                  decode_ctx=tuple(dec_ctx))
        if prefills:
            return meta
        pos = torch.tensor([s.start_pos for s in batch.seqs], dtype=torch.int64, device=device)   # [Bd]
        return dataclasses.replace(meta, buffer_append=append, decode_pos=pos)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], meta: TorchPagedMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        k_cache, v_cache = cache                               # each [num_blocks, bs, Hkv, D]
        k_cache[meta.write_blocks, meta.write_offsets] = k     # NOTE: write first: decodes read their own token
        v_cache[meta.write_blocks, meta.write_offsets] = v
        masks = None if window is None else _window_masks(meta, window, q.device, q.dtype)
        decode_mask = meta.decode_mask if masks is None else masks.decode
        if not meta.prefills:
            keys, values = self._buffered_kv(k, v, k_cache, v_cache, meta)
            return _attend_decode(q, keys, values, decode_mask, scale)
        out = q.new_empty(q.shape)                             # [T, Hq, D]
        for i, seq in enumerate(meta.prefills):
            mask = seq.mask if masks is None else masks.prefills[i]
            out[seq.row_start:seq.row_end] = _prefill(q, k, v, k_cache, v_cache, seq, mask, scale)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache,
                                            meta.decode_tables, decode_mask, scale)
        return out

    def _buffered_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: TorchPagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[Bd, Hkv, S, D]` of a pure-decode step, from the DecodeBuffer (appended or rebuilt)."""
        bsz, span = k.shape[0], meta.decode_mask.shape[-1]
        k_buf, v_buf = self.buffer.layer(k_cache)                          # [rows, Hkv, capacity, D] each
        if meta.buffer_append:
            rows = torch.arange(bsz, device=k.device)
            k_buf[rows, :, meta.decode_pos] = k                            # [Bd, Hkv, D] at each row's position
            v_buf[rows, :, meta.decode_pos] = v
        else:
            k_buf[:bsz, :, :span].copy_(_gather(k_cache, meta.decode_tables, bsz))
            v_buf[:bsz, :, :span].copy_(_gather(v_cache, meta.decode_tables, bsz))
        return k_buf[:bsz, :, :span], v_buf[:bsz, :, :span]


def _gather(cache: torch.Tensor, tables: torch.Tensor, bsz: int) -> torch.Tensor:
    """`[Bd, Hkv, S, D]` view of the blocks `tables` (row by row) copied out of one layer's K or V cache."""
    # NOTE: index_select copies whole block rows; advanced indexing of the strided per-layer view was 2-4x
    # slower on CPU (measured: 32 sequences x 5 blocks x 4 layers, ~2 ms vs 3.6-9.6 ms).
    _, _, hkv, dim = cache.shape
    return cache.index_select(0, tables).view(bsz, -1, hkv, dim).transpose(1, 2)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            mask: torch.Tensor, scale: float) -> torch.Tensor:
    bsz = q.shape[0]
    return _attend_decode(q, _gather(k_cache, tables, bsz), _gather(v_cache, tables, bsz), mask, scale)


def _attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One new token per sequence over keys/values `[Bd, Hkv, S, D]`. GQA without repeating K/V: the query heads
    of one KV head become the 'query length' axis, which is legal here because a single decode token needs no
    causal mask. (SDPA beat two bmm + softmax here: 1 thread, batch 32, S=96: 0.58 vs 0.76-1.0 ms.)"""
    bsz, hq, dim = q.shape
    hkv = keys.shape[1]
    queries = q.reshape(bsz, hkv, hq // hkv, dim)             # [Bd, Hkv, G, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)  # [Bd, Hkv, G, D]
    return out.reshape(bsz, hq, dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             seq: PrefillSeq, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`mask` `[n, context_len]` additive, or None for a fresh prefill's plain causal attention."""
    rows = slice(seq.row_start, seq.row_end)
    queries = q[rows].transpose(0, 1).unsqueeze(0)                                  # [1, Hq, n, D]
    if seq.block_ids is None:
        keys, values = k[rows], v[rows]                                             # [n, Hkv, D]
    else:
        keys = k_cache.index_select(0, seq.block_ids).flatten(0, 1)[: seq.context_len]    # [ctx, Hkv, D]
        values = v_cache.index_select(0, seq.block_ids).flatten(0, 1)[: seq.context_len]
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)                                                   # [n, Hq, D]


register_attention_backend("torch", TorchPagedAttention)
