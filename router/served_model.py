"""A model the router serves: its tokenizer, block-hash namespace and limits, read from the checkpoint folder
without loading weights (the router hashes prompts exactly as the workers do, docs/architecture.md §3).

NOTE: nothing here imports torch (tests/unit/test_layering.py): `engine.checkpoint` reads config.json and the
safetensors headers, and `Namespace.for_model` is the workers' namespace definition on plain numbers."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from engine.checkpoint import load_checkpoint
from engine.config import CacheConfig, kv_storage_dtype, quantization_label
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatTemplateError, Tokenizer
from kvstore import codec
from kvstore.hashing import Namespace
from router.cost_model import CostModelConfig
from router.validation import GenerateParams, ModelLimits, invalid
from strata.v1 import common_pb2

@dataclass(frozen=True)
class QuantChoice:
    """The workers' quantization flags, which the block namespace covers (weights in the model fingerprint, the
    KV cache's storage dtype as `kv_dtype`)."""

    quantization: str | None = None
    group_size: int = 128
    kv_cache_dtype: str = "auto"
    quantize_vocab: bool = False


@dataclass(frozen=True)
class ServedModel:
    """A model the router serves: tokenizer, block-hash namespace and limits (what `ListModels` reports)."""

    id: str
    path: str
    tokenizer: Tokenizer
    namespace: Namespace          # salt-free; must equal the workers' (worker_common.engine_setup)
    block_size: int
    max_model_len: int
    vocab_size: int
    kv_bytes_per_token: int
    chat_stop_token_ids: tuple[int, ...] = ()
    sampling_defaults: tuple[tuple[str, float], ...] = ()

    @classmethod
    def load(cls, path: str, dtype: str = "float32", block_size: int = 16, max_model_len: int = 2048,
             model_id: str | None = None, quant: QuantChoice = QuantChoice()) -> "ServedModel":
        """Reads config.json, the safetensors headers and the tokenizer; no weights."""
        ckpt = load_checkpoint(path)
        spec = ckpt.spec
        # checks block_size and kv_cache_dtype as the workers' config does; salt-free
        cache = CacheConfig(block_size=block_size, kv_cache_dtype=quant.kv_cache_dtype)
        label = quantization_label(quant.quantization, quant.group_size, ckpt.config, quant.quantize_vocab)
        kv_dtype = kv_storage_dtype(cache.kv_cache_dtype, dtype)
        namespace = Namespace.for_model(ckpt.fingerprint(dtype, label), num_layers=spec.num_layers,
                                        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                        block_size=cache.block_size, kv_dtype=kv_dtype, cache_salt=cache.cache_salt)
        tokenizer = Tokenizer.from_dir(path)
        im_end = tokenizer.backend.token_to_id("<|im_end|>")
        chat_stops = (im_end,) if im_end is not None and "<|im_end|>" in (tokenizer.chat_template or "") else ()
        kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * codec.DTYPE_SIZES.get(kv_dtype, 4)
        return cls(model_id or Path(path).name, path, tokenizer, namespace, block_size, max_model_len,
                   spec.vocab_size, kv_bytes, chat_stops, sampling_defaults(ckpt.generation_config or {}))

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.id, self.max_model_len, self.vocab_size, self.sampling_defaults)

    def info(self) -> common_pb2.ModelInfo:
        ns = self.namespace
        return common_pb2.ModelInfo(id=self.id, max_model_len=self.max_model_len, kv=common_pb2.KvSpec(
            model_fingerprint=ns.model_fingerprint, kv_layout=ns.kv_layout, kv_dtype=ns.kv_dtype,
            block_size=self.block_size))

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The checkpoint's chat template, or a plain `role: content` transcript when it has none. A template that
        fails (its `raise_exception`, or the sandbox stopping it) is the request's INVALID_ARGUMENT, not a crash."""
        if self.tokenizer.chat_template:
            try:
                return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise invalid("messages", f"messages: model {self.id!r}: {exc}") from None
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def tokenize(self, params: GenerateParams) -> list[int]:
        if params.prompt_ids is not None:
            return list(params.prompt_ids)
        return self.tokenizer.encode(params.prompt_text or "", add_special_tokens=params.add_special_tokens)



def sampling_defaults(generation_config: dict) -> tuple[tuple[str, float], ...]:
    """The sampling options a checkpoint's generation_config.json sets, read as the engine reads them
    (`SamplingParams.from_generation_config`: a temperature under `do_sample: false` is not a default)."""
    params = SamplingParams.from_generation_config(generation_config)
    given = [name for name in SamplingParams.DEFAULT_KEYS if generation_config.get(name) is not None]
    if not generation_config.get("do_sample", False):
        given = [name for name in given if name != "temperature"]
    return tuple((name, getattr(params, name)) for name in given)


def cost_config_for(model: ServedModel, base: CostModelConfig) -> CostModelConfig:
    return base.replace(block_size=model.block_size, kv_bytes_per_token=model.kv_bytes_per_token)

