"""Fused MoE: every expert path's time per layer, eager and compiled, and the path `LocalMoE` picks.

For each shape, dtype and token count T it routes T random tokens (softmax top-k of random logits, seeded), builds
one stack of MoE layers per path (the bundled shape has 4 layers with distinct weights, as the bundled model does,
so the weights compete for cache as they do there), and times a call of each stack in interleaved rounds (the
order rotates every round), 1 torch thread. Compiled means `torch.compile(stack, fullgraph=True, dynamic=False)`
after warm-up (Inductor's C++ backend on CPU), so only the sync-free paths compile. Prints the median microseconds
per layer (CPU time of the timing thread, so that other processes on the machine disturb it less; the JSON also has
wall-clock medians), the path `LocalMoE` picks eager and compiled, and the old per-expert loop's time over the
chosen path's (`2.0x` = the chosen path takes half the loop's time). Every path's output is checked against the loop's.
With `--json` the last line is one JSON object with every figure.

    python benchmarks/moe_bench.py                                    # both shapes, float32 and bfloat16
    python benchmarks/moe_bench.py --shapes bundled --dtypes float32 --tokens 1,8,64 --modes compiled
    python benchmarks/moe_bench.py --quick --json                     # CI smoke run (seconds)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.moe.local import LocalMoE  # noqa: E402
from engine.moe.paths import PATHS, SYNC_FREE  # noqa: E402


class BenchShape(NamedTuple):
    experts: int
    top_k: int
    hidden: int
    inter: int
    layers: int


SHAPES = {"bundled": BenchShape(8, 2, 256, 256, 4),      # models/strata-moe-tiny: 4 sparse layers
          "big": BenchShape(64, 8, 1024, 512, 1)}        # a Qwen3-30B-A3B-like layer at a quarter of its width
EAGER_GATHER_MAX_BYTES = 256 << 20   # eager gather copies every pair's expert weights; skip it past this


class MoEStack(nn.Module):
    """`layers` LocalMoE layers on one residual stream, all on the same routing."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor]], path: str | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LocalMoE(w13, w2, path) for w13, w2 in weights)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, topk_ids, topk_weights)
        return x


def make_weights(shape: BenchShape, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    e, h, i = shape.experts, shape.hidden, shape.inter
    return [((torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype),
             (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)) for _ in range(shape.layers)]


def make_batch(shape: BenchShape, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=gen).to(dtype)
    probs = torch.softmax(torch.randn(tokens, shape.experts, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, shape.top_k, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def candidates(shape: BenchShape, tokens: int, dtype: torch.dtype, paths: list[str], modes: list[str],
               weights: list) -> dict[str, Callable]:
    """'path/eager' and 'path/compiled' -> a callable running the stack (compiled ones not yet warmed up)."""
    out = {}
    slice_bytes = 3 * shape.hidden * shape.inter * torch.finfo(dtype).bits // 8
    for path in paths:
        if "eager" in modes and not (path == "gather" and tokens * shape.top_k * slice_bytes > EAGER_GATHER_MAX_BYTES):
            out[f"{path}/eager"] = MoEStack(weights, path)
        if "compiled" in modes and path in SYNC_FREE:
            out[f"{path}/compiled"] = torch.compile(MoEStack(weights, path), fullgraph=True, dynamic=False)
    return out


def check_and_warm(fns: dict[str, Callable], batch: tuple, reference: torch.Tensor) -> dict[str, float]:
    """Runs each candidate twice (compiling where needed); returns each one's max abs diff / the output's scale."""
    scale = reference.float().abs().max().item()
    errors = {}
    for name, fn in fns.items():
        fn(*batch)
        errors[name] = (fn(*batch).float() - reference.float()).abs().max().item() / scale
    return errors


def interleaved_medians(fns: dict[str, Callable], batch: tuple, seconds: float,
                        min_rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """(median wall seconds, median CPU seconds of this thread) per candidate.

    NOTE: CPU time leaves out the time this thread waited for a core, so it stays comparable when other
    processes load the machine (1 torch thread: every kernel runs on this thread)."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    names, deadline, rounds = list(fns), time.perf_counter() + seconds, 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        for name in names[rounds % len(names):] + names[:rounds % len(names)]:
            start, start_cpu = time.perf_counter(), time.thread_time()
            fns[name](*batch)
            cpu[name].append(time.thread_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
        rounds += 1
    return ({name: statistics.median(t) for name, t in wall.items()},
            {name: statistics.median(t) for name, t in cpu.items()})


def chosen_paths(weights: list, batch: tuple) -> tuple[str, str]:
    layer, (x, ids, _) = LocalMoE(*weights[0]), batch
    return layer.choose(x, ids.shape[1], compiling=False), layer.choose(x, ids.shape[1], compiling=True)


def run_cell(name: str, shape: BenchShape, dtype: torch.dtype, tokens: int, args: argparse.Namespace) -> dict:
    torch._dynamo.reset()
    weights, batch = make_weights(shape, dtype), make_batch(shape, tokens, dtype)
    eager_choice, compiled_choice = chosen_paths(weights, batch)
    paths = [eager_choice, compiled_choice] if args.quick else args.paths
    fns = candidates(shape, tokens, dtype, sorted(set(paths) | {"loop"}), args.modes, weights)
    start = time.perf_counter()
    errors = check_and_warm(fns, batch, MoEStack(weights, "loop")(*batch))
    warm_s = time.perf_counter() - start
    wall, cpu = interleaved_medians(fns, batch, args.seconds, args.min_rounds)
    wall_us = {key: 1e6 * t / shape.layers for key, t in wall.items()}              # per layer
    us = {key: 1e6 * t / shape.layers for key, t in cpu.items()}                    # per layer
    loop_us = us["loop/eager"]
    cell = {"shape": name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "us_per_layer": us,
            "wall_us_per_layer": wall_us,
            "max_rel_error": errors, "chosen_eager": eager_choice, "chosen_compiled": compiled_choice,
            "warmup_and_compile_s": warm_s}
    for mode, choice in (("eager", eager_choice), ("compiled", compiled_choice)):
        key = f"{choice}/{mode}" if choice in SYNC_FREE else f"{choice}/eager"    # the loop never compiles
        cell[f"loop_over_chosen_{mode}"] = loop_us / us[key] if key in us else None
    return cell


def print_cell(cell: dict, tolerance: float) -> None:
    times = "  ".join(f"{key} {value:8.0f}" for key, value in sorted(cell["us_per_layer"].items(),
                                                                     key=lambda kv: kv[1]))
    bad = [key for key, err in cell["max_rel_error"].items() if err > tolerance]
    ratio = {mode: cell[f"loop_over_chosen_{mode}"] for mode in ("eager", "compiled")}
    ratios = "  ".join(f"{mode}={cell[f'chosen_{mode}']} ({r:.2f}x)" for mode, r in ratio.items() if r)
    print(f"{cell['shape']:>7} {cell['dtype']:>8} T={cell['tokens']:>3} | us/layer: {times} | chosen (loop/chosen): "
          f"{ratios}{' | MISMATCH ' + ','.join(bad) if bad else ''}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="bundled,big", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {list(PATHS)}")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--seconds", type=float, default=3.0, help="timing budget per (shape, dtype, T) cell")
    parser.add_argument("--min-rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: bundled fp32, T=1,8, chosen paths only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.dtypes, args.tokens, args.seconds, args.min_rounds = "bundled", "float32", "1,8", 0.2, 3
    args.shapes, args.dtypes = args.shapes.split(","), [getattr(torch, d) for d in args.dtypes.split(",")]
    args.tokens, args.paths, args.modes = [int(t) for t in args.tokens.split(",")], args.paths.split(","), \
        args.modes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES] + [p for p in args.paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown shape or path {unknown}; shapes {sorted(SHAPES)}, paths {list(PATHS)}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    cells = []
    for name in args.shapes:
        for dtype in args.dtypes:
            for tokens in args.tokens:
                cells.append(run_cell(name, SHAPES[name], dtype, tokens, args))
                print_cell(cells[-1], 1e-4 if dtype == torch.float32 else 5e-2)
    if args.json:
        print(json.dumps({"benchmark": "moe_bench", "torch_threads": torch.get_num_threads(), "cells": cells}))


if __name__ == "__main__":
    main()
