"""The scheme contract: how a float weight becomes a `QuantizedWeight`, and which module runs it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import quantization_label
from engine.quant.packed import QuantizedWeight


@dataclass(frozen=True)
class QuantScheme(ABC):
    """Contract:

    - `quantize(w [n, k] float)` rounds to nearest and returns a `QuantizedWeight` whose `dequantize()` is the
      matrix the packed module multiplies by. It does not modify `w`. It raises ValueError naming the field
      (`quant_group_size`, the shape) when `w`'s shape cannot be quantized this way.
    - `pack(qw, bias, dtype, device)` builds the module that runs `qw` (engine.quant.linear.quantized_linear).
    - `tag` names the scheme and its parameters in the model fingerprint ("int4-g128"), so KV computed under
      different quantizations never share a namespace.
    """

    group_size: int = 128

    name = ""

    @property
    def tag(self) -> str:
        return quantization_label(self.name, self.group_size, {})

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        ...

    def pack(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
             device: torch.device) -> nn.Module:
        from engine.quant.linear import quantized_linear
        return quantized_linear(qw, bias, dtype, device)


def check_matrix(w: torch.Tensor, scheme: str) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{scheme}: weight must be a float [out_features, in_features] matrix, got "
                         f"{w.dtype} {list(w.shape)}")
