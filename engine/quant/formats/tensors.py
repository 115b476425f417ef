"""Checked reads of a checkpoint's quantization tensors: the shape is checked against the safetensors header before
any data is read, the dtype right after; a failure names the tensor, its file and what was expected."""
from __future__ import annotations

import torch

from engine.models.errors import MissingTensorError, TensorShapeError
from engine.models.weights import TensorReader

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Shape = tuple[int | None, ...]   # None: any size in that dimension


def _matches(shape: tuple[int, ...], expected: Shape) -> bool:
    return len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))


def shape_error(reader: TensorReader, name: str, expected: str) -> TensorShapeError:
    return TensorShapeError(f"tensor {name!r} in {reader.file_of(name)} has shape {list(reader.shape(name))}, "
                            f"expected {expected}")


def has_tensor(reader: TensorReader, name: str) -> bool:
    return reader.shape(name) is not None


def read_tensor(reader: TensorReader, name: str, shapes: tuple[Shape, ...], dtypes: tuple[torch.dtype, ...],
                what: str) -> torch.Tensor:
    """`name` if its shape matches one of `shapes` and its dtype is one of `dtypes`; `what` says what it is for."""
    shape = reader.shape(name)
    if shape is None:
        raise MissingTensorError(f"tensor {name!r} ({what}) is in none of the checkpoint's safetensors files")
    if not any(_matches(tuple(shape), s) for s in shapes):
        shown = " or ".join(str(["*" if d is None else d for d in s]) for s in shapes)
        raise shape_error(reader, name, f"{shown} ({what})")
    tensor = reader.get(name)
    if tensor.dtype not in dtypes:
        raise TensorShapeError(f"tensor {name!r} in {reader.file_of(name)} has dtype {tensor.dtype}, expected one of "
                               f"{[str(d) for d in dtypes]} ({what})")
    return tensor
