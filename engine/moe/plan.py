"""Which MoE path `LocalMoE` runs for a batch: a small table from measurements (`benchmarks/moe_bench.py`).

The deciding quantity is the number of (token, expert) pairs per expert, `T*k/E`: the gather path reads one
expert slice per pair, the grouped GEMM reads every active expert once, so gather wins while pairs are few and
its re-reads hit the cache. Where the crossover falls depends on whether a layer's expert weights stay in cache
(the bundled model's 6 MB fp32 layers do, a 200-400 MB layer does not) and on the dtype (bf16 GEMMs run ~3x
faster than fp32 ones on this AVX-512 BF16 CPU, while the gather's reduction gains less).
See `docs/moe.md` for the table of measurements behind these numbers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.cpu_features import native_bf16_gemm

CACHE_RESIDENT_BYTES = 16 << 20     # a layer's expert weights at or under this stay in the 32 MB L3 measured on

# NOTE: measured medians, us per layer, CPU time of 1 thread (AMD EPYC, AVX-512 BF16), from
# `python benchmarks/moe_bench.py --parts paths --seconds 5` (full table in docs/moe.md). Compiled, gather vs the best other
# sync-free path (and the old eager loop):
#   E=8 k=2 H=I=256 fp32:  T=1 158 vs 356 (loop 177) | T=8 472 vs 920 (923) | T=64 1509 vs 1688 grouped (1723)
#   E=8 k=2 H=I=256 bf16:  T=8 354 vs 459 dense (612) | T=16 716 vs 732 dense | T=32 931 vs 774 dense, 928 grouped
#                          | T=64 1783 vs 1090 grouped, 1113 dense (1273)
#   E=64 k=8 H=1024 I=512: fp32 T=16 32.1 vs 38.2 ms | T=32 52.2 vs 45.6 ms grouped;
#                          bf16 T=16 18.5 vs 24.1 ms | T=32 33.1 vs 21.4 ms grouped
# so compiled runs gather up to these pairs per expert (T*k/E), then dense (cached bf16 only), then grouped:
GATHER_MAX_PAIRS_PER_EXPERT = {(True, torch.float32): 16, (True, torch.bfloat16): 4,
                               (False, torch.float32): 2, (False, torch.bfloat16): 2}
# NOTE: E=8 bf16 (cached): one dense GEMM over all experts beats the per-expert GEMMs while pairs per expert
# <= 8, eager and compiled (eager T=4 391 vs loop 580 us, T=16 755 vs 1179, T=32 769 vs 1008; T=64 1221 vs
# grouped 1288, a tie; an eager-only run: T=128 1726 vs loop 1241). fp32 never picks dense (T=8 1197 vs 923).
# One token eager runs the loop's k-expert path (T=1 177 vs grouped 307 us fp32, 137 vs 219 bf16).
DENSE_MAX_PAIRS_PER_EXPERT = 8
# NOTE: eager, grouped and the loop run the same per-expert GEMMs and tie (0.92-1.08x) up to T=256, but at prefill
# sizes in fp32 the loop wins, likely because its per-expert intermediates stay in L2 and the grouped path's
# whole-batch ones ([T*k, 2I]) do not: E=8 fp32 T=1024 (256 pairs per expert) loop 11237 vs grouped 12563 us,
# 13746 vs 14917 in another run; bf16 ties there (3740 vs 3815). So eager fp32 returns to the loop from:
LOOP_EAGER_MIN_PAIRS_PER_EXPERT = 128


# NOTE: on an H200 (benchmarks/gpu_kernels.py, bf16, E=128 k=8 H=2048 I=768, medians): the Triton pair took 370 /
# 378 / 575 us at 1 / 32 / 256 tokens, torch._grouped_mm 222 / 475 / 553. At one token (0.06 pairs per expert)
# nearly every active expert gets one row, and the Triton kernel's 16-row tiles waste 15 of them; from 2 pairs per
# expert it wins. So CUDA takes the grouped GEMM up to (a bound near the one-token point, as only it was measured
# below 2):
CUDA_GROUPED_MAX_PAIRS_PER_EXPERT = 0.125


# NOTE: the bf16 figures above are from a CPU with AVX-512 BF16, where one dense bf16 GEMM over every expert is
# cheap. On an AVX2-only CPU (AMD EPYC Zen 3, the same benchmark and model, 1 thread) torch's bf16 GEMMs run 5-7x
# slower than fp32 ones and the dense path lost everywhere: compiled T=32 13.1 ms a layer against gather's 2.65,
# eager T=2-32 0.27-0.55x of the loop. There bf16 takes the fp32 choices (`native_bf16_gemm`); in the compiled
# step (`decode_step_profile.py --dtype bfloat16 --env-ab STRATA_NATIVE_BF16=1`, 6 interleaved rounds) batch 32
# ran 168 ms a step against 215 with dense, batches 1, 8, 16 and 64 0.98-1.02x.


class MoEShape(NamedTuple):
    experts: int
    hidden: int
    inter: int

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return self.experts * 3 * self.hidden * self.inter * torch.finfo(dtype).bits // 8


# NOTE: Strata's C++ kernel (engine/cpu_kernels, the `cpu` path) against the paths above: AVX2 AMD EPYC (Zen 3),
# 1 thread, `moe_bench.py --parts paths --shapes bundled --seconds 2` (4 layers of E=8 k=2 H=I=256 competing for
# cache, us per layer, kernel eager vs the best other path): fp32 T=1 187 vs gather (compiled) 226 | T=8 696 vs 854
# | T=32 1170 vs 2020 | T=64 1958 vs grouped 2310 | T=128 3213 vs 3628 | T=256 5292 vs 4317 | T=512 8601 vs 7316
# (torch's GEMMs keep their rate from ~64 rows an expert, the kernel's tile does not); bf16 there (no native bf16)
# T=1 166 vs 221 | T=32 1069 vs 3899 | T=128 2890 vs 9689: it reads bf16 and multiplies in fp32, which wins at
# every size there. Not measured on a CPU with native bf16 GEMMs: there it takes the range where gather beat them.
CPU_KERNEL_MAX_PAIRS_PER_EXPERT = {torch.float32: 32, torch.bfloat16: 4}


def choose_path(shape: MoEShape, tokens: int, top_k: int, dtype: torch.dtype, triton_cuda: bool, compiling: bool,
                grouped_ok: bool, cpu_kernel: bool = False) -> str:
    """The path for T=`tokens`; when `compiling`, one with no host sync and static shapes (see `paths.SYNC_FREE`).

    `triton_cuda`: the weights are on CUDA and triton is installed (the fused kernels, eager and compiled, except at
    a few pairs per expert, where the grouped GEMM measured faster). `grouped_ok`: torch._grouped_mm takes these
    dtypes and strides (on CUDA: this GPU). `cpu_kernel`: Strata's CPU kernel takes these tensors.
    """
    pairs_per_expert = tokens * top_k / shape.experts
    if triton_cuda:
        return "grouped" if grouped_ok and pairs_per_expert <= CUDA_GROUPED_MAX_PAIRS_PER_EXPERT else "triton"
    cached = shape.expert_bytes(dtype) <= CACHE_RESIDENT_BYTES
    if cpu_kernel and dtype == torch.bfloat16 and not native_bf16_gemm():
        return "cpu"
    if cpu_kernel and pairs_per_expert <= CPU_KERNEL_MAX_PAIRS_PER_EXPERT.get(dtype, 0):
        return "cpu"
    if dtype == torch.bfloat16 and not native_bf16_gemm():
        dtype = torch.float32        # bf16 GEMMs run as slow conversions here: the fp32 choices hold (see above)
    if compiling and pairs_per_expert <= GATHER_MAX_PAIRS_PER_EXPERT.get((cached, dtype), 2):
        return "gather"
    if not compiling and (tokens == 1 or dtype == torch.float32
                          and pairs_per_expert >= LOOP_EAGER_MIN_PAIRS_PER_EXPERT):
        return "loop"
    if cached and dtype == torch.bfloat16 and pairs_per_expert <= DENSE_MAX_PAIRS_PER_EXPERT:
        return "dense"
    if grouped_ok:
        return "grouped"
    return "gather" if compiling else "loop"
