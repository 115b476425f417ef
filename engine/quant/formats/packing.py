"""Integers packed into 32-bit words, least significant first, as GPTQ, AWQ and compressed-tensors store them.

    word (32 bits):  [ v7 | v6 | v5 | v4 | v3 | v2 | v1 | v0 ]    bits=4: v_j in bits [4j, 4j + 4)
                       31                              3    0

`unpack_words(words, bits, dim)` lays the values of each word out along `dim`, v0 first:
    dim=0 (GPTQ qweight):           [k / 8, n] -> [k, n]      row 8r + j <- value j of word (r, c)
    dim=1 (AWQ, compressed-tensors): [n, k / 8] -> [n, k]      col 8c + j <- value j of word (r, c)
"""
from __future__ import annotations

import torch

WORD_BITS = 32


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-wide values (int32) from an int32 (or int64 holding unsigned 32-bit) 2-D tensor."""
    assert WORD_BITS % bits == 0 and words.dim() == 2 and dim in (0, 1), (bits, words.shape, dim)
    shifts = torch.arange(0, WORD_BITS, bits, dtype=words.dtype)            # [per]
    # NOTE: an arithmetic shift of a negative int32 smears the sign bit only above the field that the mask keeps.
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)            # [rows, cols, per]
    if dim == 0:
        values = values.transpose(1, 2)                                     # [rows, per, cols]
    return values.flatten(dim, dim + 1).to(torch.int32).contiguous()


def add_per_field(words: torch.Tensor, bits: int, delta: int) -> torch.Tensor:
    """`words` as int64 (unsigned 32-bit) plus `delta` in every field, as one 32-bit word addition that carries
    across fields and wraps at 2**32 (GPTQ v1 qzeros <-> v2; see gptq.py)."""
    per_field = sum(1 << (bits * j) for j in range(WORD_BITS // bits))     # 0x11111111 for bits=4
    return ((words.to(torch.int64) & 0xFFFFFFFF) + delta * per_field) & 0xFFFFFFFF
