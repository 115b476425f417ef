"""Weight quantization schemes, keyed by the name users write (`--quantization int4`).

    scheme   weights                                   activations   module (engine.quant.linear)
    int8     int8, per output channel, symmetric       as the model  Int8Linear   (torch._weight_int8pack_mm)
    int4     uint4 + int zero point per group of g     as the model  Int4Linear   (int4pack mm / Triton)
    fp8      e4m3, per output channel                  e4m3/token    Fp8Linear    (torch._scaled_mm)
    mxfp4    e2m1 + e8m0 scale per 32 columns          as the model  Mxfp4Linear  (table dequant / Triton)
"""
from __future__ import annotations

from engine.quant.schemes.base import QuantScheme
from engine.quant.schemes.fp8 import Fp8Scheme
from engine.quant.schemes.int4 import Int4Scheme
from engine.quant.schemes.int8 import Int8Scheme
from engine.quant.schemes.mxfp4 import Mxfp4Scheme

__all__ = ["SCHEMES", "QuantScheme", "make_scheme"]

SCHEMES: dict[str, type[QuantScheme]] = {s.name: s for s in (Int8Scheme, Int4Scheme, Fp8Scheme, Mxfp4Scheme)}


def make_scheme(name: str, group_size: int = 128) -> QuantScheme:
    """The scheme for `quantization=name`; `group_size` is used by the grouped schemes (int4)."""
    if name not in SCHEMES:
        raise ValueError(f"quantization {name!r} is unknown; use one of {sorted(SCHEMES)}")
    return SCHEMES[name](group_size)
