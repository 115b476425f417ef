"""What a Hugging Face checkpoint folder says without reading its weights: config.json parsed into a `ModelSpec`,
the weight shards, generation_config.json, and the model fingerprint of the KV namespace.

    folder/
      config.json                   -> Checkpoint.config, .spec
      generation_config.json        -> Checkpoint.generation_config ({} when absent)
      model.safetensors             -> Checkpoint.files (or the shards model.safetensors.index.json lists)
      tokenizer.json                   (engine.tokenizer)

NOTE: this module imports no torch (nor anything that does): the router reads the model it serves through it
(tokenizer, limits, block-hash namespace) in a process that never loads tensors. `engine.loader` builds on it.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.errors import MissingFileError
from engine.models.spec import ModelSpec, parse_spec

__all__ = ["INDEX_FILE", "Checkpoint", "fingerprint", "load_checkpoint", "read_header", "weight_files"]

INDEX_FILE = "model.safetensors.index.json"


def read_header(path: Path) -> bytes:
    """A safetensors file's JSON header: an 8-byte little-endian length, then that many bytes."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length)


def _index_files(folder: Path) -> list[Path]:
    index = json.loads((folder / INDEX_FILE).read_text())
    names = sorted(set(index.get("weight_map", {}).values()))
    for name in names:
        if not (folder / name).is_file():
            raise MissingFileError(f"{folder / INDEX_FILE} lists shard {name!r}, which is missing from {folder}")
    return [folder / n for n in names]


def weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        return _index_files(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MissingFileError(f"{folder}: no *.safetensors weights file (and no {INDEX_FILE})")
    return files


def fingerprint(spec: ModelSpec, files: list[Path], dtype: str, quantization: str = "none") -> str:
    """`arch/digest/dtype/quant` for the KV namespace. The digest covers the parsed spec (so a RoPE change is a
    new namespace) and every shard's safetensors header (names, dtypes, shapes, offsets) and file size: cheap
    (no weight bytes read) yet changes with any re-export."""
    digest = hashlib.blake2b(repr(spec).encode(), digest_size=16)
    for path in files:
        digest.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        digest.update(read_header(path))
    return f"{spec.architecture}/{digest.hexdigest()}/{dtype}/{quantization}"


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    config: dict[str, Any]
    spec: ModelSpec
    files: tuple[Path, ...]
    generation_config: dict[str, Any]

    def fingerprint(self, dtype: str, quantization: str = "none") -> str:
        return fingerprint(self.spec, list(self.files), dtype, quantization)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Parse config.json and the safetensors headers; no weights read. Errors name the file and field."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"{config_path}: config.json is missing; expected a Hugging Face checkpoint folder")
    config = json.loads(config_path.read_text())
    spec = parse_spec(config, str(config_path))
    gen_path = folder / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return Checkpoint(folder, config, spec, tuple(weight_files(folder)), generation)
