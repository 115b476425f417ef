"""Strata's Triton kernels against the torch code the engine runs without them, on a CUDA device.

Three families, each at shapes of real models, each timed against its baseline in the same run:
- weight-only GEMM: `x @ W.T` with W in bf16 (`torch.mm`, cuBLAS) against the int4 (group 128, zero points) and
  MXFP4 Triton kernels (`engine/quant/triton_gemm.py`; 1 row runs its split-K GEMV, more rows the tiled GEMM), at
  1, 16 and 128 rows, for an 8B-class attention projection (4096x4096) and MLP projection (14336x4096). Beside
  each: the weight bytes per second it reached, as a share of the device's copy bandwidth (bytes read + written
  per second by one large copy) measured in the same run, the physical bound of a weight-streaming matmul (above
  1: the weights stayed in L2 between calls);
- fused MoE: the Triton kernel pair (`engine/moe/triton_moe.py`) against the torch paths the engine can pick
  (`grouped`: `torch._grouped_mm` over sorted tokens where torch has it; `loop`: one matmul pair per expert) for a
  Qwen3-30B-A3B-shaped layer (128 experts, top 8, hidden 2048, expert width 768) at 1, 32 and 256 tokens;
- paged decode attention over an fp8 KV cache: the Triton kernel (`engine/attention/triton_kv_quant.py`) against
  torch without it (gather every sequence's blocks, dequantize them, one batched `scaled_dot_product_attention`)
  at 32 sequences of 2,048 tokens (32 query heads, 8 KV heads, head dim 128, blocks of 16).

Every case checks the kernel's output against its baseline first (max error relative to the largest value), then
times both in interleaved rounds (`--rounds`, CUDA events around `--reps` calls after a warm-up) and reports
medians and the ratio baseline / kernel. The figures and ratios are of the calls captured in a CUDA graph (the
kernels alone, as the compiled engine's CUDA graphs run them); each line ends with the same sides called from
Python, launch costs included (on an H200 those were 35-40 us for a bf16 matmul and ~150 us for a Triton GEMM
whatever its size: a launch-bound figure, not the kernel's). The MoE `loop` reads expert counts on the host and is
timed eagerly only.

    python benchmarks/gpu_kernels.py                   # on a CUDA host
    python benchmarks/gpu_kernels.py --quick --json    # anywhere: toy shapes (Triton interpreter on a CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

QUICK_ON_CPU = "--quick" in sys.argv and not torch.cuda.is_available()
if QUICK_ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: the kernels run interpreted

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention.triton_kv_quant import (  # noqa: E402
    paged_decode_attention_quant, paged_decode_attention_quant_ref, quantize_ref)
from engine.moe import paths as moe_paths  # noqa: E402
from engine.moe.router import route_topk  # noqa: E402
from engine.moe.triton_moe import fused_moe_triton  # noqa: E402
from engine.quant.triton_gemm import (  # noqa: E402
    int4_dequantize, int4_matmul, mxfp4_matmul, mxfp4_matmul_ref, pack_int4)
from engine_throughput import copy_bandwidth, synchronize  # noqa: E402

Fn = Callable[[], torch.Tensor]


def time_calls(fn: Fn, reps: int, device: torch.device) -> float:
    """Seconds per call, over `reps` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def graphed(fn: Fn, reps: int) -> Fn:
    """`reps` calls of `fn` captured in one CUDA graph: its replay (the kernels alone, no launch costs: how the
    compiled engine's CUDA graphs run them). `fn` must not sync with the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):      # a call outside the capture first, as torch.cuda.graph asks
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph.replay


def race(sides: dict[str, Fn], rounds: int, reps: int, device: torch.device,
         eager_only: tuple[str, ...] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """(median seconds per call of each side in a CUDA graph, `eager`: the same called from Python, launches
    included), sides interleaved in alternating order every round. Off CUDA, and for the sides in `eager_only`
    (they sync with the host), the first is the second."""
    for fn in sides.values():   # warm-up: compiles the kernels, fills the caches, autotunes
        fn()
    synchronize(device)
    # name -> (what to time, how many times a sample calls it, calls of the side in one of those)
    timed = {name: (fn, reps, 1) for name, fn in sides.items()}
    if device.type == "cuda":
        timed.update({f"{name} graph": (graphed(fn, reps), 1, reps) for name, fn in sides.items()
                      if name not in eager_only})
    samples: dict[str, list[float]] = {name: [] for name in timed}
    names = list(timed)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn, calls, per_call = timed[name]
            samples[name].append(time_calls(fn, calls, device) / per_call)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    eager = {name: medians[name] for name in sides}
    return {name: medians.get(f"{name} graph", eager[name]) for name in sides}, eager


def eager_note(row: dict) -> str:
    """The same sides called from Python (launch costs included), for the line's end ("" when nothing was graphed)."""
    if row["eager_us"] == row["us"]:
        return ""
    return " | called from Python: " + ", ".join(f"{side} {us:.1f} us" for side, us in row["eager_us"].items())


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)


# ------------------------------------------------------------------------------------------------ the cases

def gemm_cases(shapes: list[tuple[int, int]], rows: list[int], dtype: torch.dtype, device: torch.device,
               args: argparse.Namespace, bandwidth: float) -> list[dict]:
    out = []
    for n, k in shapes:
        group = 128 if k % 128 == 0 else 32
        codes = torch.randint(0, 16, (n, k), device=device)
        qpacked = pack_int4(codes)
        scale = torch.rand(n, k // group, device=device) * 0.02 + 0.005
        zero = torch.randint(0, 16, (n, k // group), device=device).float()
        blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        scales = torch.randint(122, 131, (n, k // 32), dtype=torch.uint8, device=device)
        w_int4 = int4_dequantize(qpacked, scale, zero, group).to(dtype)           # the same weights, dense
        w_dense = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            errors = {"int4": rel_error(int4_matmul(x, qpacked, scale, zero, group), x @ w_int4.T),
                      "mxfp4": rel_error(mxfp4_matmul(x, blocks, scales), mxfp4_matmul_ref(x, blocks, scales))}
            times, eager = race({"bf16": lambda: x @ w_dense.T,
                                 "int4": lambda: int4_matmul(x, qpacked, scale, zero, group),
                                 "mxfp4": lambda: mxfp4_matmul(x, blocks, scales)}, args.rounds, args.reps, device)
            weight_bytes = {"bf16": n * k * w_dense.element_size(),
                            "int4": qpacked.numel() + (scale.numel() + zero.numel()) * 4,
                            "mxfp4": blocks.numel() + scales.numel()}
            row = {"case": "gemm", "n": n, "k": k, "rows": m, "us": {s: t * 1e6 for s, t in times.items()},
                   "eager_us": {s: t * 1e6 for s, t in eager.items()},
                   "speedup_vs_bf16": {s: times["bf16"] / times[s] for s in ("int4", "mxfp4")},
                   "share_of_bandwidth": {s: weight_bytes[s] / times[s] / bandwidth for s in times},
                   "rel_error": errors}
            out.append(row)
            print(f"gemm {n}x{k} rows {m:>3}: bf16 {row['us']['bf16']:8.1f} us | int4 {row['us']['int4']:8.1f} us "
                  f"({row['speedup_vs_bf16']['int4']:.2f}x) | mxfp4 {row['us']['mxfp4']:8.1f} us "
                  f"({row['speedup_vs_bf16']['mxfp4']:.2f}x) | weight reads at "
                  + ", ".join(f"{s} {v:.0%}" for s, v in row["share_of_bandwidth"].items())
                  + f" of the copy bandwidth | max rel err int4 {errors['int4']:.1e} mxfp4 {errors['mxfp4']:.1e}"
                  + eager_note(row), flush=True)
    return out


def moe_cases(experts: int, top_k: int, hidden: int, inter: int, token_counts: list[int], dtype: torch.dtype,
              device: torch.device, args: argparse.Namespace) -> list[dict]:
    out = []
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * 0.02
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        weights, ids = route_topk(torch.randn(tokens, experts, device=device), top_k, True, torch.float32)
        weights = weights.to(dtype)
        baselines = {"loop": lambda: moe_paths.loop(x, w13, w2, ids, weights)}
        if moe_paths.grouped_mm_supported(x, w13, w2):
            baselines["grouped"] = lambda: moe_paths.grouped(x, w13, w2, ids, weights)
        ref = moe_paths.loop(x.float(), w13.float(), w2.float(), ids, weights.float())
        error = rel_error(fused_moe_triton(x, w13, w2, ids, weights), ref)
        times, eager = race({"triton": lambda: fused_moe_triton(x, w13, w2, ids, weights), **baselines},
                            args.rounds, args.reps, device, eager_only=("loop",))   # the loop reads counts
        row = {"case": "moe", "experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter,
               "tokens": tokens, "us": {s: t * 1e6 for s, t in times.items()},
               "eager_us": {s: t * 1e6 for s, t in eager.items()},
               "speedup": {s: times[s] / times["triton"] for s in baselines}, "rel_error": error}
        out.append(row)
        print(f"moe E{experts} top{top_k} {hidden}/{inter} tokens {tokens:>4}: triton {row['us']['triton']:8.1f} us | "
              + " | ".join(f"{s} {row['us'][s]:8.1f} us (triton {row['speedup'][s]:.2f}x)" for s in baselines)
              + f" | max rel err {error:.1e}" + eager_note(row), flush=True)
    return out


def torch_paged_attention(q: torch.Tensor, k_q: torch.Tensor, v_q: torch.Tensor, k_scale: torch.Tensor,
                          v_scale: torch.Tensor, tables: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """The same attention in batched torch ops, for sequences that fill their block tables: `[B, Hq, D]`."""
    ids = tables.long()                                                                   # [B, W]

    def gather(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:               # -> [B, Hkv, W * BS, D]
        values = codes[ids].float() * scales[ids][:, :, None, :, None]                   # [B, W, BS, Hkv, D]
        return values.flatten(1, 2).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :].float(), gather(k_q, k_scale), gather(v_q, v_scale), scale=sm_scale, enable_gqa=True)
    return out[:, :, 0, :].to(q.dtype)


def attention_cases(batch: int, context: int, q_heads: int, kv_heads: int, dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device, args: argparse.Namespace) -> list[dict]:
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, block_size, kv_heads, dim, device=device)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, device=device)
    fp8 = torch.float8_e4m3fn
    k_scale = k.abs().amax(dim=(1, 3)) / 448.0                                            # [NB, Hkv]
    v_scale = v.abs().amax(dim=(1, 3)) / 448.0
    k_q = quantize_ref(k / k_scale[:, None, :, None], fp8)
    v_q = quantize_ref(v / v_scale[:, None, :, None], fp8)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, q_heads, dim, device=device, dtype=dtype)
    scale = dim ** -0.5
    args_ = (q, k_q, v_q, k_scale, v_scale, tables, lens, scale)
    ref = paged_decode_attention_quant_ref(*args_)
    error = max(rel_error(paged_decode_attention_quant(*args_), ref),
                rel_error(torch_paged_attention(q, k_q, v_q, k_scale, v_scale, tables, scale), ref))
    times, eager = race({"triton": lambda: paged_decode_attention_quant(*args_),
                         "torch": lambda: torch_paged_attention(q, k_q, v_q, k_scale, v_scale, tables, scale)},
                        args.rounds, args.reps, device)
    row = {"case": "attention_fp8", "batch": batch, "context": context, "q_heads": q_heads, "kv_heads": kv_heads,
           "dim": dim, "us": {s: t * 1e6 for s, t in times.items()},
           "eager_us": {s: t * 1e6 for s, t in eager.items()}, "speedup": times["torch"] / times["triton"],
           "rel_error": error}
    print(f"fp8 paged decode attention B{batch} ctx {context} {q_heads}/{kv_heads}x{dim}: triton "
          f"{row['us']['triton']:8.1f} us | torch {row['us']['torch']:8.1f} us (triton {row['speedup']:.2f}x) | "
          f"max rel err {error:.1e}" + eager_note(row), flush=True)
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--reps", type=int, default=20, help="calls timed back to back per sample")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="toy shapes, one round (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object of every figure")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        parser.error("needs a CUDA device (use --quick to check the benchmark runs on a CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.quick:
        args.rounds, args.reps = 1, 1
        gemm = dict(shapes=[(64, 128)], rows=[1, 16])
        moe = dict(experts=4, top_k=2, hidden=64, inter=32, token_counts=[1, 8])
        attention = dict(batch=2, context=48, q_heads=4, kv_heads=2, dim=32, block_size=16)
    else:
        gemm = dict(shapes=[(4096, 4096), (14336, 4096)], rows=[1, 16, 128])
        moe = dict(experts=128, top_k=8, hidden=2048, inter=768, token_counts=[1, 32, 256])
        attention = dict(batch=32, context=2048, q_heads=32, kv_heads=8, dim=128, block_size=16)
    bandwidth = copy_bandwidth(device, 256 << 20 if cuda else 16 << 20)
    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    print(f"device {name}, {args.dtype}, copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
    rows = (gemm_cases(**gemm, dtype=dtype, device=device, args=args, bandwidth=bandwidth)
            + moe_cases(**moe, dtype=dtype, device=device, args=args)
            + attention_cases(**attention, dtype=dtype, device=device, args=args))
    if args.json:
        print(json.dumps({"benchmark": "gpu_kernels", "device": name, "dtype": args.dtype, "rounds": args.rounds,
                          "reps": args.reps, "copy_bandwidth_bytes_s": bandwidth, "results": rows}))


if __name__ == "__main__":
    main()
