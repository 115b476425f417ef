"""Pre-quantized checkpoints in the formats people download: compressed-tensors (llmcompressor), GPTQ, AWQ.

    checkpoint_quantization(config, source) -> CheckpointQuant | None
        .scheme          "int8" | "int4" | "fp8"       the engine scheme the quantized linears map to
        .name            "ct-int4-g128", "gptq-int4-g64", "awq-int4-g128", "ct-fp8", ...   (model fingerprint)
        .activations     ActivationQuant | None        dynamic activation quantization the checkpoint declares
        .is_quantized(reader, "model.layers.0.self_attn.q_proj") -> bool
        .read(reader, "model.layers.0.self_attn.q_proj")         -> IntWeight | Fp8Weight   (engine/quant/packed.py)

Readers only unpack into the format-neutral weights; kernels and module swaps live elsewhere (engine/quant/).
Anything a reader does not implement is refused when config.json is read, with a ConfigFieldError naming the field.
"""
from __future__ import annotations

from typing import Any, Callable

from engine.models.errors import ConfigFieldError
from engine.quant.formats.awq import parse_awq
from engine.quant.formats.base import SCHEMES, ActivationQuant, CheckpointQuant
from engine.quant.formats.compressed_tensors import parse_compressed_tensors
from engine.quant.formats.fields import Fields
from engine.quant.formats.gptq import parse_gptq

__all__ = ["METHODS", "SCHEMES", "ActivationQuant", "CheckpointQuant", "checkpoint_quantization"]

# `quantization_config.quant_method` -> parser of the rest of `quantization_config`
METHODS: dict[str, Callable[[Fields], CheckpointQuant]] = {
    "compressed-tensors": parse_compressed_tensors,
    "gptq": parse_gptq,
    "awq": parse_awq,
}


def checkpoint_quantization(config: dict[str, Any], source: str) -> CheckpointQuant | None:
    """The quantization a checkpoint's config.json declares (`quantization_config`), None when it has none.
    Raises engine.models.errors.ConfigFieldError naming the field (e.g. "quantization_config.quant_method",
    "quantization_config.bits", "quantization_config.config_groups.group_0.weights.strategy") and what is
    supported, for anything unsupported. `source` (the config.json path) prefixes every message."""
    declared = config.get("quantization_config")
    if declared is None:
        return None
    if not isinstance(declared, dict):
        raise ConfigFieldError(f"{source}: quantization_config is {declared!r}; supported: an object")
    qc = Fields(declared, "quantization_config", source)
    method = qc.choice("quant_method", tuple(METHODS))
    return METHODS[method](qc)
