"""Load a local Hugging Face checkpoint folder: config.json, `*.safetensors` (single or sharded with
model.safetensors.index.json), tokenizer.json (+ tokenizer_config.json), generation_config.json.

    load_checkpoint(path) -> Checkpoint      cheap: parses config and safetensors headers, no weights read
                                             (engine.checkpoint, torch-free; re-exported here)
    load_model(model_config) -> LoadedModel  builds the decoder and fills its (fused, stacked) weights

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
from engine.models.errors import (CheckpointError, ConfigFieldError, MissingFileError, MissingTensorError,
                                  TensorShapeError, TokenizerMismatchError, UnsupportedArchitectureError)
from engine.models.spec import ModelSpec
from engine.models.weights import load_weights
from engine.tokenizer import Tokenizer
from engine.config import ModelConfig

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


def load_model(model_config: ModelConfig, moe_backend: str = "local") -> LoadedModel:
    """Read, check and place a checkpoint on `model_config.device` in `model_config.dtype`."""
    ckpt = load_checkpoint(model_config.path)
    tokenizer = Tokenizer.from_dir(ckpt.folder)
    check_tokenizer(tokenizer, ckpt.spec, ckpt.folder)
    device, dtype = torch.device(model_config.device), torch_dtype(model_config.dtype)
    model = CausalLM(ckpt.spec, dtype, device, moe_backend)
    reader = SafetensorsReader(list(ckpt.files))
    try:
        load_weights(model, ckpt.spec, reader)
    finally:
        reader.close()
    model.post_load()
    model.eval()
    return LoadedModel(model, ckpt.spec, tokenizer, ckpt.fingerprint(model_config.dtype), ckpt.generation_config)
