"""What this CPU does fast, where the engine's choices depend on it."""
from __future__ import annotations

import functools
import os

import torch

ENV_NATIVE_BF16 = "STRATA_NATIVE_BF16"   # 1 or 0 overrides the detection (e.g. a VM that hides the CPU's flags)


@torch.compiler.assume_constant_result       # read while tracing: a constant of the graph, not traced
def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), so a bf16 GEMM beats an fp32 one.
    Without it torch's bf16 GEMMs convert as they go: measured on an AVX2-only AMD EPYC (Zen 3), 1 thread,
    `[32, 256] x [256, 4096]` 10.6 ms in bf16 against 1.46 in fp32. `$STRATA_NATIVE_BF16` (1 or 0) overrides."""
    forced = os.environ.get(ENV_NATIVE_BF16, "").strip()
    return forced == "1" if forced in ("0", "1") else _detected()


@functools.lru_cache(maxsize=None)
def _detected() -> bool:
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def slow_half_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `dtype` products on `device` are bf16/fp16 ones on a CPU without native bf16 (the slow case the
    engine works around: weights stored by rows, fp32 products from a few rows, fp32's MoE choices)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not native_bf16_gemm()


ENV_FP32_ROWS = "STRATA_FP32_GEMM_MIN_ROWS"   # rows from which such a product runs in fp32; 0: never
FP32_GEMM_MIN_ROWS = 4


def fp32_gemm_min_rows(dtype: torch.dtype, device: torch.device) -> int:
    """From how many rows (tokens) a linear layer of `dtype` on `device` computes its product in float32 (both
    operands converted for the call, the result rounded back); 0: never. Only bf16/fp16 on a CPU without native
    bf16: there `[32, 256] x [256, 4096]` takes 1.33 ms converted against 9.5 in bf16, but converting a weight each
    call costs its bytes twice over, which small batches (weight-bound) lose. Measured in the compiled step of the
    bundled model on an AVX2 EPYC (`decode_step_profile.py --dtype bfloat16 --env-ab STRATA_FP32_GEMM_MIN_ROWS=0`,
    converting from 1 row against never, 5 interleaved rounds): batch 1 0.87x, 2 0.73x, 4 1.13x, 8 1.15x, 32
    1.46x. `$STRATA_FP32_GEMM_MIN_ROWS` overrides the threshold. Where Strata's CPU kernels built, layers of up to
    `cpu_kernels.LINEAR_MAX_ROWS` rows run the bf16 kernel before this rule applies (`layers.linear`)."""
    if not slow_half_gemm(dtype, device):
        return 0
    value = os.environ.get(ENV_FP32_ROWS, "").strip()
    return int(value) if value.isdigit() else FP32_GEMM_MIN_ROWS
