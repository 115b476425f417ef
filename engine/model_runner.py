"""`ModelRunner`: loads the model, allocates the paged KV cache, and runs one `StepBatch` to float32 logits.

Per step it converts the batch's Python ints to tensors once (ids, positions, logit rows, attention metadata);
layers then run over the flat token batch with no per-sequence Python work except multi-token prefills.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from engine.attention.backend import get_attention_backend
from engine.batch import StepBatch
from engine.compiled_decode import CompiledDecode, eager_forced
from engine.compiled_verify import CompiledVerify
from engine.cpu_features import slow_half_gemm
from engine.kv_cache import KVCache
from engine.loader import load_model, torch_dtype
from engine.config import CacheConfig, ModelConfig, kv_storage_dtype
from engine.moe.backend import MoESetup
from engine.moe.ep_step import ExpertParallelStep
from engine.moe.expert_parallel import ExpertParallelMoE

logger = logging.getLogger(__name__)


def _flat_inputs(batch: StepBatch) -> tuple[list[int], list[int], list[int]]:
    """Token ids, absolute positions and logit rows (the last num_logits rows of each sequence), in order."""
    ids: list[int] = []
    positions: list[int] = []
    logit_rows: list[int] = []
    for seq in batch.seqs:
        n = len(seq.token_ids)
        if not 0 <= seq.num_logits <= n:
            raise ValueError(f"request {seq.request_id}: num_logits must be in [0, {n}], got {seq.num_logits}")
        row = len(ids)
        ids.extend(seq.token_ids)
        positions.extend(range(seq.start_pos, seq.start_pos + n))
        logit_rows.extend(range(row + n - seq.num_logits, row + n))
    return ids, positions, logit_rows


def _check_tables(batch: StepBatch, block_size: int) -> None:
    for seq in batch.seqs:
        needed = -(-(seq.start_pos + len(seq.token_ids)) // block_size)
        if len(seq.block_table) < needed:
            raise ValueError(f"request {seq.request_id}: block_table has {len(seq.block_table)} blocks, needs "
                             f"{needed} for positions up to {seq.start_pos + len(seq.token_ids) - 1}")


def expert_parallel_step(model: torch.nn.Module, setup: MoESetup, dtype: torch.dtype) -> ExpertParallelStep | None:
    """The step coordinator of a model whose sparse layers are expert-parallel (None otherwise)."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    if not layers:
        return None
    top_k = model.spec.moe.top_k
    return ExpertParallelStep(setup.group, layers, setup.config, top_k, dtype)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, attention: str = "torch",
                 moe_backend: MoESetup | str = "local", max_num_seqs: int = 64,
                 log: Callable[[str], None] | None = None, speculative_tokens: int = 0,
                 max_model_len: int | None = None) -> None:
        """`max_num_seqs` sizes the compiled decode step's largest bucket; `log` gets its progress lines;
        `max_model_len` bounds the block tables its CUDA graphs are recorded for (None: the cache's size);
        `speculative_tokens` > 0 also compiles the verify step (the last token + that many drafts per sequence).
        `moe_backend`: a backend name or a `MoESetup` (expert parallel: its group; then every step is a collective,
        `ep_begin`/`ep_end`)."""
        torch.manual_seed(model_config.seed)
        setup = MoESetup.of(moe_backend)
        loaded = load_model(model_config, setup)
        self.model, self.spec, self.tokenizer = loaded.model, loaded.spec, loaded.tokenizer
        self.fingerprint, self.generation_config = loaded.fingerprint, loaded.generation_config
        self.device, self.dtype = torch.device(model_config.device), torch_dtype(model_config.dtype)
        if self.dtype == torch.bfloat16 and slow_half_gemm(self.dtype, self.device):
            # NOTE: measured on an AVX2-only CPU (engine_throughput.py, 1 thread, bundled model, compiled): bf16 742
            # and 2,052 tok/s at 1 and 32 requests with Strata's CPU kernels (662 and 1,050 without; 152 and 163
            # before any of this), float32 573-805 and 2,648-2,998 in runs of the same session
            logger.warning("bfloat16 on a CPU without native bf16 (AVX-512 BF16 or AMX): torch's bf16 matrix products "
                           "are slow here, so linear layers of up to 8 rows run Strata's CPU kernel "
                           "(engine/cpu_kernels) and larger ones compute in float32; --dtype float32 (the default) is "
                           "still faster at 32 concurrent requests")
        self.block_size = cache_config.block_size
        # the storage dtype: the model's ("auto"), or float8_e4m3fn / int8 with per-block, per-head scales
        self.kv_dtype = kv_storage_dtype(cache_config.kv_cache_dtype, model_config.dtype)
        if attention == "torch" and self.device.type == "cuda" and cache_config.kv_cache_dtype != "auto":
            attention = "triton"        # the quantized KV write and decode attention as Triton kernels
        self.attention = get_attention_backend(attention)
        self.cache = KVCache(cache_config.num_blocks, self.spec.num_layers, cache_config.block_size,
                             self.spec.num_kv_heads, self.spec.head_dim, getattr(torch, self.kv_dtype), self.device)
        self.compiled: CompiledDecode | None = None
        self.compiled_verify: CompiledVerify | None = None     # speculative verify steps (engine/compiled_verify.py)
        self.ep = expert_parallel_step(self.model, setup, self.dtype)
        eager = model_config.enforce_eager
        if not (eager_forced() if eager is None else eager):
            # NOTE: ranks compile at their own pace, so warm-up forwards do not exchange tokens (EPGroup.offline)
            with self.ep.group.offline() if self.ep is not None else contextlib.nullcontext():
                max_blocks = None if max_model_len is None else -(-max_model_len // self.block_size)
                self._compile(max_num_seqs, speculative_tokens, log, max_blocks)

    def _compile(self, max_num_seqs: int, speculative_tokens: int, log: Callable[[str], None] | None,
                 max_blocks: int | None) -> None:
        self.compiled = CompiledDecode(self.model, self.cache, max_num_seqs, self.device, max_blocks)
        self.compiled.warmup(self.execute, log)
        if speculative_tokens and not self.cache.quantized:
            self.compiled_verify = CompiledVerify(self.model, self.cache, max_num_seqs, self.device,
                                                  speculative_tokens + 1, max_blocks)
            self.compiled_verify.warmup(self.execute, log)

    @property
    def kv_cache(self) -> torch.Tensor:
        """`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; uint8 `[num_blocks, span]` when the KV
        is quantized (engine/kv_cache.py)."""
        return self.cache.tensor

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's span (scales + values when quantized): what `read_blocks` gives per block."""
        return self.cache.block_bytes

    @property
    def scale_bytes(self) -> int:
        """Bytes of a block's scales (the start of its span); 0 when the KV is not quantized."""
        return self.cache.scale_bytes

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`[n, *kv_cache.shape[1:]]`: whole block spans (uint8 `[n, span]` when quantized)."""
        return self.cache.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.cache.write_blocks(block_ids, data)
        self.attention.invalidate()

    # ---- expert parallelism: one step = one collective schedule on every rank (engine/moe/ep_step.py) --------

    def ep_begin(self, batch: StepBatch) -> bool:
        """Join the group's step with this batch (maybe empty); True when some rank runs a forward. Call `ep_end`
        after the forward (or after `ep_idle` when this rank has no batch)."""
        return self.ep.begin(self.forward_rows(batch))

    def ep_idle(self) -> None:
        self.ep.idle()

    def ep_end(self) -> None:
        self.ep.end()

    def forward_rows(self, batch: StepBatch) -> int:
        """Rows the forward of `batch` runs through each layer (a compiled step pads to its bucket)."""
        seqs = batch.seqs
        if not seqs:
            return 0
        if self.compiled is not None and self.compiled.supports(batch):
            return self.compiled.bucket(len(seqs))
        if self.compiled_verify is not None and self.compiled_verify.supports(batch):
            return self.compiled_verify.bucket(len(seqs)) * self.compiled_verify.n
        return sum(len(s.token_ids) for s in seqs)

    def rope(self, batch: StepBatch, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[T, 1, D]` for the step's flat `positions` (`length`: max position + 1). Dynamic NTK
        rotates each token for its own sequence's length (engine/models/rope.py), never another request's."""
        rotary = self.model.rotary
        if rotary.dynamic:
            return rotary.lookup_dynamic(positions, batch.seqs)
        rotary.ensure(length)
        return rotary.lookup_signed(positions)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits `[sum(seq.num_logits), vocab]`: each sequence's last num_logits positions, in order."""
        if not batch.seqs:
            return torch.empty(0, self.spec.vocab_size, dtype=torch.float32, device=self.device)
        return self.execute_features(batch)[0]

    @torch.inference_mode()
    def execute_features(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits `execute` gives, hidden states `[T, H]` of every computed position before the final norm,
        in batch token order): what a draft head that reads the target's features needs."""
        _check_tables(batch, self.block_size)
        if self.compiled is not None and self.compiled.supports(batch):
            return self._execute_compiled(batch)
        if self.compiled_verify is not None and self.compiled_verify.supports(batch):
            return self._execute_verify(batch)
        hidden, logit_rows = self._forward(batch)
        rows = hidden if len(logit_rows) == hidden.shape[0] else \
            hidden[torch.tensor(logit_rows, dtype=torch.int64, device=self.device)]       # [N, H]
        return self.model.logits(rows), hidden                                        # [N, V], [T, H]

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, list[int]]:
        """The eager forward: hidden states `[T, H]` (before the final norm) and the rows that need logits."""
        ids, positions, logit_rows = _flat_inputs(batch)
        meta = self.attention.build_metadata(batch, self.block_size, self.device, self.dtype)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)          # [T]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)          # [T]
        cos, sin = self.rope(batch, pos, max(positions) + 1)                          # [T, 1, D] each
        try:
            hidden = self.model(input_ids, cos, sin, self.attention, self.cache.layers, meta)  # [T, H]
        except BaseException:
            self.attention.invalidate()     # a half-run step leaves derived attention state behind the cache
            raise
        return hidden, logit_rows

    def _execute_compiled(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        positions = [s.start_pos for s in batch.seqs]
        cos, sin = self.rope(batch, torch.tensor(positions, dtype=torch.int64, device=self.device),
                             max(positions) + 1)                                       # [B, 1, D] each
        # NOTE: the eager backend's derived state (its DecodeBuffer) does not see this step's cache writes
        self.attention.invalidate()
        return self.compiled.run_features(batch, cos, sin)                             # [B, V], [B, H]

    def _execute_verify(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        positions = [p for s in batch.seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
        cos, sin = self.rope(batch, torch.tensor(positions, dtype=torch.int64, device=self.device),
                             max(positions) + 1)                                       # [T, 1, D] each
        self.attention.invalidate()
        return self.compiled_verify.run_features(batch, cos, sin)                     # [N, V], [T, H]
