"""Paged attention in plain torch: runs on any device, and is the reference the Triton kernels are checked against.

Decodes (one new token per sequence) go through one batched path: gather every decode sequence's blocks at once,
pad to the longest, mask the padding, one SDPA call. A pure-decode step reads K/V from a `DecodeBuffer` instead,
which only appends the new token when the step continues the last one (decode_buffer.py). Multi-token sequences
(prefill, chunked prefill, verify) loop over sequences; a fresh prefill (start_pos == 0) attends over its own new
K/V with a causal SDPA.

A quantized layer cache (`QuantizedLayerKV`, fp8/int8 with per-block, per-head scales; kv_quant.py) is written with
the write rule of kv_quant.py and read back dequantized, on every path, a fresh prefill included: the fresh prefill
writes its K/V and then attends over what the cache now holds, not over its own unquantized K/V. So every query
sees exactly the K/V a later step (a decode, a prefix-cache hit, another worker's install) will read, and a prompt
whose prefix came from the cache attends over the same bytes as one computed in the same call. (What remains is
what quantization makes unavoidable: a block written over several calls, by chunks or decode appends,
re-quantizes its older rows when its scale grows, so its bytes depend on how the writes were split.) The
DecodeBuffer stays exact: an append writes the new token as the cache holds it (dequantized), and re-copies the
whole current block of each row whose block the write re-quantized (its scale grew: its older slots changed too;
no other block ever changes).

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

from engine.attention import kv_quant
from engine.attention.backend import AttentionBackend, register_attention_backend
from engine.attention.decode_buffer import DecodeBuffer
from engine.attention.kv_quant import QuantizedLayerKV
from engine.batch import StepBatch


@dataclass(frozen=True)
class PrefillSeq:
    row_start: int
    row_end: int
    context_len: int                    # start_pos + new tokens
    block_ids: torch.Tensor             # [ceil(context_len / bs)] (a fresh prefill reads them when quantized)
    mask: torch.Tensor | None           # [new, context_len] additive (0 / -inf); None for a fresh prefill

    @property
    def fresh(self) -> bool:
        return self.context_len == self.row_end - self.row_start


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
    # NOTE: filled during the step, not by build_metadata: the backend learns a layer's window (and whether the
    # cache is quantized) only in forward.
    windows: dict[int, WindowMasks] = field(default_factory=dict)
    quant_plan: list[kv_quant.WritePlan] = field(default_factory=list)   # empty, or the step's one write plan

    def write_plan(self) -> kv_quant.WritePlan:
        if not self.quant_plan:
            self.quant_plan.append(kv_quant.write_plan(self.write_blocks, self.write_offsets))
        return self.quant_plan[0]


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
    blocks = torch.tensor(table[: (ctx + block_size - 1) // block_size], dtype=torch.int64, device=device)
    if start == 0:
        return PrefillSeq(row, row + n, ctx, blocks, None)
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
                cache: tuple[torch.Tensor, torch.Tensor] | QuantizedLayerKV, meta: TorchPagedMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        requantized = self.write(k, v, cache, meta)      # NOTE: write first: decodes read their own token
        return self.attend(q, k, v, cache, meta, scale, window, requantized)

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | QuantizedLayerKV,
              meta: TorchPagedMetadata) -> torch.Tensor | None:
        """The step's K/V into the cache; for a quantized cache, the blocks `[P]` whose older slots changed."""
        if isinstance(cache, QuantizedLayerKV):
            return kv_quant.write_kv(k, v, cache, meta.write_plan())
        k_cache, v_cache = cache                                   # each [num_blocks, bs, Hkv, D]
        k_cache[meta.write_blocks, meta.write_offsets] = k
        v_cache[meta.write_blocks, meta.write_offsets] = v
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: TorchPagedMetadata,
               scale: float, window: int | None, requantized: torch.Tensor | None) -> torch.Tensor:
        """Attention over what the cache holds after `write` (`[T, Hq, D]`)."""
        masks = None if window is None else _window_masks(meta, window, q.device, q.dtype)
        decode_mask = meta.decode_mask if masks is None else masks.decode
        if not meta.prefills:
            keys, values = self._buffered_kv(k, v, cache, meta, requantized)
            return _attend_decode(q, keys, values, decode_mask, scale)
        out = q.new_empty(q.shape)                             # [T, Hq, D]
        for i, seq in enumerate(meta.prefills):
            mask = seq.mask if masks is None else masks.prefills[i]
            out[seq.row_start:seq.row_end] = _prefill(q, k, v, cache, seq, mask, scale)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = _decode(q[meta.decode_rows], cache, meta.decode_tables, decode_mask, scale)
        return out

    def _buffered_kv(self, k: torch.Tensor, v: torch.Tensor, cache, meta: TorchPagedMetadata,
                     requantized: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[Bd, Hkv, S, D]` of a pure-decode step, from the DecodeBuffer (appended or rebuilt)."""
        bsz, span = k.shape[0], meta.decode_mask.shape[-1]
        k_buf, v_buf = self.buffer.layer(cache[0], k.dtype)               # [rows, Hkv, capacity, D] each
        if not meta.buffer_append:
            k_buf[:bsz, :, :span].copy_(_gather(cache, 0, meta.decode_tables, bsz, k.dtype))
            v_buf[:bsz, :, :span].copy_(_gather(cache, 1, meta.decode_tables, bsz, k.dtype))
        elif isinstance(cache, QuantizedLayerKV):
            _append_quantized(k_buf, v_buf, cache, meta, requantized, k.dtype)
        else:
            rows = torch.arange(bsz, device=k.device)
            k_buf[rows, :, meta.decode_pos] = k                            # [Bd, Hkv, D] at each row's position
            v_buf[rows, :, meta.decode_pos] = v
        return k_buf[:bsz, :, :span], v_buf[:bsz, :, :span]


def _append_quantized(k_buf: torch.Tensor, v_buf: torch.Tensor, cache: QuantizedLayerKV, meta: TorchPagedMetadata,
                      requantized: torch.Tensor, dtype: torch.dtype) -> None:
    """Append each decode row's new token as the cache holds it (dequantized), and re-copy the whole current block
    of the rows whose block this step re-quantized (its scale grew, or it is fresh): its older slots changed."""
    blocks, offsets = meta.write_blocks, meta.write_offsets                             # [Bd] each
    rows = torch.arange(blocks.shape[0], device=blocks.device)                          # [Bd]
    k_buf[rows, :, meta.decode_pos] = kv_quant.gather_rows(cache.k, cache.k_scale, blocks, offsets, dtype)
    v_buf[rows, :, meta.decode_pos] = kv_quant.gather_rows(cache.v, cache.v_scale, blocks, offsets, dtype)
    if requantized.numel():
        _copy_current_blocks(k_buf, v_buf, cache, meta, torch.isin(blocks, requantized).nonzero().flatten(), dtype)


def _copy_current_blocks(k_buf: torch.Tensor, v_buf: torch.Tensor, cache: QuantizedLayerKV,
                         meta: TorchPagedMetadata, rows: torch.Tensor, dtype: torch.dtype) -> None:
    """Re-copy the current block (the one this step wrote) of decode rows `rows [R]`, dequantized, into the
    buffers. Its slots after the new token hold zeros (masked)."""
    bs = cache.k.shape[1]
    blocks = meta.write_blocks.index_select(0, rows)                                    # [R]
    first = (meta.decode_pos - meta.write_offsets).index_select(0, rows)                # [R] block's first position
    positions = first[:, None] + torch.arange(bs, device=first.device)                 # [R, bs]
    # (advanced indices around a slice: the result's indexed axes come first, [R, bs, Hkv, D])
    k_buf[rows[:, None], :, positions] = kv_quant.gather(cache.k, cache.k_scale, blocks, dtype)
    v_buf[rows[:, None], :, positions] = kv_quant.gather(cache.v, cache.v_scale, blocks, dtype)


def _gather(cache, which: int, tables: torch.Tensor, bsz: int, dtype: torch.dtype) -> torch.Tensor:
    """`[Bd, Hkv, S, D]` view of the blocks `tables` (row by row) copied out of one layer's K (`which` 0) or V (1)
    cache, dequantized to `dtype` when the cache is quantized."""
    # NOTE: index_select copies whole block rows; advanced indexing of the strided per-layer view was 2-4x
    # slower on CPU (measured: 32 sequences x 5 blocks x 4 layers, ~2 ms vs 3.6-9.6 ms).
    blocks = _blocks(cache, which, tables, dtype)                                       # [Bd * W, bs, Hkv, D]
    _, _, hkv, dim = blocks.shape
    return blocks.view(bsz, -1, hkv, dim).transpose(1, 2)


def _blocks(cache, which: int, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `block_ids` of one layer's K (0) or V (1) as `[n, bs, Hkv, D]` in the model's `dtype`."""
    if isinstance(cache, QuantizedLayerKV):
        return kv_quant.gather(cache[which], cache[2 + which], block_ids, dtype)
    return cache[which].index_select(0, block_ids)


def _decode(q: torch.Tensor, cache, tables: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    bsz = q.shape[0]
    return _attend_decode(q, _gather(cache, 0, tables, bsz, q.dtype), _gather(cache, 1, tables, bsz, q.dtype),
                          mask, scale)


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


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, seq: PrefillSeq, mask: torch.Tensor | None,
             scale: float) -> torch.Tensor:
    """`mask` `[n, context_len]` additive, or None for a fresh prefill's plain causal attention. A fresh prefill
    attends over its own new K/V, unless the cache is quantized (then over the cache, like every other path)."""
    rows = slice(seq.row_start, seq.row_end)
    queries = q[rows].transpose(0, 1).unsqueeze(0)                                  # [1, Hq, n, D]
    if seq.fresh and not isinstance(cache, QuantizedLayerKV):
        keys, values = k[rows], v[rows]                                             # [n, Hkv, D]
    else:
        keys = _blocks(cache, 0, seq.block_ids, q.dtype).flatten(0, 1)[: seq.context_len]    # [ctx, Hkv, D]
        values = _blocks(cache, 1, seq.block_ids, q.dtype).flatten(0, 1)[: seq.context_len]
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)                                                   # [n, Hq, D]


register_attention_backend("torch", TorchPagedAttention)
