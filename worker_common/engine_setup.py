"""Build one engine the way every worker (and the single-engine reference in tests) builds it.

The block hash function and the namespace root come from `kvstore.hashing` and are injected into the engine
(DESIGN §1, §3): `engine` never imports `kvstore`. The namespace is `strata.llm.kv_namespace` (model fingerprint,
KV layout, the KV cache's storage dtype), so workers and the offline `LLM` agree on block identity exactly when
blocks are interchangeable: fp8, int8 and model-dtype blocks never share a hash.

What the bridge moves per block is the engine's block span (`runner.read_blocks`): the values in the model dtype,
or, for a quantized cache, `scales | values` as uint8, which is the codec's scales section followed by its payload.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from kvstore import codec
from kvstore.hashing import BlockHash, Namespace, hash_block
from engine.config import CacheConfig, ModelConfig, MoEConfig, SchedulerConfig, SpeculativeConfig
from engine.moe.backend import MoESetup
from engine.moe.ep_group import EPGroup
from engine.spec.factory import build_speculation
from strata.llm import kv_namespace
from worker_common.config import WorkerConfig


@dataclass
class EngineBundle:
    """The engine plus the facts about its KV that the bridge needs."""

    runner: ModelRunner
    engine: LLMEngine
    namespace: Namespace         # salt-free; `fingerprint_for(salt)` gives a tenant's root
    layout: codec.BlockLayout
    kv_dtype: str                # the KV cache's storage dtype (the codec's dtype): model dtype, float8_e4m3fn, int8
    max_model_len: int
    # The device tier's KV-event sink (`worker_common.kv_events.DeviceEvents`): blocks the worker installs itself
    # (pulled or loaded KV) are announced through it, as the block manager announces the blocks it computes.
    device_events: Any = None

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    def fingerprint_for(self, cache_salt: str) -> BlockHash:
        return self.namespace.with_salt(cache_salt).fingerprint()

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block as the engine reads and writes it: `[num_layers, 2, block_size, kv_heads, head_dim]`, or
        `[span]` bytes (scales then values) when the KV is quantized."""
        return tuple(self.runner.kv_cache.shape[1:])

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of `block_shape` tensors: the model dtype, or uint8 when quantized."""
        return self.runner.kv_cache.dtype

    @property
    def quantized(self) -> bool:
        return self.layout.scale_bytes(self.kv_dtype) > 0

    @property
    def span_bytes(self) -> int:
        """Bytes of one block span: the codec's scales and payload sections together."""
        return self.layout.span_bytes(self.kv_dtype)


def build_engine(config: WorkerConfig, on_block_stored: Callable | None = None,
                 on_block_removed: Callable | None = None, ep_group: EPGroup | None = None) -> EngineBundle:
    """`ep_group`: this rank's expert-parallel group (joined before the engine is built), None for one process."""
    return build_engine_from(config.model, config.dtype, config.block_size, config.num_blocks, config.max_num_seqs,
                             config.max_num_batched_tokens, config.max_model_len,
                             enforce_eager=True if config.enforce_eager else None, on_block_stored=on_block_stored,
                             on_block_removed=on_block_removed,
                             kv_cache_dtype=getattr(config, "kv_cache_dtype", "auto"),
                             quantization=getattr(config, "quantization", None),
                             quant_group_size=getattr(config, "quant_group_size", 128),
                             quantize_vocab=getattr(config, "quantize_vocab", False),
                             speculative=_speculative_of(config),
                             moe=config.moe_config() if hasattr(config, "moe_config") else None, ep_group=ep_group)


def _speculative_of(config: WorkerConfig) -> SpeculativeConfig | None:
    """A decode worker's speculative decoding; a prefill worker samples one token per request: it never speculates
    (and loads no drafter)."""
    if getattr(config, "role", "") != "decode" or not hasattr(config, "speculative_config"):
        return None
    return config.speculative_config()


def build_engine_from(model: str, dtype: str = "float32", block_size: int = 16, num_blocks: int = 1024,
                      max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                      max_model_len: int = 2048, *, enforce_eager: bool | None = None, engine_text: bool = False,
                      on_block_stored: Callable | None = None, on_block_removed: Callable | None = None,
                      kv_cache_dtype: str = "auto", quantization: str | None = None,
                      quant_group_size: int = 128, quantize_vocab: bool = False,
                      speculative: SpeculativeConfig | None = None, moe: MoEConfig | None = None,
                      ep_group: EPGroup | None = None) -> EngineBundle:
    """`engine_text=True` lets the engine detokenize (the single-engine reference); workers leave it False.
    `on_block_stored` / `on_block_removed` are the block manager's device-tier hooks (the worker's KV events).
    `kv_cache_dtype`: auto (the model dtype), fp8 or int8 (`CacheConfig`); `quantization`, `quant_group_size`,
    `quantize_vocab`: the weights' (`ModelConfig`); `speculative`: speculative decoding (None or a config without a
    method: off; `draft_model` must be a resolved folder: `strata.speculative_options.speculative_config`); `moe`,
    `ep_group`: how sparse layers run their experts (expert_parallel needs the group)."""
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True,
                               kv_cache_dtype=kv_cache_dtype)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len)
    model_config = ModelConfig(model, dtype=dtype, enforce_eager=enforce_eager, quantization=quantization,
                               quant_group_size=quant_group_size, quantize_vocab=quantize_vocab)
    spec_tokens = speculative.num_speculative_tokens if speculative is not None and speculative.enabled else 0
    setup = MoESetup(moe or MoEConfig(), ep_group)
    runner = ModelRunner(model_config, cache_config, moe_backend=setup, max_num_seqs=max_num_seqs,
                         speculative_tokens=spec_tokens, max_model_len=max_model_len)
    spec = runner.spec
    layout = codec.BlockLayout(spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim)
    kv_dtype = runner.kv_dtype      # the storage dtype: `kv_storage_dtype(kv_cache_dtype, dtype)`
    namespace = kv_namespace(runner, cache_config, kv_dtype)  # the one definition `strata.llm` uses too
    # NOTE: tokenizer=None: the workers detokenize themselves (worker_common.text_stream), because a decode
    # worker's text must continue after a first token another process sampled.
    tokenizer = runner.tokenizer if engine_text else None
    speculation = None if speculative is None else build_speculation(speculative, runner, model_config, cache_config,
                                                                      scheduler_config)
    engine = LLMEngine(runner, tokenizer, cache_config, scheduler_config, hash_block, namespace.fingerprint(),
                       runner.tokenizer.eos_token_ids, on_block_stored=on_block_stored,
                       on_block_removed=on_block_removed, speculation=speculation)
    assert layout.span_bytes(kv_dtype) == runner.block_bytes, "the codec's sections must be the engine's span"
    return EngineBundle(runner, engine, namespace, layout, kv_dtype, max_model_len)
