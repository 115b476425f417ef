"""Quantized linear modules: drop-ins for `engine.models.layers.Linear` (`forward(x [..., k]) -> x W^T + b`, the
same optional `bias` parameter), where W is a `QuantizedWeight`'s `dequantize()` kept packed for its kernel.

    module        built from                         runs (engine.quant.kernels)
    Int8Linear    IntWeight 8-bit, symmetric, per    torch._weight_int8pack_mm (CPU, bf16) / cast + cuBLAS (CUDA)
                  output channel                     (W8A16)
    Int4Linear    IntWeight 4-bit, groups of 32..256 int4pack mm (CPU, bf16) / Triton int4_matmul (CUDA) (W4A16)
    Fp8Linear     Fp8Weight                          activations e4m3 per token (W8A8): torch._scaled_mm
                                                     (CUDA) / table dequant of both + F.linear (CPU)
    Mxfp4Linear   Mxfp4Weight                        table dequant + F.linear (CPU) / Triton (CUDA)
    DequantLinear any, where no kernel takes it      dequantize in forward, then F.linear (logged once)
    ConcatLinear  parts that cannot be one weight    each part's module, outputs concatenated

`QuantLinear.rows(ids)` dequantizes chosen output rows (`[T, k]`), which is how `QuantEmbedding` looks tokens up in
a quantized vocabulary matrix: with tied embeddings the LM head's module serves the lookup from its own buffers.
Only the CPU int4 module cannot (torch's int4pack layout interleaves rows); `quantized_rows` then keeps a
row-major copy (packed nibbles, 0.5 byte per weight).

`quantized_linear(qw, bias, dtype, device)` picks one; `quantized_linear_parts` joins fused parts (q|k|v). The
quantized tensors are buffers, the bias a parameter (so a loader fills `<name>.bias` exactly as for Linear).
Activations arrive in the model dtype `dtype`.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.quant.dequant_tables import dequant_table, mxfp4_dequant
from engine.quant.kernels import (fp8_mm_cpu, fp8_mm_cuda, int4_mm_cpu, int4_mm_cuda, int8_mm, int_kernel_dtype,
                                  mxfp4_mm_cuda)
from engine.quant.packed import Fp8Weight, IntWeight, Mxfp4Weight, QuantizedWeight, concat_rows

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()
INT4_CPU_GROUPS = (32, 64, 128, 256)     # what torch's CPU int4pack kernel accepts
INT4_CPU_N_MULTIPLE = 16                 # ... and its weight packing ("expect N to be dividable by 16")
FP8_CUDA_MULTIPLE = 16                   # torch._scaled_mm on CUDA: k and n multiples of 16


class QuantLinear(nn.Module):
    """Contract: `forward(x [..., k]) == x[..., perm] @ W.T + bias` in x's dtype, with W the weight's
    `dequantize()`, up to the kernel's rounding: the activation dtype's; bf16's for int8/int4 on CPU (their
    kernels compute in bf16, scales included); fp8's per-token activation quantization. x is not modified."""

    def __init__(self, n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                 perm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = k, n
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype=dtype, device=device).reshape(n),
                                                           requires_grad=False)
        self.register_buffer("perm", None if perm is None else perm.to(device=device, dtype=torch.long))  # [k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)                                  # [m, k]
        if self.perm is not None:
            x2 = x2[:, self.perm]                                             # act-order: column j <- perm[j]
        y = self.matmul(x2)                                                   # [m, n]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """float32 `[T, k]`: rows `ids` of the dequantized weight (input-feature order); None where the layout
        cannot gather rows."""
        return None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    def __init__(self, qw: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        n, k = qw.shape
        super().__init__(n, k, bias, dtype, device, qw.perm)
        self.kernel_dtype = int_kernel_dtype(dtype, torch.device(device))
        self.kernel = cpu_kernels.int8_kernel(torch.device(device))     # Strata's CPU kernel: fp32 scales and sums
        self.register_buffer("q", qw.q.to(device=device, dtype=torch.int8).contiguous())  # [n, k]
        # NOTE: torch's kernel wants the scales in its activation dtype (and Inductor wants them stored so).
        scale_dtype = torch.float32 if self.kernel else self.kernel_dtype
        self.register_buffer("scale", qw.scale.reshape(n).to(device=device, dtype=scale_dtype))  # [n]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_kernels.int8_linear(x, self.q, self.scale)          # x unrounded, fp32 sums and scales
        return int8_mm(x.to(self.kernel_dtype), self.q, self.scale).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return self.q[ids].float() * self.scale[ids].float()[:, None]


def unsigned_int4(qw: IntWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q 0..15 `[n, k]` int32, integer zero point `[n, k / g]` float32): a symmetric weight (signed q, no zero)
    becomes q + 8 with zero point 8."""
    if qw.zero is None:
        return qw.q.to(torch.int32) + 8, torch.full(qw.scale.shape, 8.0)
    return qw.q.to(torch.int32), qw.zero.float()


def triton_int4_layout(qw: IntWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qpacked `[n, k / 2]` uint8, scale, zero `[n, k / g]` float32) as triton_gemm.int4_matmul takes them."""
    from engine.quant.triton_gemm import pack_int4
    q, zero = unsigned_int4(qw)
    return pack_int4(q).contiguous(), qw.scale.float().contiguous(), zero.contiguous()


class Int4Linear(QuantLinear):
    def __init__(self, qw: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        n, k = qw.shape
        super().__init__(n, k, bias, dtype, device, qw.perm)
        self.group_size, self.on_cuda = qw.group_size, torch.device(device).type == "cuda"
        if self.on_cuda:
            qpacked, scale, zero = triton_int4_layout(qw)
            self.register_buffer("qpacked", qpacked.to(device))                    # [n, k/2] uint8
            self.register_buffer("scale", scale.to(device))                         # [n, k/g] float32
            self.register_buffer("zero", zero.to(device))                           # [n, k/g] float32
        else:
            q, zero = unsigned_int4(qw)                                            # [n, k], [n, k/g]
            scale = qw.scale.float()                                               # [n, k/g]
            # NOTE: the CPU kernel ignores inner_k_tiles (a CUDA tiling parameter); 2 is the smallest it takes.
            packed = torch._convert_weight_to_int4pack_for_cpu(q.cpu().contiguous(), 2)   # [n, k/2] uint8
            self.register_buffer("packed", packed.to(device))
            zero_float = (8 - zero) * scale                          # torch's int4pack: w = (q - 8) * s + z
            sz = torch.stack((scale.t(), zero_float.t()), dim=-1)                  # [k/g, n, 2]
            self.kernel_dtype = int_kernel_dtype(dtype, torch.device(device))
            self.register_buffer("scales_zeros", sz.contiguous().to(device=device, dtype=self.kernel_dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return int4_mm_cuda(x, self.qpacked, self.scale, self.zero, self.group_size)
        return int4_mm_cpu(x.to(self.kernel_dtype), self.packed, self.group_size, self.scales_zeros).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        if not self.on_cuda:
            return None                          # torch's CPU int4pack layout interleaves rows
        return packed_int4_rows(self.qpacked[ids], self.scale[ids], self.zero[ids], self.group_size)


def packed_int4_rows(qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 `[T, k]` from nibble-packed rows `[T, k/2]` (column 2j in the low nibble) and their scale and zero
    `[T, k/g]`."""
    codes = torch.stack((qpacked & 0x0F, qpacked >> 4), dim=-1).flatten(1).float()      # [T, k]
    return (codes - zero.repeat_interleave(group_size, dim=1)) * scale.repeat_interleave(group_size, dim=1)


class Int4Rows(QuantLinear):
    """Row lookup only (no matmul): a row-major int4 copy for a quantized embedding on the CPU."""

    def __init__(self, qw: IntWeight, dtype: torch.dtype, device: torch.device) -> None:
        n, k = qw.shape
        super().__init__(n, k, None, dtype, device)
        self.group_size = qw.group_size
        qpacked, scale, zero = triton_int4_layout(qw)
        self.register_buffer("qpacked", qpacked.to(device))                        # [n, k/2] uint8
        self.register_buffer("scale", scale.to(device))                             # [n, k/g] float32
        self.register_buffer("zero", zero.to(device))                               # [n, k/g] float32

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return packed_int4_rows(self.qpacked[ids], self.scale[ids], self.zero[ids], self.group_size)


class Fp8Linear(QuantLinear):
    def __init__(self, qw: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        n, k = qw.shape
        super().__init__(n, k, bias, dtype, device)
        self.on_cuda = torch.device(device).type == "cuda"
        self.register_buffer("weight", qw.weight.to(device).contiguous())                 # [n, k] e4m3
        self.register_buffer("scale", qw.scale.float().reshape(1, n).to(device))          # [1, n]
        # NOTE: float16 would overflow on the e4m3 products' sums (up to 448**2 * k); float32 takes them.
        table_dtype = torch.float32 if dtype == torch.float16 else dtype
        self.table = None if self.on_cuda else dequant_table("fp8", table_dtype, torch.device(device))  # shared

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return fp8_mm_cuda(x, self.weight, self.scale)
        return fp8_mm_cpu(x, self.weight, self.scale, self.table)

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return self.weight[ids].float() * self.scale[0, ids][:, None]


class Mxfp4Linear(QuantLinear):
    def __init__(self, qw: Mxfp4Weight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        n, k = qw.shape
        super().__init__(n, k, bias, dtype, device)
        self.on_cuda = torch.device(device).type == "cuda"
        self.register_buffer("blocks", qw.blocks.to(device).contiguous())      # [n, k/2] uint8
        self.register_buffer("scales", qw.scales.to(device).contiguous())      # [n, k/32] uint8 e8m0
        self.table = None if self.on_cuda else dequant_table("mxfp4", dtype, torch.device(device))   # shared

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return mxfp4_mm_cuda(x, self.blocks, self.scales)
        return F.linear(x, mxfp4_dequant(self.blocks, self.scales, self.table))    # [m, n]

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return Mxfp4Weight(self.blocks[ids], self.scales[ids]).dequantize()


class DequantLinear(QuantLinear):
    """The fallback: the weight stays quantized in memory (its tensors are buffers) and is dequantized at every
    call by the weight's own reference `dequantize()`."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        n, k = qw.shape
        super().__init__(n, k, bias, dtype, device, qw.perm if isinstance(qw, IntWeight) else None)
        self.kind, self.fields = type(qw), {}
        for f in dataclasses.fields(qw):
            value = getattr(qw, f.name)
            if f.name == "perm":
                continue                                             # applied to x by QuantLinear.forward
            if isinstance(value, torch.Tensor):
                self.register_buffer(f"w_{f.name}", _compact(value).to(device))
            else:
                self.fields[f.name] = value

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight().dequantize().to(x.dtype))

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.perm is not None:
            return None                          # act-order columns: not a row of the matrix as it multiplies
        return self._weight(ids).dequantize()

    def _weight(self, ids: torch.Tensor | None = None) -> QuantizedWeight:
        """The weight from the buffers (rows `ids` only, when given: every tensor of these formats is row-major)."""
        tensors = {name[2:]: buf if ids is None else buf[ids]
                   for name, buf in self.named_buffers(recurse=False) if name.startswith("w_")}
        return self.kind(**tensors, **self.fields)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """int32 codes that fit in a byte are kept as one (readers hand int4/int8 values over as int32)."""
    if t.dtype != torch.int32 or not t.numel():
        return t
    low, high = t.min().item(), t.max().item()
    if -128 <= low and high <= 127:
        return t.to(torch.int8)
    return t.to(torch.uint8) if 0 <= low and high <= 255 else t


def _int_module(qw: IntWeight, device: torch.device) -> tuple[type[QuantLinear], str | None]:
    n, k = qw.shape
    if qw.bits == 8:
        if qw.zero is None and qw.group_size == k:
            return Int8Linear, None
        return DequantLinear, "int8 with groups or zero points: torch's int8 kernel takes one scale per row"
    if qw.bits != 4:
        return DequantLinear, f"{qw.bits}-bit integers have no kernel"
    if device.type == "cuda":
        return Int4Linear, None
    if device.type != "cpu":
        return DequantLinear, f"int4 on {device.type}: no kernel is wired there"
    if qw.group_size not in INT4_CPU_GROUPS:
        return DequantLinear, f"int4 group size {qw.group_size}: the CPU kernel takes {INT4_CPU_GROUPS}"
    if n % INT4_CPU_N_MULTIPLE:
        return DequantLinear, f"int4 out_features {n}: the CPU kernel needs a multiple of {INT4_CPU_N_MULTIPLE}"
    return Int4Linear, None


def _fp8_module(qw: Fp8Weight, device: torch.device) -> tuple[type[QuantLinear], str | None]:
    if device.type != "cuda":
        if qw.shape[1] % 2:
            return DequantLinear, f"fp8 in_features {qw.shape[1]}: the CPU table lookup reads byte pairs"
        return Fp8Linear, None
    if torch.cuda.get_device_capability(device) < (8, 9):
        return DequantLinear, "fp8 matmuls need a GPU of compute capability 8.9 or newer"
    if any(d % FP8_CUDA_MULTIPLE for d in qw.shape):
        return DequantLinear, f"fp8 shape {list(qw.shape)}: torch._scaled_mm needs multiples of 16"
    return Fp8Linear, None


def choose_module(qw: QuantizedWeight, device: torch.device) -> tuple[type[QuantLinear], str | None]:
    """(module class, why it is the dequantizing fallback or None)."""
    if isinstance(qw, IntWeight):
        return _int_module(qw, device)
    if isinstance(qw, Fp8Weight):
        return _fp8_module(qw, device)
    if isinstance(qw, Mxfp4Weight):
        return Mxfp4Linear, None
    raise TypeError(f"quantized_linear: expected IntWeight, Fp8Weight or Mxfp4Weight, got {type(qw).__name__}")


def quantized_linear(qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                     device: torch.device | str) -> QuantLinear:
    """The module that runs `qw` on `device` with activations in `dtype`; `bias` `[n]` or None (its values may be
    filled later through the `bias` parameter). Logs, once per reason, when no kernel takes `qw`."""
    device = torch.device(device)
    cls, reason = choose_module(qw, device)
    if reason is not None and reason not in _LOGGED:
        _LOGGED.add(reason)
        log.warning("quantized linear falls back to dequantize-then-matmul: %s", reason)
    return cls(qw, bias, dtype, device)


class ConcatLinear(nn.Module):
    """Fused parts (q|k|v, gate|up) a checkpoint quantized in ways one matmul cannot join (different act-order
    perms or group sizes): each part runs its own module and the outputs are concatenated, so `forward` and
    `bias` are those of one linear over `cat(parts)`."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)             # [..., n]
        return y if self.bias is None else y + self.bias


def quantized_linear_parts(parts: list[QuantizedWeight], bias: torch.Tensor | None, dtype: torch.dtype,
                           device: torch.device | str) -> nn.Module:
    """One module over the row-concatenation of `parts`: a single quantized linear when `concat_rows` can join
    them, else a ConcatLinear (logged once)."""
    try:
        return quantized_linear(concat_rows(parts), bias, dtype, device)
    except ValueError as e:
        reason = f"fused parts run one by one: {e}"
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            log.warning("quantized linear: %s", reason)
    modules = [quantized_linear(qw, None, dtype, device) for qw in parts]
    return ConcatLinear(modules, bias, dtype, torch.device(device))


def quantized_rows(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device | str,
                   head: QuantLinear | None = None) -> QuantLinear:
    """A module whose `rows` looks up `qw`'s rows: `head` itself when it holds `qw` in a layout that gathers rows
    (tied embeddings share the LM head's buffers), else a module of its own."""
    if head is not None and head.rows(torch.zeros(1, dtype=torch.long, device=torch.device(device))) is not None:
        return head
    device = torch.device(device)
    if isinstance(qw, IntWeight) and qw.bits == 4 and device.type == "cpu":
        return Int4Rows(qw, dtype, device)
    return quantized_linear(qw, None, dtype, device)


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a quantized `[V, H]` matrix: `forward(ids [...]) -> [..., H]` in `dtype`, each row
    dequantized on lookup by `source.rows` (a module from `quantized_rows`)."""

    def __init__(self, source: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.source, self.dtype = source, dtype
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = self.source.rows(ids.reshape(-1))                                  # [T, H] float32
        return flat.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, source={type(self.source).__name__}"
