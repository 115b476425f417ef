"""Model definitions: one shared decoder (decoder.py), pluggable parts (layers.py), the architecture registry."""
from engine.models.registry import ARCHITECTURES, supported_architectures
from engine.models.spec import ModelSpec, parse_spec

__all__ = ["ARCHITECTURES", "ModelSpec", "parse_spec", "supported_architectures"]
