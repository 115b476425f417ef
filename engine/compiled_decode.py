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
Inductor also captures CUDA graphs (`triton.cudagraphs`), as vLLM does: the cache is marked a static input (its
address never changes), without which Inductor refuses to capture a graph that writes into an input ("skipping
cudagraphs due to mutated inputs", seen on an H200), and W is rounded up to a power of two, so each bucket records
a handful of graphs as contexts grow rather than one per block.

The KV cache enters the graph as one flat 2-D view `[num_blocks * layers * 2 * block_size, kv_heads * head_dim]`
of the block-major cache, and the new K/V are written with `index_put_` on that view.
NOTE: writing through a strided per-layer view of a graph input (`k_cache[blocks, offsets] = k`) makes the
compiler copy the whole layer's cache in and out every step (measured: 50-90 ms a step for the bundled model);
a write into the flat input itself is done in place.

Attention in the graph reads each sequence's blocks through its block table, with a mask built from the
positions (and each layer's sliding window). Everything else is the model's own code (`CausalLM.forward`), so the
compiled and eager steps cannot drift apart; the MoE backend picks its sync-free path while compiling.

A quantized KV cache (fp8/int8 with per-block, per-head scales, engine/attention/kv_quant.py) enters the graph as
its flat bytes `[num_blocks * span]` (uint8, spans `| scales | values |`), and `QuantizedGraphAttention` applies
kv_quant's write rule there with byte-index `index_put_`s into that input (in place, as above): each row's scales
and its whole current block (re-quantized older slots, the new row) are rewritten every step, which for a block
whose scale did not grow writes back the same bytes (the rule is the identity then), so no data-dependent branch
is needed (the writes are byte-identical to the eager reference's, tests/unit/test_compiled_decode.py). Its reads
gather and dequantize the blocks in the same loops as the unquantized gather. Measured (bundled model, 1 thread,
context ~150, ms a step, auto / fp8 / int8): float32 batch 1 1.15 / 1.31 / 1.31, batch 16 5.2 / 6.8 / 6.1;
bfloat16 batch 1 1.09 / 1.43 / 1.48, batch 16 3.9 / 8.2 / 8.1 (the dequantizing attention loops dominate there).

Inductor's caches live on disk (`$STRATA_COMPILE_CACHE`, default `~/.cache/strata/inductor`), so a restart
loads the compiled code instead of compiling again. `enforce_eager` (or `STRATA_ENFORCE_EAGER=1`) turns all of
this off.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from engine import cpu_kernels
from engine.attention import kv_quant
from engine.attention.backend import AttentionBackend
from engine.batch import ScheduledSeq, StepBatch
from engine.kv_cache import KVCache

ENV_EAGER = "STRATA_ENFORCE_EAGER"
ENV_CACHE = "STRATA_COMPILE_CACHE"
ENV_GUARDED = "STRATA_GUARDED_DISPATCH"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _tagged(compiled: Callable, ran: list, index: int) -> Callable:
    """`compiled` (Inductor's callable for compilation `index`, which dynamo calls with the graph's inputs) that
    records `index` in `ran[0]` when called."""
    def run(*args):
        ran[0] = index
        return compiled(*args)
    return run


def eager_forced() -> bool:
    """`STRATA_ENFORCE_EAGER=1`: engines that were not told either way run eager (an operator's switch for every
    process at once, and the test suite's default; a test of the compiled step says `enforce_eager=False`)."""
    return _env_flag(ENV_EAGER)


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

    rows: torch.Tensor                    # [B] flat-cache row of each new token's K (layer 0); + 2*l*bs (+bs for V);
                                          # quantized cache: the block id of each new token's slot
    tables: torch.Tensor                  # [B, W] block ids (padding: block 0, masked out)
    masks: dict                           # window (None: full) -> additive mask [B, 1, 1, W * bs]
    offsets: torch.Tensor | None = None   # [B] quantized cache: each new token's offset in its block
    lengths: torch.Tensor | None = None   # [B] keys per row (position + 1): the CPU kernel's bound, not a mask


class GraphAttention(AttentionBackend):
    """The attention of the compiled decode step; `cache` is `(flat cache, layer index)`. Only used in the graph."""

    name = "compiled-decode"
    kernel = False      # attention by Strata's CPU kernel (engine/cpu_kernels) rather than by the compiler's loops

    def __init__(self, cache: KVCache) -> None:
        self.shape6 = tuple(cache.tensor.shape)           # [nb, L, 2, bs, Hkv, D]
        self.block_size = cache.block_size
        self.kernel = self.shape6[-1] in cpu_kernels.ATTENTION_HEAD_DIMS and cpu_kernels.usable(cache.tensor)

    def build_metadata(self, batch, block_size, device, dtype=torch.float32):  # pragma: no cover - not used
        raise NotImplementedError("the compiled decode step builds its inputs itself")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: GraphMeta, scale: float,
                window: int | None = None) -> torch.Tensor:
        flat, layer = cache
        if self.kernel and q.dtype == flat.dtype:
            # NOTE: the kernel reads each row's own keys (the compiler's loops run over the widest table, masked),
            # two passes with no [B, Hkv, G, S] buffers. Measured (1 thread, AVX2 EPYC, batch 32, 96 keys, one
            # layer's attention alone): 219 us against 1.4-2.1 ms compiled; the whole step below (docs/moe.md).
            self._write(flat, layer, k, v, meta)
            return cpu_kernels.decode_attention(q, flat.view(self.shape6), layer, meta.tables, meta.lengths, scale,
                                                window)
        keys, values = self._write_and_gather(flat, layer, k, v, meta)       # [B, Hkv, 1, S, D] each
        return _attend(q, keys, values, meta.masks[window], scale)

    def _write(self, flat: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, meta: GraphMeta) -> None:
        bsz, hkv, dim = k.shape
        bs = self.shape6[3]
        flat.index_put_((meta.rows + (2 * layer) * bs,), k.reshape(bsz, hkv * dim))
        flat.index_put_((meta.rows + (2 * layer + 1) * bs,), v.reshape(bsz, hkv * dim))

    def _write_and_gather(self, flat: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                          meta: GraphMeta) -> tuple[torch.Tensor, torch.Tensor]:
        self._write(flat, layer, k, v, meta)
        # [B, Hkv, 1, S, D] views of the gathered blocks (the gather fuses into the loops of `_attend`)
        return tuple(x[:, :, None] for x in gather_blocks(flat.view(self.shape6), layer, meta.tables))


class QuantizedGraphAttention(GraphAttention):
    """`GraphAttention` over a quantized cache: `cache` is `(flat bytes [num_blocks * span], layer index)` and
    `meta.rows` / `meta.offsets` the block and offset of each row's new token. Writes follow kv_quant's rule
    exactly (a pure decode writes one row per block: padding rows repeat row 0 and write the same bytes)."""

    def __init__(self, cache: KVCache) -> None:
        layer0 = cache.layers[0]
        self.block_size, self.span, self.scale_bytes = cache.block_size, cache.block_bytes, cache.scale_bytes
        self.heads, self.dim, self.dtype = layer0.k.shape[2], layer0.k.shape[3], layer0.k.dtype
        self.qmax = kv_quant.QMAX[self.dtype]

    def _write_and_gather(self, flat: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                          meta: GraphMeta) -> tuple[torch.Tensor, torch.Tensor]:
        for i, x in ((0, k), (1, v)):
            self._write(flat, 2 * layer + i, x, meta.rows, meta.offsets)
        tables = meta.tables.reshape(-1)
        return tuple(self._gather(flat, 2 * layer + i, tables, k.shape[0], k.dtype) for i in (0, 1))

    def _scale_index(self, blocks: torch.Tensor, region: int) -> torch.Tensor:
        """Byte offsets `[n, 4 * Hkv]` of the float32 scales of (layer, K/V) `region` of `blocks [n]`."""
        start = blocks * self.span + region * 4 * self.heads
        return start[:, None] + torch.arange(4 * self.heads, device=blocks.device)

    def _values_index(self, blocks: torch.Tensor, region: int) -> torch.Tensor:
        """Byte offsets `[n, bs * Hkv * D]` of the values of (layer, K/V) `region` of `blocks [n]`."""
        size = self.block_size * self.heads * self.dim
        start = blocks * self.span + self.scale_bytes + region * size
        return start[:, None] + torch.arange(size, device=blocks.device)

    def _write(self, flat: torch.Tensor, region: int, x: torch.Tensor, blocks: torch.Tensor,
               offsets: torch.Tensor) -> None:
        bsz, bs = x.shape[0], self.block_size
        scales, values = self._views(flat, region)
        fresh = offsets == 0                                                             # [B]
        old = _floats(scales.index_select(0, blocks)).masked_fill(fresh[:, None], 0.0)  # [B, Hkv]
        rows = x.float()                                                                 # [B, Hkv, D]
        new = torch.maximum(old, rows.abs().amax(-1) / self.qmax)                        # [B, Hkv]
        grown = new > 0
        divisor = torch.where(grown, new, 1.0)
        stored = values.index_select(0, blocks).float()                                  # [B, bs, Hkv, D]
        kept = (stored * (old / divisor)[:, None, :, None]).masked_fill(
            ~(grown & ~fresh[:, None])[:, None, :, None], 0.0)
        row = (rows / divisor[:, :, None]).masked_fill(~grown[:, :, None], 0.0)         # [B, Hkv, D]
        slot = torch.arange(bs, device=x.device)[None, :] == offsets[:, None]           # [B, bs]
        block = torch.where(slot[:, :, None, None], row[:, None], kept)                 # [B, bs, Hkv, D]
        # NOTE: written as bytes into the flat input itself (in place); reads go through typed views of it
        flat.index_put_((self._values_index(blocks, region),),
                        kv_quant.quantize(block, self.dtype).view(torch.uint8).view(bsz, -1))
        flat.index_put_((self._scale_index(blocks, region),), new.view(torch.uint8).view(bsz, -1))

    def _gather(self, flat: torch.Tensor, region: int, tables: torch.Tensor, bsz: int,
                dtype: torch.dtype) -> torch.Tensor:
        """`[B, Hkv, 1, S, D]` dequantized K or V of the blocks `tables [B * W]` (in the model's `dtype`, as the
        eager backend reads them)."""
        scales, values = self._views(flat, region)
        picked = values.index_select(0, tables).float()                                  # [B * W, bs, Hkv, D]
        kv = (picked * _floats(scales.index_select(0, tables))[:, None, :, None]).to(dtype)
        return kv.view(bsz, -1, self.heads, self.dim).permute(0, 2, 1, 3)[:, :, None]

    def _views(self, flat: torch.Tensor, region: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of (layer, K/V) `region`: its scales' bytes `[nb, 4 * Hkv]` (uint8: see `_floats`) and its values
        `[nb, bs, Hkv, D]` (fp8 / int8)."""
        # NOTE: reads go through these (whole-row index_selects: contiguous copies) rather than through byte
        # indices into `flat`, which the compiler gathers byte by byte, 60x slower (measured: 144 blocks, 6.8 vs
        # 0.11 ms)
        spans = flat.view(-1, self.span)                                                 # [nb, span]
        nb, hkv = spans.shape[0], self.heads
        scales = spans[:, :self.scale_bytes].view(nb, -1, 4 * hkv)[:, region]
        values = spans[:, self.scale_bytes:].view(self.dtype).view(nb, -1, self.block_size, hkv, self.dim)
        return scales, values[:, region]


def gather_blocks(cache6: torch.Tensor, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[B, Hkv, S, D]` (S = W * block_size) of the blocks `tables [B, W]` from the block-major cache
    `[nb, L, 2, bs, Hkv, D]`, for a graph to fuse into the loops that read them.

    NOTE: indexed with the 2-D table, so a key's block is `tables[b, s // bs]` with a constant divisor. Through a
    flattened `[B * W]` table the compiler lost that S is W * bs and computed `(b * S + s) // bs % (B * W)` with
    runtime divisors in the innermost loops: measured (1 thread, bf16, gather + attention of one layer compiled
    alone, symbolic batch and width) batch 32 x 7 blocks 299 -> 233 us, 32 x 12 487 -> 370, 16 x 20 413 -> 313."""
    bsz, width = tables.shape
    _, _, _, bs, hkv, dim = cache6.shape
    return tuple(cache6[:, layer, i][tables].view(bsz, width * bs, hkv, dim).permute(0, 2, 1, 3) for i in (0, 1))


def _floats(scale_bytes: torch.Tensor) -> torch.Tensor:
    """`[n, 4 * Hkv]` uint8 -> `[n, Hkv]` float32 scales. NOTE: this bitcast changes the element size, which the
    compiler materializes: done on the few gathered rows, never on a view of the whole cache (measured: that
    copied every block's scales every layer, +7 ms a step at 32k blocks)."""
    return scale_bytes.contiguous().view(torch.float32)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """One new token per row over keys/values `[B, Hkv, 1, S, D]` with an additive `mask [B, 1, 1, S]`."""
    bsz, hq, dim = q.shape
    hkv = keys.shape[1]
    # GQA without repeating K/V: a KV head's G query heads are one more broadcast axis. Spelled out as multiply
    # and sum (not SDPA) so the compiler fuses the block gather into the reductions, the softmax running over
    # the innermost axis. NOTE: measured per layer (1 thread, batch 32, gather + attention compiled alone), this
    # vs SDPA vs the same with the keys axis outermost: static shapes, 160 keys 224 / 974 / 419 us, 512 keys
    # 785 / 4038 / 2018; symbolic keys only 278 / 339 / 378 and 1142 / 2483 / 2360; symbolic batch and keys
    # 463 / 385 / 577 and 2433 / 2988 / 3061; batch 1, 128 keys 27 / 42 / 30. In the whole bundled-model step
    # the layouts measured within noise of each other (7.7-9.1 ms at batch 32).
    # float32 arithmetic whatever the model dtype (the casts fuse into the loops), as SDPA accumulates.
    queries = q.view(bsz, hkv, hq // hkv, 1, dim).float()                                # [B, Hkv, G, 1, D]
    scores = (queries * keys.float()).sum(-1) * scale + mask                             # [B, Hkv, G, S]
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
    """Contract: `supports(batch)` says whether `run_features` can take a step (a pure decode of <= the largest
    bucket); `run_features(batch, cos, sin)` writes the step's K/V into the cache exactly where the eager step would
    and returns float32 logits `[len(batch.seqs), vocab]` and the last hidden states. `compilations` counts graph compilations (it stays put once every
    bucket has run: `warmup` runs each one)."""

    graph_name = "decode_step"

    def __init__(self, model: torch.nn.Module, cache: KVCache, max_batch: int, device: torch.device,
                 max_blocks: int | None = None) -> None:
        """`max_blocks`: the most blocks one sequence's table spans (max_model_len / block_size); None: the cache's
        block count. On CUDA `warmup` records a graph for every table width up to it."""
        _use_disk_cache()
        import torch.fx.experimental._config as fx_config
        fx_config.use_duck_shape = False          # a batch equal to some other size must not tie their symbols
        self.model, self.cache, self.device = model, cache, device
        self.buckets = batch_buckets(max_batch)
        self.block_size = cache.block_size
        self.max_blocks = min(max_blocks or cache.num_blocks, cache.num_blocks)
        self.quantized = cache.quantized
        if self.quantized:      # the cache's bytes, spans back to back
            self.flat, self.attention = cache.tensor.view(-1), QuantizedGraphAttention(cache)
        else:                   # shares storage
            self.flat = cache.tensor.view(-1, cache.tensor.shape[-2] * cache.tensor.shape[-1])
            self.attention = GraphAttention(cache)
        if device.type == "cuda":   # a static input may be written inside a CUDA graph (see the module docstring)
            torch._dynamo.mark_static_address(self.flat)
        self.windows = tuple(sorted({layer.attn.window for layer in model.layers}, key=lambda w: w or 0))
        self.compilations = 0
        self.warm_seconds: dict[int, float] = {}  # bucket -> one warm step at the narrowest table (`warmup`)
        self._layers_per_block = cache.tensor.shape[1]
        # NOTE: torch.compile keeps its graphs per code object, so every engine in a process (tests build dozens)
        # would share `_forward`'s cache and its recompile limit; each instance compiles its own copy of the code.
        code = type(self)._forward.__code__
        forward = types.FunctionType(code.replace(co_name=f"{self.graph_name}_{id(self):x}"),
                                     type(self)._forward.__globals__)
        self._code, self._globals = forward.__code__, forward.__globals__
        self._graph = torch.compile(types.MethodType(forward, self), backend=self._backend, fullgraph=True,
                                    dynamic=None)
        # Direct dispatch (see `_adopt`): bucket -> dynamo's compiled code for it, called without its guards
        self._direct: dict[int, Callable] = {}
        self._codes: list[types.CodeType] = []   # dynamo's code per compilation, in order (while warming up)
        self._ran = [None]                        # index of the compilation whose graph ran last
        self._last_args: tuple | None = None      # the last guarded call's (inputs, grad mode, inference mode)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        index = self.compilations
        self.compilations += 1
        # NOTE: on the CPU the graph's wrapper (the code that allocates buffers and calls each kernel) is generated
        # in C++ rather than Python: measured (1 thread, bf16 bundled model, two engines in one process, 8
        # interleaved rounds, medians) 1.10x faster steps at batch 1, 1.02x at 8 and 32, at a longer first compile
        # (cached on disk like the rest).
        patches = {"triton.cudagraphs": True} if self.device.type == "cuda" else {"cpp_wrapper": True}
        return _tagged(compile_fx(gm, example_inputs, config_patches=patches), self._ran, index)

    @property
    def direct_buckets(self) -> list[int]:
        """The buckets whose steps skip dynamo's guards (`_adopt`)."""
        return sorted(self._direct)

    def _run_graph(self, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's outputs for `args`: by direct dispatch once `warmup` adopted the bucket, else through
        torch.compile (dynamo checks its guards and picks or compiles the graph)."""
        direct = self._direct.get(args[0].shape[0])
        if direct is not None:
            return direct(self, *args)
        self._last_args = args, torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self._mark(args)
        return self._graph(*args)

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        """While warming up: record dynamo's compiled code for this instance's forward, one per compilation."""
        import torch._dynamo.convert_frame as convert_frame

        def hook(old: types.CodeType, new: types.CodeType) -> None:
            if old is self._code:
                self._codes.append(new)
        handle = convert_frame.register_bytecode_hook(hook)
        try:
            yield
        finally:
            handle.remove()
            self._last_args = None

    def _adopt(self, size: int) -> None:
        """Dispatch bucket `size` straight to the compiled code of the graph that just ran it, skipping dynamo's
        guards and frame evaluation, if that code gives the same outputs bit for bit on the bucket's warm-up
        inputs (else the bucket stays guarded). CPU only: on CUDA the CUDA graph trees stay behind dynamo's entry.

        NOTE: vLLM dispatches to dynamo's compiled bytecode the same way. The guards it skips cannot fail in
        steady state here: inputs are padded to the bucket, their dtypes and devices are fixed, the context
        length is a symbolic dimension of every graph, and a test counts compilations. Measured (bundled model,
        1 thread, a guarded and a direct engine in one process, 8 interleaved rounds, medians, two runs each),
        guarded / direct step time: bf16 1.12-1.21x at batch 1, 1.06-1.10x at 8, 1.05-1.08x at 32; fp32
        1.14-1.34x, 1.04-1.09x, 1.00-1.04x (`benchmarks/decode_step_profile.py --guarded-ab`).
        `STRATA_GUARDED_DISPATCH=1` turns it off."""
        ran, last = self._ran[0], self._last_args
        if self.device.type != "cpu" or _env_flag(ENV_GUARDED) or ran is None or ran >= len(self._codes) \
                or last is None or last[0][0].shape[0] != size:
            return
        args, grad, inference = last
        direct = types.FunctionType(self._codes[ran], self._globals)
        # (the grad mode of the call that ran the graph: another would fail a guard and compile again)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            want = [t.clone() for t in self._graph(*args)]
            try:
                got = direct(self, *args)
            except Exception:  # noqa: BLE001 - any failure keeps the guarded path
                return
        if len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)):
            self._direct[size] = direct

    def _forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                 tables: torch.Tensor, positions: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        span = tables.shape[1] * self.block_size
        offsets = positions % self.block_size if self.quantized else None
        if self.attention.kernel:         # the kernel bounds each row by its length: no masks
            meta = GraphMeta(rows, tables, {}, offsets, positions + 1)
        else:
            meta = GraphMeta(rows, tables, _window_masks(positions, span, self.windows), offsets)
        caches = [(flat, i) for i in range(len(self.model.layers))]
        hidden = self.model(input_ids, cos, sin, self.attention, caches, meta)   # [B, H]
        return self.model.logits(hidden), hidden                                 # [B, V] float32, [B, H]

    def bucket(self, size: int) -> int:
        return next(b for b in self.buckets if b >= size)

    def table_width(self, blocks: int) -> int:
        """Block-table columns for a step whose longest sequence spans `blocks`: at least 2 (a size-1 dimension is
        specialised); on CUDA the next power of two, so the CUDA graphs recorded per width stay few."""
        width = max(2, blocks)
        return 1 << (width - 1).bit_length() if self.device.type == "cuda" else width

    def supports(self, batch: StepBatch) -> bool:
        seqs = batch.seqs
        return 0 < len(seqs) <= self.buckets[-1] and all(len(s.token_ids) == 1 and s.num_logits == 1 for s in seqs)

    def inputs(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph's inputs for `batch`, padded to its bucket with copies of row 0."""
        seqs, bs = batch.seqs, self.block_size
        size = self.bucket(len(seqs))
        pad = size - len(seqs)
        width = self.table_width(max(s.start_pos // bs + 1 for s in seqs))
        ids = [s.token_ids[0] for s in seqs]
        pos = [s.start_pos for s in seqs]
        if self.quantized:   # the block of each new token (its offset is position % bs)
            rows = [s.block_table[s.start_pos // bs] for s in seqs]
        else:
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

    def run_features(self, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits `[B, V]`, the last hidden states before the final norm `[B, H]`: an EAGLE head's features)."""
        logits, hidden = self._run_graph(self.inputs(batch, cos, sin))
        logits, hidden = logits[:len(batch.seqs)], hidden[:len(batch.seqs)]
        if self.device.type == "cuda":      # CUDA graphs reuse their outputs
            logits, hidden = logits.clone(), hidden.clone()
        return logits, hidden

    def _mark(self, args: tuple[torch.Tensor, ...]) -> None:
        ids, cos, sin, rows, tables, pos, _ = args
        torch._dynamo.mark_dynamic(tables, 1)
        if ids.shape[0] > 1:
            for t in (ids, cos, sin, rows, tables, pos):
                torch._dynamo.mark_dynamic(t, 0)

    def warmup_widths(self) -> list[int]:
        """The block-table widths `warmup` runs every bucket at. On CUDA, every power of two a step can use, up to
        the widest table: CUDA graphs are recorded per (bucket, width), and a recording in the middle of serving
        costs that step far more than the step itself. Elsewhere the width is a dynamic dimension of one graph, and
        2 stands for all of them."""
        if self.device.type != "cuda":
            return [2]
        return [1 << i for i in range(1, self.table_width(self.max_blocks).bit_length())]

    def timed(self, execute: Callable[[StepBatch], torch.Tensor], batch: StepBatch) -> float:
        """Seconds of one more (warm) step of `batch`, the device synchronised around it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        execute(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def warmup_passes(self) -> int:
        """How many times `warmup` runs each (bucket, width). On CUDA two: Inductor's CUDA graph trees run a new
        shape eagerly at its first call and record its graph at the second (measured on an H200: with one pass,
        serving still recorded every graph)."""
        return 2 if self.device.type == "cuda" else 1

    def warmup_position(self, width: int) -> int:
        """A position whose step uses table width `width` (2 at the least: never 1, which the compiler would
        specialise): the second slot of block width // 2, so every width's table rounds up to exactly `width`."""
        return (width // 2) * self.block_size + 1

    def _warm(self, execute: Callable[[StepBatch], torch.Tensor], batch: StepBatch, size: int, timed: bool) -> None:
        """Run one warm-up batch of bucket `size` `warmup_passes` times; when `timed` (its first table width), then
        adopt direct dispatch for the bucket and time one more step (`warm_seconds`)."""
        for _ in range(self.warmup_passes()):
            execute(batch)
        if timed:
            self._adopt(size)
            self.warm_seconds[size] = self.timed(execute, batch)

    def warmup(self, execute: Callable[[StepBatch], torch.Tensor],
               log: Callable[[str], None] | None = None) -> None:
        """Compile and run every bucket (on CUDA at every table width, `warmup_widths`, `warmup_passes` times)
        through `execute` (the runner's step) on a scratch decode in block 0, whose contents are restored after:
        call before serving."""
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        saved = self.cache.tensor[0].clone()
        start, widths = time.perf_counter(), self.warmup_widths()
        with self._capturing():
            for i, size in enumerate(self.buckets):
                t0, before = time.perf_counter(), self.compilations
                for width in widths:
                    position = self.warmup_position(width)
                    batch = StepBatch([ScheduledSeq(f"warmup-{j}", [0], position, [0] * width)
                                       for j in range(size)])
                    self._warm(execute, batch, size, timed=width == widths[0])
                done = "compiled" if self.compilations > before else "ready"
                log(f"compiling the decode step: bucket {i + 1}/{len(self.buckets)} (batch {size}) {done} in "
                    f"{time.perf_counter() - t0:.1f} s"
                    + (f" ({len(widths)} table widths)" if len(widths) > 1 else ""))
        self.cache.tensor[0].copy_(saved)
        log(f"decode step compiled for batch sizes {self.buckets} in {time.perf_counter() - start:.1f} s "
            f"({self.compilations} graphs; Inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})")
