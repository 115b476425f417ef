"""The matmuls quantized modules run, one function per scheme, each picking the kernel for x's device.

    scheme  CPU                                          CUDA
    int8    torch._weight_int8pack_mm in bf16            int8 -> x's dtype, then cuBLAS (scale after)
    int4    torch._weight_int4pack_mm_for_cpu in bf16    engine.quant.triton_gemm.int4_matmul   (opaque op)
    fp8     table dequant of weight and activations,     torch._scaled_mm, per-token scales (bf16 out)
            F.linear, both scales after
    mxfp4   table dequant + F.linear                     engine.quant.triton_gemm.mxfp4_matmul  (opaque op)

Every function takes x `[m, k]` and returns `[m, n]` in x's dtype. The Triton kernels are imported lazily, only
on a CUDA call, and enter compiled graphs as custom ops with fake implementations (Dynamo never traces them);
eager calls skip the custom op's dispatch (~20 us a call).
NOTE: torch's CUDA `_weight_int8pack_mm` is one thread per output element over float32 (aten int8mm.cu), far
from a GEMM, so CUDA casts the int8 weight and uses cuBLAS (not measured here: no GPU in this build).

NOTE: on CPU torch's int8/int4 weight kernels are vectorized for bfloat16 only: a 3072 x 1024 weight on 1 thread,
batch 1 / 16: int8 2246 / 37727 us in float32 (2552 / 39043 in float16) vs 83 / 668 us in bfloat16; int4-g128
5156 / 81479 us vs 90 / 635. So W8A16 and W4A16 run their CPU matmul in bfloat16 whatever the model dtype (the
"A16" of their names); float32 models see bf16 rounding of these layers' inputs, scales and outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.dequant_tables import fp8_dequant
from engine.quant.schemes.fp8 import to_fp8

FP8_MAX = 448.0
CPU_INT_KERNEL_DTYPE = torch.bfloat16


def int_kernel_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The activation dtype the int8/int4 kernels run in for a model in `dtype` (see the NOTE above)."""
    return CPU_INT_KERNEL_DTYPE if device.type == "cpu" else dtype


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[m, k]`, q `[n, k]` int8, scale `[n]` in x's dtype (the CPU kernel requires it): `x @ (q * scale).T`."""
    if x.is_cuda:
        return F.linear(x, q.to(x.dtype)) * scale                               # [m, n]
    return torch._weight_int8pack_mm(x, q, scale)                               # [m, n]


def int4_mm_cpu(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                scales_zeros: torch.Tensor) -> torch.Tensor:
    """packed: `torch._convert_weight_to_int4pack_for_cpu` of q `[n, k]`; scales_zeros `[k / g, n, 2]` in x's
    dtype holding (scale, (8 - zero) * scale): torch's int4pack computes w = (q - 8) * scale + zero_float."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)   # [m, n]


def _int4_triton(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    from engine.quant.triton_gemm import int4_matmul
    return int4_matmul(x, qpacked, scale, zero, group_size)


def _mxfp4_triton(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from engine.quant.triton_gemm import mxfp4_matmul
    return mxfp4_matmul(x, blocks, scales)


@torch.library.custom_op("strata::int4_matmul_cuda", mutates_args=())
def _int4_op(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
             group_size: int) -> torch.Tensor:
    return _int4_triton(x, qpacked, scale, zero, group_size)


@_int4_op.register_fake
def _(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
      group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], qpacked.shape[0])


@torch.library.custom_op("strata::mxfp4_matmul_cuda", mutates_args=())
def _mxfp4_op(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _mxfp4_triton(x, blocks, scales)


@_mxfp4_op.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def int4_mm_cuda(x: torch.Tensor, qpacked: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """qpacked `[n, k / 2]` uint8 (column 2j in the low nibble), scale and zero `[n, k / g]` float32."""
    if torch.compiler.is_compiling():
        return _int4_op(x, qpacked, scale, zero, group_size)
    return _int4_triton(x, qpacked, scale, zero, group_size)


def mxfp4_mm_cuda(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks `[n, k / 2]` uint8 e2m1 pairs, scales `[n, k / 32]` uint8 e8m0."""
    if torch.compiler.is_compiling():
        return _mxfp4_op(x, blocks, scales)
    return _mxfp4_triton(x, blocks, scales)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[m, k]` -> (e4m3 `[m, k]`, float32 scales `[m, 1]`): each row scaled so its amax maps to 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)           # [m, 1]
    return to_fp8(xf / scale), scale


def fp8_mm_cuda(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A8: x `[m, k]` quantized per token, weight `[n, k]` e4m3, w_scale `[1, n]` float32:
    `(a * sa) @ (w * sb).T` accumulated in float32."""
    a, a_scale = quantize_per_token(x)                                                  # [m, k], [m, 1]
    # NOTE: CUDA's row-wise scaled GEMM writes only bf16 (torch 2.x); other dtypes are cast after.
    out = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)  # [m, n]
    return out if out.dtype == x.dtype else out.to(x.dtype)


def fp8_mm_cpu(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The same W8A8 product without `_scaled_mm`: both e4m3 operands looked up into `table`'s dtype (exact),
    multiplied by F.linear (exact products, float32 sums), then scaled per row and column."""
    a, a_scale = quantize_per_token(x)                                                  # [m, k], [m, 1]
    out = F.linear(fp8_dequant(a, table), fp8_dequant(weight, table))                   # [m, n]
    return (out.float() * (a_scale * w_scale)).to(x.dtype)
