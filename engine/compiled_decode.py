"""The compiled decode step: the whole decode forward (embedding, every layer, final norm, LM head) captured by
`torch.compile` once per batch-size bucket, and replayed every step a batch is a pure decode.

    step with B decoding sequences  ->  bucket = smallest of (1, 2, 4, 8, ..., max_num_seqs) >= B
    rows B..bucket-1 are padding: copies of row 0 (same token, position, slot, block table), so they write the
    same K/V bytes into the same cache slot as row 0 and their logits are dropped.

Two graphs serve every bucket: batch 1 with static shapes (the latency case, specialised), and one graph with a
symbolic batch size for the buckets from 2 up (a size-1 dimension is always specialised by the compiler), split
once more only where the MoE backend picks another path above some batch size. Warm-up runs every bucket, so no
step after start-up compiles. The context length is symbolic in both: the block tables
are `[bucket, W]` with W = max(2, blocks of the longest sequence), so a growing context never recompiles. On CUDA
Inductor also captures CUDA graphs (`triton.cudagraphs`), one per bucket, as vLLM does.

The KV cache enters the graph as one flat 2-D view `[num_blocks * layers * 2 * block_size, kv_heads * head_dim]`
of the block-major cache, and the new K/V are written with `index_put_` on that view.
NOTE: writing through a strided per-layer view of a graph input (`k_cache[blocks, offsets] = k`) makes the
compiler copy the whole layer's cache in and out every step (measured: 50-90 ms a step for the bundled model);
a write into the flat input itself is done in place.

Attention in the graph reads each sequence's blocks through its block table, with a mask built from the
positions (and each layer's sliding window). Everything else is the model's own code (`CausalLM.forward`), so the
compiled and eager steps cannot drift apart; the MoE backend picks its sync-free path while compiling.

Inductor's caches live on disk (`$STRATA_COMPILE_CACHE`, default `~/.cache/strata/inductor`), so a restart
loads the compiled code instead of compiling again. `enforce_eager` (or `STRATA_ENFORCE_EAGER=1`) turns all of
this off.
"""
from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from engine.attention.backend import AttentionBackend
from engine.batch import ScheduledSeq, StepBatch
from engine.kv_cache import KVCache

ENV_EAGER = "STRATA_ENFORCE_EAGER"
ENV_CACHE = "STRATA_COMPILE_CACHE"


def eager_forced() -> bool:
    """`STRATA_ENFORCE_EAGER=1`: engines that were not told either way run eager (an operator's switch for every
    process at once, and the test suite's default; a test of the compiled step says `enforce_eager=False`)."""
    return os.environ.get(ENV_EAGER, "").strip().lower() in ("1", "true", "yes")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch; max_batch itself ends the list when it is not a power of two."""
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    buckets.append(max_batch)
    return buckets


def _use_disk_cache() -> None:
    """Point Inductor's caches at a persistent folder: `$STRATA_COMPILE_CACHE`, else a folder of the user's own
    `TORCHINDUCTOR_CACHE_DIR`, else `~/.cache/strata/inductor` (Inductor's default lives in /tmp)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if os.environ.get(ENV_CACHE):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[ENV_CACHE]
    elif chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        # (torch writes its /tmp default into the environment once anything asked for the cache folder)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path.home() / ".cache" / "strata" / "inductor")


class GraphMeta(NamedTuple):
    """Per-step inputs of the attention inside the graph (all on the model's device)."""

    rows: torch.Tensor                    # [B] flat-cache row of each new token's K (layer 0); + 2*l*bs (+bs for V)
    tables: torch.Tensor                  # [B * W] block ids, row by row (padding: block 0, masked out)
    masks: dict                           # window (None: full) -> additive mask [B, 1, 1, W * bs]


class GraphAttention(AttentionBackend):
    """The attention of the compiled decode step; `cache` is `(flat cache, layer index)`. Only used in the graph."""

    name = "compiled-decode"

    def __init__(self, cache: KVCache) -> None:
        self.shape6 = tuple(cache.tensor.shape)           # [nb, L, 2, bs, Hkv, D]
        self.block_size = cache.block_size

    def build_metadata(self, batch, block_size, device, dtype=torch.float32):  # pragma: no cover - not used
        raise NotImplementedError("the compiled decode step builds its inputs itself")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: GraphMeta, scale: float,
                window: int | None = None) -> torch.Tensor:
        flat, layer = cache
        bsz, hq, dim = q.shape
        _, _, _, bs, hkv, _ = self.shape6
        flat.index_put_((meta.rows + (2 * layer) * bs,), k.reshape(bsz, hkv * dim))
        flat.index_put_((meta.rows + (2 * layer + 1) * bs,), v.reshape(bsz, hkv * dim))
        cache6 = flat.view(self.shape6)
        # [B, Hkv, 1, S, D] views of the gathered blocks (the gather fuses into the loops below)
        keys, values = (cache6[:, layer, i].index_select(0, meta.tables).view(bsz, -1, hkv, dim)
                        .permute(0, 2, 1, 3)[:, :, None] for i in (0, 1))
        # GQA without repeating K/V: a KV head's G query heads are one more broadcast axis. Spelled out as multiply
        # and sum (not SDPA) so the compiler fuses the block gather into the reductions, the softmax running over
        # the innermost axis. NOTE: measured per layer (1 thread, batch 32, gather + attention compiled alone), this
        # vs SDPA vs the same with the keys axis outermost: static shapes, 160 keys 224 / 974 / 419 us, 512 keys
        # 785 / 4038 / 2018; symbolic keys only 278 / 339 / 378 and 1142 / 2483 / 2360; symbolic batch and keys
        # 463 / 385 / 577 and 2433 / 2988 / 3061; batch 1, 128 keys 27 / 42 / 30. In the whole bundled-model step
        # the layouts measured within noise of each other (7.7-9.1 ms at batch 32).
        # float32 arithmetic whatever the model dtype (the casts fuse into the loops), as SDPA accumulates.
        queries = q.view(bsz, hkv, hq // hkv, 1, dim).float()                                # [B, Hkv, G, 1, D]
        scores = (queries * keys.float()).sum(-1) * scale + meta.masks[window]               # [B, Hkv, G, S]
        probs = torch.softmax(scores, dim=-1)
        out = (probs.unsqueeze(-1) * values.float()).sum(-2).to(q.dtype)                     # [B, Hkv, G, D]
        return out.reshape(bsz, hq, dim)


def _window_masks(positions: torch.Tensor, span: int, windows: tuple) -> dict:
    key_pos = torch.arange(span, device=positions.device)                        # [S]
    pos = positions[:, None]                                                       # [B, 1]
    masks = {}
    for window in windows:
        visible = key_pos[None, :] <= pos
        if window is not None:
            visible = visible & (key_pos[None, :] > pos - window)
        zeros = torch.zeros(visible.shape, dtype=torch.float32, device=positions.device)
        masks[window] = zeros.masked_fill(~visible, float("-inf"))[:, None, None, :]  # [B, 1, 1, S]
    return masks


class CompiledDecode:
    """Contract: `supports(batch)` says whether `run` can take a step (a pure decode of <= the largest bucket);
    `run(batch, cos, sin)` writes the step's K/V into the cache exactly where the eager step would and returns
    float32 logits `[len(batch.seqs), vocab]`. `compilations` counts graph compilations (it stays put once every
    bucket has run: `warmup` runs each one)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, max_batch: int, device: torch.device) -> None:
        _use_disk_cache()
        import torch.fx.experimental._config as fx_config
        fx_config.use_duck_shape = False          # a batch equal to some other size must not tie their symbols
        self.model, self.cache, self.device = model, cache, device
        self.buckets = batch_buckets(max_batch)
        self.block_size = cache.block_size
        self.flat = cache.tensor.view(-1, cache.tensor.shape[-2] * cache.tensor.shape[-1])   # shares storage
        self.attention = GraphAttention(cache)
        self.windows = tuple(sorted({layer.attn.window for layer in model.layers}, key=lambda w: w or 0))
        self.compilations = 0
        self._layers_per_block = cache.tensor.shape[1]
        # NOTE: torch.compile keeps its graphs per code object, so every engine in a process (tests build dozens)
        # would share `_forward`'s cache and its recompile limit; each instance compiles its own copy of the code.
        code = CompiledDecode._forward.__code__
        forward = types.FunctionType(code.replace(co_name=f"decode_step_{id(self):x}"), globals())
        self._graph = torch.compile(types.MethodType(forward, self), backend=self._backend, fullgraph=True,
                                    dynamic=None)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        self.compilations += 1
        patches = {"triton.cudagraphs": True} if self.device.type == "cuda" else {}
        return compile_fx(gm, example_inputs, config_patches=patches)

    def _forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                 tables: torch.Tensor, positions: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        span = tables.shape[1] * self.block_size
        meta = GraphMeta(rows, tables.reshape(-1), _window_masks(positions, span, self.windows))
        caches = [(flat, i) for i in range(len(self.model.layers))]
        hidden = self.model(input_ids, cos, sin, self.attention, caches, meta)   # [B, H]
        return self.model.logits(hidden)                                         # [B, V] float32

    def bucket(self, size: int) -> int:
        return next(b for b in self.buckets if b >= size)

    def supports(self, batch: StepBatch) -> bool:
        seqs = batch.seqs
        return 0 < len(seqs) <= self.buckets[-1] and all(len(s.token_ids) == 1 and s.num_logits == 1 for s in seqs)

    def inputs(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph's inputs for `batch`, padded to its bucket with copies of row 0."""
        seqs, bs = batch.seqs, self.block_size
        size = self.bucket(len(seqs))
        pad = size - len(seqs)
        width = max(2, max(s.start_pos // bs + 1 for s in seqs))
        ids = [s.token_ids[0] for s in seqs]
        pos = [s.start_pos for s in seqs]
        per_block = self._layers_per_block * 2 * bs
        rows = [s.block_table[s.start_pos // bs] * per_block + s.start_pos % bs for s in seqs]
        tables = [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in seqs]
        if pad:
            ids, pos, rows, tables = ids + ids[:1] * pad, pos + pos[:1] * pad, rows + rows[:1] * pad, \
                tables + tables[:1] * pad
            index = torch.zeros(size, dtype=torch.int64, device=cos.device)
            index[:len(seqs)] = torch.arange(len(seqs), device=cos.device)
            cos, sin = cos.index_select(0, index), sin.index_select(0, index)
        device = self.device
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return (as_tensor(ids), cos.contiguous(), sin.contiguous(), as_tensor(rows), as_tensor(tables),
                as_tensor(pos), self.flat)

    def run(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        args = self.inputs(batch, cos, sin)
        self._mark(args)
        logits = self._graph(*args)
        logits = logits[:len(batch.seqs)]
        return logits.clone() if self.device.type == "cuda" else logits   # CUDA graphs reuse their outputs

    def _mark(self, args: tuple[torch.Tensor, ...]) -> None:
        ids, cos, sin, rows, tables, pos, _ = args
        torch._dynamo.mark_dynamic(tables, 1)
        if ids.shape[0] > 1:
            for t in (ids, cos, sin, rows, tables, pos):
                torch._dynamo.mark_dynamic(t, 0)

    def warmup(self, execute: Callable[[StepBatch], torch.Tensor],
               log: Callable[[str], None] | None = None) -> None:
        """Compile and run every bucket once through `execute` (the runner's step) on a scratch decode in block 0,
        whose contents are restored after: call before serving."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        saved = self.cache.tensor[0].clone()
        start = time.perf_counter()
        for i, size in enumerate(self.buckets):
            t0, before = time.perf_counter(), self.compilations
            # position block_size + 1 over a 2-block table: W = 2, never 1 (which the compiler would specialise)
            execute(StepBatch([ScheduledSeq(f"warmup-{j}", [0], self.block_size + 1, [0, 0]) for j in range(size)]))
            done = "compiled" if self.compilations > before else "ready"
            log(f"compiling the decode step: bucket {i + 1}/{len(self.buckets)} (batch {size}) {done} in "
                f"{time.perf_counter() - t0:.1f} s")
        self.cache.tensor[0].copy_(saved)
        log(f"decode step compiled for batch sizes {self.buckets} in {time.perf_counter() - start:.1f} s "
            f"({self.compilations} graphs; Inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})")
