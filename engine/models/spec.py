"""`ModelSpec`: the hyperparameters of a checkpoint, parsed and validated once from config.json.

Accepts both the current `rope_parameters` form and the older `rope_theta` + `rope_scaling` form, and both
spellings of the expert count (`num_experts`, `num_local_experts`). Sliding windows are resolved per layer here, the
way each architecture's transformers config does it, so nothing downstream reads config.json again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.errors import ConfigFieldError, UnsupportedArchitectureError
from engine.models.registry import ARCHITECTURES, ArchTraits, supported_architectures

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    params: tuple[tuple[str, Any], ...] = ()   # the scaling fields as given (factor, beta_fast, ...)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int          # 0: no shared expert
    sparse_layers: tuple[int, ...]         # layer indices whose MLP is sparse


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeSpec
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: MoESpec | None
    layer_windows: tuple[int | None, ...]  # per layer: keys in (p - window, p] are visible; None: full attention

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def prefix_cache_salt(self, prompt_len: int) -> str:
        """What a prompt's block hashes must also cover (a namespace `cache_salt`) for its cached KV to be what
        this request computes: "" unless dynamic NTK rotates the prompt for its own length L > max_position_embeddings
        (rope.py), whose blocks may serve only prompts of that same L. Bookkeeping only (no tensors)."""
        if self.rope.rope_type != "dynamic" or prompt_len <= self.max_position_embeddings:
            return ""
        return f"dynamic-ntk-prompt-len={prompt_len}"


def _field(config: dict[str, Any], key: str, source: str, default: Any = None) -> Any:
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise ConfigFieldError(f"{source}: required field {key!r} is missing")
    return value


def _positive_int(config: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    value = _field(config, key, source, default)
    if not isinstance(value, int) or value < 1:
        raise ConfigFieldError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def parse_rope(config: dict[str, Any], traits: ArchTraits, source: str) -> RopeSpec:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", config.get("rope_theta", traits.default_rope_theta)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigFieldError(f"{source}: rope type {rope_type!r} (rope_parameters.rope_type) is not supported; "
                               f"supported: {list(ROPE_TYPES)}")
    if rope_type != "default" and "factor" not in rope and rope_type != "yarn":
        raise ConfigFieldError(f"{source}: rope type {rope_type!r} needs a 'factor' in rope_parameters")
    if config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigFieldError(f"{source}: partial_rotary_factor != 1.0 is not supported")
    return RopeSpec(rope_type, theta, tuple(sorted(rope.items())))


def _sparse_layers(config: dict[str, Any], num_layers: int, num_experts: int, traits: ArchTraits) -> tuple[int, ...]:
    if traits.moe == "mixtral":
        return tuple(range(num_layers))
    step = int(config.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    return tuple(i for i in range(num_layers)
                 if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)


def parse_moe(config: dict[str, Any], traits: ArchTraits, num_layers: int, source: str) -> MoESpec | None:
    if traits.moe == "none":
        return None
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ConfigFieldError(f"{source}: field 'num_experts' (or 'num_local_experts') must be a positive "
                               f"integer, got {num_experts!r}")
    top_k = _positive_int(config, "num_experts_per_tok", source)
    if top_k > num_experts:
        raise ConfigFieldError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    mixtral = traits.moe == "mixtral"
    size_key = "intermediate_size" if mixtral else "moe_intermediate_size"
    return MoESpec(
        num_experts=num_experts, top_k=top_k,
        intermediate_size=_positive_int(config, size_key, source),
        norm_topk_prob=True if mixtral else bool(config.get("norm_topk_prob", False)),
        shared_intermediate_size=_positive_int(config, "shared_expert_intermediate_size", source)
        if traits.shared_expert else 0,
        sparse_layers=_sparse_layers(config, num_layers, num_experts, traits))


def _check_supported_features(config: dict[str, Any], source: str) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigFieldError(f"{source}: hidden_act {config.get('hidden_act')!r} is not supported; expected 'silu'")


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _window_size(config: dict[str, Any], traits: ArchTraits, source: str) -> int | None:
    """The window every sliding layer uses, or None when the model has none (as transformers' config resolves it:
    the Qwen families ignore `sliding_window` unless `use_sliding_window` is true)."""
    gated = traits.sliding not in ("none", "all")
    if traits.sliding == "none" or (gated and not config.get("use_sliding_window", False)):
        return None
    window = config.get("sliding_window")
    if window is None and not gated:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        need = "use_sliding_window=true needs 'sliding_window' to be" if gated else \
            "field 'sliding_window' must be null (full attention) or"
        raise ConfigFieldError(f"{source}: {need} a positive integer, got {window!r}")
    return window


def _qwen_sliding_layers(config: dict[str, Any], traits: ArchTraits, num_layers: int, source: str) -> list[bool]:
    """Qwen2/Qwen3/Qwen2-MoE: `layer_types` when given, else the rule each transformers config derives it by."""
    types = config.get("layer_types")
    if types is not None:
        if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
            raise ConfigFieldError(f"{source}: field 'layer_types' must list {num_layers} entries, each one of "
                                   f"{list(_LAYER_TYPES)}; got {types!r}")
        return [t == "sliding_attention" for t in types]
    first_full = config.get("max_window_layers")
    first_full = 28 if first_full is None else first_full           # transformers' default
    if traits.sliding == "qwen2":
        return [i >= first_full for i in range(num_layers)]
    return [i % 2 == 0 and i < first_full for i in range(num_layers)]   # qwen2_moe


def _check_all_sliding(config: dict[str, Any], source: str) -> None:
    types = config.get("layer_types")
    if types is not None and any(t != "sliding_attention" for t in types):
        # NOTE: transformers' modeling for these architectures ignores layer_types and slides every layer; a
        # config asking for full layers is meant for another model class, so refuse it rather than guess.
        raise ConfigFieldError(f"{source}: field 'layer_types' with full-attention layers is not supported for "
                               f"this architecture (every layer uses 'sliding_window'); got {types!r}")


def parse_windows(config: dict[str, Any], traits: ArchTraits, num_layers: int,
                  source: str) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full attention)."""
    full: tuple[int | None, ...] = (None,) * num_layers
    window = _window_size(config, traits, source)
    if traits.sliding in ("qwen2", "qwen2_moe"):
        sliding = _qwen_sliding_layers(config, traits, num_layers, source)
        if window is None and any(sliding) and config.get("layer_types") is not None:
            # transformers fails here too (a sliding layer without a window); full attention would be a guess
            raise ConfigFieldError(f"{source}: field 'layer_types' names sliding_attention layers but the sliding "
                                   f"window is off (use_sliding_window / sliding_window)")
        return full if window is None else tuple(window if slides else None for slides in sliding)
    if window is None:
        return full
    _check_all_sliding(config, source)
    return (window,) * num_layers


def architecture_of(config: dict[str, Any], source: str) -> str:
    names = config.get("architectures") or []
    if not names:
        raise ConfigFieldError(f"{source}: field 'architectures' is missing or empty; expected one of "
                               f"{supported_architectures()}")
    if names[0] not in ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{source}: architecture {names[0]!r} is not supported; supported "
                                           f"architectures: {supported_architectures()}")
    return names[0]


def parse_spec(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Validate config.json into a `ModelSpec`; every error names `source` and the field."""
    arch = architecture_of(config, source)
    traits = ARCHITECTURES[arch]
    _check_supported_features(config, source)
    hidden = _positive_int(config, "hidden_size", source)
    heads = _positive_int(config, "num_attention_heads", source)
    kv_heads = _positive_int(config, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ConfigFieldError(f"{source}: num_attention_heads={heads} must be a multiple of "
                               f"num_key_value_heads={kv_heads}")
    layers = _positive_int(config, "num_hidden_layers", source)
    windows = parse_windows(config, traits, layers, source)
    qkv_bias = bool(config.get(traits.qkv_bias_key, traits.qkv_bias_default)) if traits.qkv_bias_key \
        else traits.qkv_bias_default
    return ModelSpec(
        architecture=arch, vocab_size=_positive_int(config, "vocab_size", source), hidden_size=hidden,
        intermediate_size=_positive_int(config, "intermediate_size", source), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=_positive_int(config, "head_dim", source, hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", traits.default_rms_eps)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=_positive_int(config, "max_position_embeddings", source, 4096),
        rope=parse_rope(config, traits, source), qkv_bias=qkv_bias,
        o_bias=qkv_bias and traits.o_bias_follows_qkv, mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=traits.qk_norm, moe=parse_moe(config, traits, layers, source),
        layer_windows=windows)
