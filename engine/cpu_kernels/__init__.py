"""Strata's CPU kernels (`kernels.cpp`): the decode step's sparse MoE, paged decode attention and small linear
layers, as torch ops.

    strata_cpu::moe(x, w13, w2, topk_ids, topk_weights)            the `cpu` MoE path (engine/moe/paths.py)
    strata_cpu::linear(x, w, bias)                                  bf16 linear layers of a few rows on a CPU
                                                                    without native bf16 (engine/models/layers.py)
    strata_cpu::int8_linear(x, q, scale, bias)                      int8 weight-only layers of a few rows
                                                                    (engine/quant/linear.py: Int8Linear)
    strata_cpu::decode_attention(q, cache, layer, tables, lengths, scale, window)
                                                                    the compiled decode step's attention

Built on first use with the C++ compiler torch.compile already needs (`-O3 -march=native`, so the code is this
CPU's own: AVX2 or AVX-512), cached on disk under `$STRATA_COMPILE_CACHE/../cpu_kernels` or
`~/.cache/strata/cpu_kernels` (one folder per source, torch version and CPU), so a restart loads it in
milliseconds. Where it cannot be built (no compiler, no ninja) the engine logs why once and runs the torch code
it ran before; `STRATA_CPU_KERNELS=0` turns the kernels off. Every op is registered with a fake implementation,
so a compiled graph calls them as opaque kernels.

Why hand-written: at decode sizes the step's time is in small products that torch's GEMMs run far below the CPU's
rate (MKL packs the weight on every call), and in an attention Inductor computes over the padded block table.
Measured on an AVX2 AMD EPYC (1 thread, the bundled model): the MoE kernel against the other paths in
engine/moe/plan.py (`benchmarks/moe_bench.py --parts paths`), attention in compiled_decode.py, the whole step in
docs/moe.md ("Strata's CPU kernels").
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "STRATA_CPU_KERNELS"      # 0: never build or use the kernels
SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ("-O3", "-march=native", "-std=c++17")

_lock = threading.Lock()
_state: dict[str, object] = {}         # "ok": bool once tried, "error": why not


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip() != "0"


@torch.compiler.assume_constant_result      # read while tracing: a constant of the graph
def available() -> bool:
    """Whether the ops are loaded (building them on the first call); False when turned off or the build failed."""
    if not enabled():
        return False
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def error() -> str | None:
    """Why the kernels are not available (None when they are, or were not tried)."""
    return _state.get("error")  # type: ignore[return-value]


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return flags


def build_dir() -> Path:
    """This source's, torch's and this CPU's own build folder (a changed one is rebuilt, never reused)."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(FLAGS).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    base = os.environ.get("STRATA_COMPILE_CACHE")
    root = Path(base).parent / "cpu_kernels" if base else Path.home() / ".cache" / "strata" / "cpu_kernels"
    return root / key


def _load() -> bool:
    if hasattr(torch.ops.strata_cpu, "moe"):
        return True                    # loaded by another copy of this module (tests reload it)
    from torch.utils import cpp_extension
    folder = build_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fresh = not any(folder.glob("*.so"))
        start = time.perf_counter()
        if fresh:
            logger.warning("building Strata's CPU kernels into %s (once per machine, ~15-30 s)", folder)
        cpp_extension.load(name="strata_cpu", sources=[str(SOURCE)], extra_cflags=list(FLAGS),
                           build_directory=str(folder), is_python_module=False, verbose=False)
        if fresh:
            logger.warning("Strata's CPU kernels built in %.1f s", time.perf_counter() - start)
    except Exception as exc:           # no compiler, no ninja, a failed build: the torch paths still work
        _state["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning("Strata's CPU kernels are not available (%s); running the torch code instead",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    @torch.library.register_fake("strata_cpu::moe")
    def _moe(x, w13, w2, topk_ids, topk_weights):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("strata_cpu::linear")
    def _linear(x, w, bias):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("strata_cpu::int8_linear")
    def _int8_linear(x, q, scale, bias):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("strata_cpu::decode_attention")
    def _attention(q, cache, layer, tables, lengths, scale, window):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor) -> torch.Tensor:
    """`[T, H]`: each token's weighted sum over its k experts of `w2[e] (silu(gate) * up)` (fp32 accumulation)."""
    return torch.ops.strata_cpu.moe(x, w13, w2, topk_ids, topk_weights)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x `[M, K]` and w `[N, K]` stored by rows, accumulated in fp32, rounded once."""
    return torch.ops.strata_cpu.linear(x, w, bias)


# NOTE: bf16 products on a CPU without native bf16 (cpu_features.slow_half_gemm), the kernel (which reads bf16 and
# multiplies in fp32) against what the engine ran before (torch's bf16 GEMM below 4 rows, fp32 products converted
# per call from 4), AVX2 AMD EPYC, 1 thread, weights by rows, us: [M, 256] x [256, 768] M=1 30.5 vs 51.4, M=4
# 74.2 vs 118.9, M=8 96.5 vs 143.6, M=16 203 vs 170, M=32 374 vs 270; N=4096 M=1 152 vs 356, M=8 553 vs 654,
# M=16 1035 vs 984. So up to 8 rows. fp32 stays on torch's GEMM (MKL: 1.1-1.5x the kernel's rate from 8 rows).
LINEAR_MAX_ROWS = 8


def linear_max_rows(dtype: torch.dtype, device: torch.device) -> int:
    """Rows up to which a linear layer of `dtype` on `device` (weights stored by rows) runs `linear`; 0: never."""
    from engine.cpu_features import slow_half_gemm
    return LINEAR_MAX_ROWS if dtype == torch.bfloat16 and slow_half_gemm(dtype, device) and available() else 0


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ (q * scale).T (+ bias)` for x `[M, K]`, q `[N, K]` int8 stored by rows, scale `[N]`; fp32 accumulation,
    x's dtype out (x is not rounded to bf16 first, as torch's int8 kernel needs)."""
    return torch.ops.strata_cpu.int8_linear(x, q, scale, bias)


# NOTE: against torch._weight_int8pack_mm in bf16 (what Int8Linear ran), AVX2 AMD EPYC, 1 thread, us, [M, K] x
# [K, N]: K=1024 N=3072 M=1 287 vs 413, M=4 753 vs 893, M=8 1256 vs 1786, M=16 2449 vs 2508; K=4096 N=1024 M=1 355
# vs 540, M=16 2121 vs 3116 (its int8 reads run at 10-12 GB/s at one row). Used at every size, so that a layer's
# numbers never depend on how many rows share its batch. Not on a CPU with native bf16, where torch's kernel
# computes in bf16 natively (not measured there).
def int8_kernel(device: torch.device) -> bool:
    """Whether int8 weight-only layers on `device` run `int8_linear` (a CPU without native bf16 GEMMs)."""
    from engine.cpu_features import native_bf16_gemm
    return device.type == "cpu" and not native_bf16_gemm() and available()


ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)     # the head sizes decode_attention is built for


def decode_attention(q: torch.Tensor, cache6: torch.Tensor, layer: int, tables: torch.Tensor,
                     lengths: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q `[B, Hq, D]` over the block-major cache `[nb, L, 2, bs, Hkv, D]`: keys 0 .. lengths[b]-1 of sequence b
    (the last `window` of them), found through `tables [B, W]`; `[B, Hq, D]` in q's dtype."""
    return torch.ops.strata_cpu.decode_attention(q, cache6, layer, tables, lengths, scale, window or 0)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: on the CPU, one dtype, float32 or bfloat16, and loaded."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors) and available())
