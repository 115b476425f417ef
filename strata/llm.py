"""The offline API: `LLM(model_path).generate(prompts, sampling)`, and streaming of one prompt.

This is where the engine and the store's block identity meet (DESIGN §1: `engine` never imports `kvstore`):
the engine's block manager gets `kvstore.hashing.hash_block` and the namespace root injected here.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.hashing import Namespace, hash_block
from engine.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, kv_storage_dtype
from engine.spec.factory import build_speculation
from strata.paths import resolve_draft_model, resolve_model


def kv_namespace(runner: ModelRunner, cache_config: CacheConfig, dtype: str) -> Namespace:
    """The block-hash namespace of a loaded model: weights (and their quantization, in the fingerprint), KV layout
    and the KV cache's storage dtype `dtype` (`kv_storage_dtype`: fp8/int8 KV never shares a block with the model
    dtype's), tenant salt (DESIGN §3)."""
    spec = runner.spec
    return Namespace.for_model(runner.fingerprint, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                               head_dim=spec.head_dim, block_size=cache_config.block_size, kv_dtype=dtype,
                               cache_salt=cache_config.cache_salt)


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets, with the defaults of the embedded model (vLLM's `LLM(...)` keyword names)."""

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 2048
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    seed: int = 0
    attention: str = "torch"
    enforce_eager: bool | None = None   # None: compiled unless STRATA_ENFORCE_EAGER=1
    quantization: str | None = None     # int8, int4, fp8, mxfp4 (None: the checkpoint's own, else none)
    quant_group_size: int = 128         # int4 group size
    quantize_vocab: bool = False        # also the LM head and token embedding (with `quantization`)
    kv_cache_dtype: str = "auto"        # auto (the model dtype), fp8 or int8
    speculative: str | None = None      # ngram, draft or eagle (None: off)
    num_speculative_tokens: int = 4     # the most proposed per request and step
    speculative_model: str | None = None   # draft: a checkpoint; eagle: a head folder (None: the bundled one)
    speculative_adaptive: bool = True   # per-request length from acceptance, off when it does not pay

    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens,
                                 resolve_draft_model(self.speculative, self.speculative_model),
                                 adaptive=self.speculative_adaptive)

    def configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        model = ModelConfig(resolve_model(self.model), self.device, self.dtype, self.seed, self.enforce_eager,
                            self.quantization, self.quant_group_size, self.quantize_vocab)
        cache = CacheConfig(self.block_size, self.num_blocks, self.enable_prefix_caching,
                            kv_cache_dtype=self.kv_cache_dtype)
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
        return model, cache, scheduler


def build_engine(args: EngineArgs) -> LLMEngine:
    model_config, cache_config, scheduler_config = args.configs()
    spec_config = args.speculative_config()
    runner = ModelRunner(model_config, cache_config, attention=args.attention, max_num_seqs=args.max_num_seqs,
                         speculative_tokens=spec_config.num_speculative_tokens if spec_config.enabled else 0,
                         max_model_len=scheduler_config.max_model_len)
    namespace = kv_namespace(runner, cache_config, kv_storage_dtype(cache_config.kv_cache_dtype, model_config.dtype))
    speculation = build_speculation(spec_config, runner, model_config, cache_config, scheduler_config)
    return LLMEngine(runner, runner.tokenizer, cache_config, scheduler_config, hash_block,
                     namespace.fingerprint(), seed=args.seed, speculation=speculation)


class LLM:
    """Offline generation on one in-process engine.

    >>> llm = LLM()                                   # the bundled model
    >>> llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.args = EngineArgs(model=model, **kwargs)
        self.engine = build_engine(self.args)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """The model's generation_config.json defaults (temperature, top_k, top_p, repetition_penalty,
        max_new_tokens) under `overrides`, as vLLM's `--generation-config auto` does."""
        return SamplingParams.from_generation_config(self.engine.runner.generation_config or {}, **overrides)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; final outputs in prompt order. Without
        `params`, the model's own defaults (`default_sampling_params()`)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.engine.generate(list(prompts), params or self.default_sampling_params())

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each step's output of one request as it is produced (text deltas in `.new_text`)."""
        request_id = f"stream-{next(self._ids)}"
        params = params or self.default_sampling_params()
        self.engine.add_request(request_id, prompt if isinstance(prompt, str) else list(prompt), params)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)
