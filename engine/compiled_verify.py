"""The compiled verify step: `CompiledDecode` for steps where every sequence computes at most `n` tokens and
needs logits for them (speculative decoding's verify: the last token and up to n - 1 drafts; plain decodes ride
along). One graph per batch-size class (batch 1 static, batch >= 2 symbolic), `n` fixed at start-up.

    sequence with m < n tokens:   | t_0 .. t_{m-1} | t_{m-1} t_{m-1} ... |   padded to n with copies of its last
                                   token at the same position and slot: they compute and write the same K/V bytes
                                   as the real one (its context is the same), and their logits are dropped

The graph returns the logits and the last hidden states (before the final norm) of every row, so an EAGLE head can
read the target's features from a compiled step. An unquantized KV cache only: the quantized write rule
(one row per block per step) is the decode step's.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.compiled_decode import CompiledDecode, GraphAttention, GraphMeta, gather_blocks
from engine.kv_cache import KVCache


class VerifyGraphAttention(GraphAttention):
    """`n` query tokens per sequence over its gathered blocks, causal by position (`meta.masks[window]`:
    `[B, 1, 1, n, S]`)."""

    def __init__(self, cache: KVCache, tokens_per_seq: int) -> None:
        super().__init__(cache)
        self.n = tokens_per_seq

    def forward(self, q, k, v, cache, meta: GraphMeta, scale: float, window: int | None = None) -> torch.Tensor:
        flat, layer = cache
        rows, hkv, dim = k.shape
        bs = self.shape6[3]
        flat.index_put_((meta.rows + (2 * layer) * bs,), k.reshape(rows, hkv * dim))
        flat.index_put_((meta.rows + (2 * layer + 1) * bs,), v.reshape(rows, hkv * dim))
        bsz = rows // self.n
        keys, values = (x[:, :, None, None] for x in gather_blocks(flat.view(self.shape6), layer, meta.tables))
        # [B, Hkv, 1, 1, S, D] each
        hq = q.shape[1]
        queries = q.view(bsz, self.n, hkv, hq // hkv, dim).permute(0, 2, 3, 1, 4).float()  # [B, Hkv, G, n, D]
        scores = (queries.unsqueeze(-2) * keys.float()).sum(-1) * scale + meta.masks[window]  # [B, Hkv, G, n, S]
        probs = torch.softmax(scores, dim=-1)
        out = (probs.unsqueeze(-1) * values.float()).sum(-2).to(q.dtype)                   # [B, Hkv, G, n, D]
        return out.permute(0, 3, 1, 2, 4).reshape(rows, hq, dim)


def _verify_masks(positions: torch.Tensor, span: int, windows: tuple) -> dict:
    """window -> additive mask `[B, 1, 1, n, S]` from positions `[B, n]`."""
    key_pos = torch.arange(span, device=positions.device)                              # [S]
    pos = positions[:, :, None]                                                        # [B, n, 1]
    masks = {}
    for window in windows:
        visible = key_pos[None, None, :] <= pos
        if window is not None:
            visible = visible & (key_pos[None, None, :] > pos - window)
        zeros = torch.zeros(visible.shape, dtype=torch.float32, device=positions.device)
        masks[window] = zeros.masked_fill(~visible, float("-inf"))[:, None, None]     # [B, 1, 1, n, S]
    return masks


class CompiledVerify(CompiledDecode):
    graph_name = "verify_step"

    def __init__(self, model: torch.nn.Module, cache: KVCache, max_batch: int, device: torch.device,
                 tokens_per_seq: int, max_blocks: int | None = None) -> None:
        if cache.quantized:
            raise ValueError("the compiled verify step needs an unquantized KV cache")
        self.n = tokens_per_seq
        super().__init__(model, cache, max_batch, device, max_blocks)
        self.attention = VerifyGraphAttention(cache, tokens_per_seq)

    def _forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                 tables: torch.Tensor, positions: torch.Tensor, flat: torch.Tensor):
        """input_ids, rows, positions `[B, n]`; cos/sin `[B, n, 1, D]`: (logits `[B * n, V]`, hidden `[B * n, H]`)."""
        span = tables.shape[1] * self.block_size
        meta = GraphMeta(rows.reshape(-1), tables, _verify_masks(positions, span, self.windows))
        caches = [(flat, i) for i in range(len(self.model.layers))]
        hidden = self.model(input_ids.reshape(-1), cos.flatten(0, 1), sin.flatten(0, 1), self.attention, caches,
                            meta)                                                   # [B * n, H]
        return self.model.logits(hidden), hidden

    def supports(self, batch: StepBatch) -> bool:
        seqs = batch.seqs
        return 0 < len(seqs) <= self.buckets[-1] and \
            all(0 < len(s.token_ids) <= self.n and 0 < s.num_logits for s in seqs)

    def inputs(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph's inputs: each sequence padded to n tokens, the batch to its bucket (copies of sequence 0);
        `cos`/`sin` `[T, 1, D]` of the step's real tokens in batch order."""
        seqs, bs, n = batch.seqs, self.block_size, self.n
        size = self.bucket(len(seqs))
        per_block = self._layers_per_block * 2 * bs
        ids, pos, rows, tables, index = [], [], [], [], []
        width = self.table_width(max((s.start_pos + len(s.token_ids) - 1) // bs + 1 for s in seqs))
        first = 0
        for s in seqs:
            m = len(s.token_ids)
            take = list(range(m)) + [m - 1] * (n - m)
            ids.append([s.token_ids[j] for j in take])
            pos.append([s.start_pos + j for j in take])
            rows.append([s.block_table[p // bs] * per_block + p % bs for p in pos[-1]])
            tables.append(s.block_table[:width] + [0] * (width - min(width, len(s.block_table))))
            index.extend(first + j for j in take)
            first += m
        pad = size - len(seqs)
        ids, pos, rows, tables = ids + ids[:1] * pad, pos + pos[:1] * pad, rows + rows[:1] * pad, \
            tables + tables[:1] * pad
        index = index + index[:n] * pad
        picked = torch.tensor(index, dtype=torch.int64, device=cos.device)
        cos = cos.index_select(0, picked).view(size, n, *cos.shape[1:])
        sin = sin.index_select(0, picked).view(size, n, *sin.shape[1:])
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return (as_tensor(ids), cos, sin, as_tensor(rows), as_tensor(tables), as_tensor(pos), self.flat)

    def run_features(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits `[sum(num_logits), V]`: each sequence's last num_logits rows, hidden `[T, H]`: every real row),
        in batch order."""
        logits, hidden = self._run_graph(self.inputs(batch, cos, sin))
        real, wanted = [], []
        for i, s in enumerate(batch.seqs):
            m = len(s.token_ids)
            real.extend(range(i * self.n, i * self.n + m))
            wanted.extend(range(i * self.n + m - s.num_logits, i * self.n + m))
        device = logits.device
        out = logits.index_select(0, torch.tensor(wanted, device=device))
        return out, hidden.index_select(0, torch.tensor(real, device=device))

    def warmup(self, execute: Callable[[StepBatch], torch.Tensor],
               log: Callable[[str], None] | None = None) -> None:
        """Compile and run every bucket (on CUDA at every table width, twice: `warmup_passes`) with n tokens per
        sequence on scratch slots of block 0 (restored)."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        saved = self.cache.tensor[0].clone()
        start, before = time.perf_counter(), self.compilations
        widths = self.warmup_widths()
        with self._capturing():
            for width in widths:
                position = self.warmup_position(width)
                table = [0] * max(width, self.table_width((position + self.n - 1) // self.block_size + 1))
                for size in self.buckets:
                    batch = StepBatch([ScheduledSeq(f"warmup-{j}", [0] * self.n, position, table, self.n)
                                       for j in range(size)])
                    self._warm(execute, batch, size, timed=width == widths[0])
        self.cache.tensor[0].copy_(saved)
        log(f"verify step ({self.n} tokens per sequence) compiled for batch sizes {self.buckets} in "
            f"{time.perf_counter() - start:.1f} s ({self.compilations - before} graphs)")
