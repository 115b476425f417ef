"""Frozen, validated engine configs (model, KV cache, scheduler): the engine owns them; `strata.config` re-exports.

Each area has its own dataclass; each validates on construction and names the field and the allowed range.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")
# `--quantization`: weight schemes applied at load time (None: the checkpoint's own quantization_config if it has
# one, else none). engine/quant/ implements them.
QUANTIZATION_SCHEMES = ("int8", "int4", "fp8", "mxfp4")
QUANT_GROUP_SIZES = (32, 64, 128)
# `--kv-cache-dtype`: auto = the model dtype; fp8 (e4m3) and int8 store KV with per-block, per-head scales.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Where the checkpoint lives and how to run it."""

    path: str
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    enforce_eager: bool | None = None   # True: never compile the decode step (vLLM's --enforce-eager); None:
                                        # compile unless STRATA_ENFORCE_EAGER=1
    quantization: str | None = None     # one of QUANTIZATION_SCHEMES, or None (the checkpoint's own, else none)
    quant_group_size: int = 128         # int4: columns per scale/zero group
    quantize_vocab: bool = False        # also the LM head and token embedding, with the same scheme

    def __post_init__(self) -> None:
        _require(bool(self.path), "model path must be a non-empty folder path")
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.device == "cpu" or self.device.startswith(("cuda", "mps")),
                 f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")
        _require(self.quantization is None or self.quantization in QUANTIZATION_SCHEMES,
                 f"quantization must be one of {QUANTIZATION_SCHEMES} or unset, got {self.quantization!r}")
        _require(self.quant_group_size in QUANT_GROUP_SIZES,
                 f"quant_group_size must be one of {QUANT_GROUP_SIZES}, got {self.quant_group_size}")
        _require(not self.quantize_vocab or self.quantization is not None,
                 "quantize_vocab needs a load-time quantization scheme: set quantization as well")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block-major `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`."""

    block_size: int = 16
    num_blocks: int = 2048
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    kv_cache_dtype: str = "auto"        # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 f"block_size must be a power of two from 1 to 256, got {self.block_size}")
        _require(self.num_blocks >= 2, f"num_blocks must be at least 2, got {self.num_blocks}")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype name the paged cache stores K/V in (the codec's and the namespace's `kv_dtype`)."""
    return {"auto": model_dtype, "fp8": "float8_e4m3fn", "int8": "int8"}[kv_cache_dtype]


def quantization_label(quantization: str | None, group_size: int, checkpoint_config: dict[str, Any],
                       quantize_vocab: bool = False) -> str:
    """The weights' quantization as the model fingerprint (and so the KV namespace) names it; torch-free, so the
    router computes the same label as the workers. A pre-quantized checkpoint (config.json `quantization_config`)
    is named by its method and a digest of that config; a load-time scheme by its name (int4 with its group
    size, "+vocab" when the vocabulary matrices are quantized too); "none" otherwise."""
    declared = checkpoint_config.get("quantization_config")
    if declared:
        method = str(declared.get("quant_method", "unknown")) if isinstance(declared, dict) else "unknown"
        digest = hashlib.blake2b(json.dumps(declared, sort_keys=True, default=str).encode(), digest_size=4)
        return f"ckpt-{method}-{digest.hexdigest()}"
    if quantization is None:
        return "none"
    label = f"int4-g{group_size}" if quantization == "int4" else quantization
    return label + "+vocab" if quantize_vocab else label


# `--speculative`: how a decode step proposes tokens for the target to verify (engine/spec/).
SPECULATIVE_METHODS = ("ngram", "draft", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes up to `num_speculative_tokens` tokens per request and step, the
    target verifies them in the continuous batch (exact rejection sampling). `method` None: off."""

    method: str | None = None
    num_speculative_tokens: int = 4     # the most proposed per request and step (adaptive length picks <= this)
    draft_model: str | None = None      # draft: a checkpoint folder; eagle: the head's folder (None: bundled)
    prompt_lookup_min: int = 1          # ngram: shortest suffix matched against the request's own tokens
    prompt_lookup_max: int = 4          # ngram: longest suffix tried first
    adaptive: bool = True               # per-request length from acceptance; off when it does not pay

    def __post_init__(self) -> None:
        _require(self.method is None or self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {SPECULATIVE_METHODS} or unset, got {self.method!r}")
        _require(isinstance(self.num_speculative_tokens, int)
                 and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                 f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                 f"got {self.num_speculative_tokens!r}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 32,
                 f"prompt_lookup_min/max must satisfy 1 <= min <= max <= 32, got {self.prompt_lookup_min}/"
                 f"{self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. `max_num_batched_tokens` is the per-step token budget (chunked prefill)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 "without chunked prefill, max_num_batched_tokens must be >= max_model_len")


# `--expert-parallel` and the MoE options: how a sparse layer runs its experts (engine/moe/).
MOE_BACKEND_NAMES = ("local", "expert_parallel")
MOE_OVERFLOW_POLICIES = ("drop", "next")


@dataclass(frozen=True)
class MoEConfig:
    """How sparse layers run their experts.

    - `backend`: local (every expert in this process) or expert_parallel (experts sharded over the ranks of an
      `engine.moe.ep_group.EPGroup`, tokens exchanged by all-to-all).
    - `capacity_factor`: None = no limit; else each expert takes at most ceil(factor * T * k / E) of a step's T
      tokens (per rank), and `overflow` says what happens to the rest: drop (the pair is dropped, the token keeps
      its residual) or next (the token's next-best expert with room). Counted either way.
    - `num_redundant_experts`: spare expert slots per rank for replicas of hot experts (EPLB); `eplb_interval`:
      forwards between automatic rebalances (0 = never), over a sliding window of `eplb_window` forwards of load.
    """

    backend: str = "local"
    capacity_factor: float | None = None
    overflow: str = "drop"
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    eplb_window: int = 200

    def __post_init__(self) -> None:
        _require(self.backend in MOE_BACKEND_NAMES,
                 f"moe backend must be one of {MOE_BACKEND_NAMES}, got {self.backend!r}")
        _require(self.capacity_factor is None or self.capacity_factor > 0,
                 f"moe capacity_factor must be > 0 or unset (no limit), got {self.capacity_factor!r}")
        _require(self.overflow in MOE_OVERFLOW_POLICIES,
                 f"moe overflow must be one of {MOE_OVERFLOW_POLICIES}, got {self.overflow!r}")
        _require(0 <= self.num_redundant_experts <= 1024,
                 f"num_redundant_experts must be in [0, 1024] (spare slots per rank), got {self.num_redundant_experts}")
        _require(self.eplb_interval >= 0, f"eplb_interval must be >= 0 forwards (0 = off), got {self.eplb_interval}")
        _require(self.eplb_window >= 1, f"eplb_window must be >= 1 forwards, got {self.eplb_window}")
