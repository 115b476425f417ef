"""What a pre-quantized checkpoint declares, as the loader meets it: one `CheckpointQuant` per checkpoint.

    checkpoint_quantization(config, source) -> CheckpointQuant | None      (engine/quant/formats/__init__.py)
    quant.is_quantized(reader, "model.layers.0.self_attn.q_proj")  -> True
    quant.read(reader, "model.layers.0.self_attn.q_proj")          -> IntWeight | Fp8Weight   ([out, in])
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.models.weights import TensorReader
from engine.quant.packed import QuantizedWeight

SCHEMES = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class ActivationQuant:
    """Activations the checkpoint was made to see quantized on the fly: no stored scale, computed per `granularity`
    ("token" or "tensor") at run time in `dtype` ("fp8" e4m3 or "int8"). Serving the weights with unquantized
    activations is the more precise choice; a kernel that quantizes them reproduces the checkpoint's intent."""

    dtype: str
    granularity: str


class CheckpointQuant(ABC):
    """The quantization a checkpoint's config.json declares, and the reader of its quantized linears.

    Contract:
    - `scheme` is the engine scheme every quantized linear maps to ("int8" | "int4" | "fp8"); `name` is stable for
      a given config (it goes into the model fingerprint); `activations` is None for weight-only checkpoints.
    - `hf_prefix` names a linear module as the checkpoint does ("model.layers.0.mlp.experts.3.down_proj",
      "lm_head"); asking about anything else (an embedding, a norm) has no meaning.
    - `is_quantized(reader, hf_prefix)` reads no tensor data (config and safetensors headers only); False means
      the linear is stored as a plain `{hf_prefix}.weight` (e.g. lm_head, an ignored layer).
    - `read(reader, hf_prefix)` returns the weight `[out_features, in_features]` whose `dequantize()` is exactly
      what the format's own reference dequantization computes (in float32). Bias tensors are not read here.
    - Tensors that are missing, misshaped or of the wrong dtype raise MissingTensorError / TensorShapeError
      naming the tensor and its file; nothing is guessed or silently repaired.
    """

    scheme: str
    name: str
    activations: ActivationQuant | None = None

    @abstractmethod
    def is_quantized(self, reader: TensorReader, hf_prefix: str) -> bool: ...

    @abstractmethod
    def read(self, reader: TensorReader, hf_prefix: str) -> QuantizedWeight: ...
