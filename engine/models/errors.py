"""Typed checkpoint errors (STYLE habit 10): each names the file, tensor or field and what was expected.

All subclass `CheckpointError(ValueError)`, so a caller can catch one family or one precise case.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A local checkpoint folder cannot be served as it is."""


class UnsupportedArchitectureError(CheckpointError):
    """config.json names an architecture that no model in the registry implements."""


class ConfigFieldError(CheckpointError):
    """A config.json field is missing or holds a value the runtime does not support."""


class MissingFileError(CheckpointError):
    """A file the checkpoint needs (config, shard, tokenizer) is absent."""


class MissingTensorError(CheckpointError):
    """A weight the model needs is in none of the safetensors files."""


class TensorShapeError(CheckpointError):
    """A weight has a shape other than the one config.json implies."""


class TokenizerMismatchError(CheckpointError):
    """The tokenizer can emit ids that the model's embedding table does not have."""
