"""Load a local Hugging Face checkpoint folder: config.json, `*.safetensors` (single or sharded with
model.safetensors.index.json), tokenizer.json (+ tokenizer_config.json), generation_config.json.

    load_checkpoint(path) -> Checkpoint      cheap: parses config and safetensors headers, no weights read
                                             (engine.checkpoint, torch-free; re-exported here)
    load_model(model_config) -> LoadedModel  builds the decoder and fills its (fused, stacked) weights; linears a
                                             pre-quantized checkpoint stores quantized load into quantized modules
                                             (engine.quant.prequantized), else `model_config.quantization`
                                             quantizes the float weights (engine.quant.apply)

Errors are `CheckpointError` subclasses (all `ValueError`) naming the file, tensor or field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.checkpoint import Checkpoint, load_checkpoint, read_header
from engine.models.decoder import CausalLM
from engine.moe.backend import MoESetup
from engine.models.errors import (CheckpointError, ConfigFieldError, MissingFileError, MissingTensorError,
                                  TensorShapeError, TokenizerMismatchError, UnsupportedArchitectureError)
from engine.models.spec import ModelSpec
from engine.models.weights import load_weights
from engine.quant.apply import quantize_model, quantize_vocab
from engine.quant.formats import CheckpointQuant, checkpoint_quantization
from engine.quant.prequantized import load_prequantized
from engine.quant.schemes import make_scheme
from engine.tokenizer import Tokenizer
from engine.config import ModelConfig, quantization_label

__all__ = ["Checkpoint", "CheckpointError", "ConfigFieldError", "LoadedModel", "MissingFileError",
           "MissingTensorError", "SafetensorsReader", "TensorShapeError", "TokenizerMismatchError",
           "UnsupportedArchitectureError", "load_checkpoint", "load_model", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class SafetensorsReader:
    """Tensor shapes from the headers (no data read), tensors on demand, across all shards."""

    def __init__(self, files: list[Path]) -> None:
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            header = json.loads(read_header(path))
            for name, info in header.items():
                if name != "__metadata__":
                    self._file_of[name], self._shapes[name] = path, tuple(info["shape"])
        self._handles: dict[Path, Any] = {}

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def file_of(self, name: str) -> str:
        return self._file_of[name].name

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


def check_tokenizer(tokenizer: Tokenizer, spec: ModelSpec, folder: Path) -> None:
    if tokenizer.vocab_size > spec.vocab_size:
        raise TokenizerMismatchError(
            f"{folder / 'tokenizer.json'}: the tokenizer has {tokenizer.vocab_size} ids but config.json's "
            f"vocab_size is {spec.vocab_size}; the tokenizer must not emit ids beyond the embedding table")


@dataclass
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: Tokenizer
    fingerprint: str
    generation_config: dict[str, Any]
    quantization: str = "none"          # how the weights run: "none", a scheme's tag ("int4-g128") or the checkpoint
                                        # format's name ("gptq-int4-g128"); the fingerprint uses quantization_label


def checkpoint_quant(ckpt: Checkpoint, model_config: ModelConfig) -> CheckpointQuant | None:
    """The checkpoint's own quantization (config.json's `quantization_config`) or None. A `quantization` asked
    for that differs from the checkpoint's is refused (ValueError naming the field); a matching one, or none,
    serves the checkpoint as it is (its own group size wins over `quant_group_size`)."""
    cq = checkpoint_quantization(ckpt.config, str(ckpt.folder / "config.json"))
    if cq is not None and model_config.quantization not in (None, cq.scheme):
        raise ValueError(f"quantization={model_config.quantization!r} differs from the checkpoint's own "
                         f"({cq.name}, scheme {cq.scheme!r}); leave quantization unset or set it to {cq.scheme!r}")
    if cq is not None and model_config.quantize_vocab:
        raise ValueError(f"quantize_vocab: the checkpoint is already quantized ({cq.name}); its vocabulary "
                         "matrices load as it stores them")
    return cq


def _fill(model: CausalLM, ckpt: Checkpoint, cq: CheckpointQuant | None) -> None:
    """Load every weight: the checkpoint's quantized linears into quantized modules first, then the float rest."""
    reader = SafetensorsReader(list(ckpt.files))
    try:
        done = load_prequantized(model, ckpt.spec, reader, cq) if cq is not None else frozenset()
        load_weights(model, ckpt.spec, reader, skip=done)
    finally:
        reader.close()


def load_model(model_config: ModelConfig, moe_backend: MoESetup | str = "local") -> LoadedModel:
    """Read, check and place a checkpoint on `model_config.device` in `model_config.dtype`, quantized as the
    checkpoint stores it or as `model_config.quantization` asks (the fingerprint names which)."""
    ckpt = load_checkpoint(model_config.path)
    tokenizer = Tokenizer.from_dir(ckpt.folder)
    check_tokenizer(tokenizer, ckpt.spec, ckpt.folder)
    cq = checkpoint_quant(ckpt, model_config)
    device, dtype = torch.device(model_config.device), torch_dtype(model_config.dtype)
    model = CausalLM(ckpt.spec, dtype, device, moe_backend)
    _fill(model, ckpt, cq)
    if cq is None and model_config.quantization is not None:
        scheme = make_scheme(model_config.quantization, model_config.quant_group_size)
        quantize_model(model, scheme)
        if model_config.quantize_vocab:
            quantize_vocab(model, scheme)
    model.post_load()
    model.eval()
    # NOTE: the fingerprint's label is engine.config's torch-free one, which the router computes too
    label = quantization_label(model_config.quantization, model_config.quant_group_size, ckpt.config,
                               model_config.quantize_vocab)
    tag = cq.name if cq is not None else label
    return LoadedModel(model, ckpt.spec, tokenizer, ckpt.fingerprint(model_config.dtype, label),
                       ckpt.generation_config, tag)
