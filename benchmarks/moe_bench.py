"""MoE benchmarks, in parts (`--parts`, default all):

  paths     fused MoE: every expert path's time per layer, eager and compiled, and the path `LocalMoE` picks
  ep-layer  expert parallel (issue 14): tokens/s of one MoE layer, EP 1 (one process, every expert) vs EP 2 (two
            processes), `--streams` tokens per step in all, 1 torch thread per process (moe_ep_layer.py)
  ep-model  the same for a whole model's decode: the bundled model and a random many-expert one (moe_ep_model.py)
  balance   load imbalance of EP 2 under Zipf routing: contiguous, then rebalanced with and without replicas
  capacity  pairs dropped at capacity factors, policies drop and next, uniform and Zipf (moe_ep_capacity.py)
  bytes     EP 2 all-to-all bytes per token, sent vs useful (from the ep-layer runs)
The EP shapes are `bundled` (the bundled model's layer) and `big` (64 experts, top-8, hidden 1024, width 512: a
Qwen3-30B-A3B layer scaled down), in `--ep-dtype` (bfloat16, as the checkpoints ship). The EP parts run in one
spawned group of 2 ranks; every process is stopped before the run ends.

Part paths: for each shape, dtype and token count T it routes T random tokens (softmax top-k of random logits,
seeded), builds one stack of MoE layers per path (the bundled shape has 4 layers with distinct weights, as the
bundled model does, so the weights compete for cache as they do there), and times a call of each stack in
interleaved rounds (the order rotates every round), 1 torch thread. Compiled means `torch.compile(stack,
fullgraph=True, dynamic=False)` after warm-up (Inductor's C++ backend on CPU), so only the sync-free paths compile.
Prints the median microseconds per layer (CPU time of the timing thread, so that other processes on the machine
disturb it less; the JSON also has wall-clock medians), the path `LocalMoE` picks eager and compiled, and the old
per-expert loop's time over the chosen path's (`2.0x` = the chosen path takes half the loop's time). Every path's
output is checked against the loop's.
The EP parts time wall clock (EP 2 waits for its peer, which CPU time would hide) and print how many cores other
processes kept busy meanwhile (cpu_contention.py): EP 2 needs both cores of a 2-core machine, so other work costs
it more than EP 1. A compact table of the ratios beside issue 14's targets ends the run (moe_ep_report.py).
With `--json` the last line is one JSON object with every figure.

    OMP_NUM_THREADS=1 python benchmarks/moe_bench.py                  # every part
    python benchmarks/moe_bench.py --parts paths --shapes bundled --dtypes float32 --tokens 1,8,64 --modes compiled
    python benchmarks/moe_bench.py --parts ep-layer,bytes --ep-shapes big --ep-rounds 9
    python benchmarks/moe_bench.py --quick --json                     # CI smoke run (tiny sizes, every part)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import MoEConfig  # noqa: E402
from engine.moe.ep_group import EPGroup  # noqa: E402
from engine.moe.local import LocalMoE  # noqa: E402
from engine.moe.paths import PATHS, SYNC_FREE  # noqa: E402
from cpu_contention import cpu_contention  # noqa: E402
from moe_ep_capacity import CapacitySpec, capacity_drops, print_capacity  # noqa: E402
from moe_ep_layer import LayerSpec, layer_ranks, print_balance, print_bytes, print_layer  # noqa: E402
from moe_ep_model import ModelSpec, many_expert_checkpoint, model_ranks, print_model  # noqa: E402
from moe_ep_report import plot, print_summary  # noqa: E402
from moe_ep_spawn import run_ranks  # noqa: E402
from moe_workloads import HOT_ORDERS, SHAPES, TINY, BenchShape  # noqa: E402

PARTS = ("paths", "ep-layer", "ep-model", "balance", "capacity", "bytes")
BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "models" / "strata-moe-tiny"


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
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, few rounds, every part")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    parser.add_argument("--ep-shapes", default="bundled,big", help="ep-layer and bytes shapes")
    parser.add_argument("--ep-dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams (tokens per step, all ranks)")
    parser.add_argument("--ep-rounds", type=int, default=9, help="ep-layer: interleaved rounds")
    parser.add_argument("--ep-steps", type=int, default=10, help="ep-layer: forwards per timed block")
    parser.add_argument("--model-rounds", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=16, help="ep-model: new tokens per request and round")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the skewed workload")
    parser.add_argument("--redundant", type=int, default=4, help="balance: num_redundant_experts (slots per rank)")
    parser.add_argument("--balance-forwards", type=int, default=32)
    parser.add_argument("--capacity-tokens", default="16,512", help="capacity: tokens per rank and step")
    parser.add_argument("--capacity-total-tokens", type=int, default=4096, help="capacity: tokens per row")
    parser.add_argument("--hot-order", default="ids", choices=HOT_ORDERS,
                        help="balance: which experts are hot (ids: 0, 1, ...; random: a fixed permutation)")
    parser.add_argument("--plot", default="", help="save bar charts of the EP parts to this file (matplotlib)")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.dtypes, args.tokens, args.seconds, args.min_rounds = "bundled", "float32", "1,8", 0.2, 3
        args.ep_rounds, args.ep_steps, args.model_rounds, args.decode_steps, args.prompt_len = 2, 2, 1, 3, 8
        args.balance_forwards, args.capacity_tokens, args.capacity_total_tokens, args.streams = 4, "16", 160, 8
    args.parts, args.ep_shapes = args.parts.split(","), args.ep_shapes.split(",")
    args.capacity_tokens = tuple(int(t) for t in args.capacity_tokens.split(","))
    args.shapes, args.dtypes = args.shapes.split(","), [getattr(torch, d) for d in args.dtypes.split(",")]
    args.tokens, args.paths, args.modes = [int(t) for t in args.tokens.split(",")], args.paths.split(","), \
        args.modes.split(",")
    unknown = [s for s in args.shapes + args.ep_shapes if s not in SHAPES] + [p for p in args.paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown shape or path {unknown}; shapes {sorted(SHAPES)}, paths {list(PATHS)}")
    if [p for p in args.parts if p not in PARTS]:
        parser.error(f"unknown part in --parts {args.parts}; parts are {list(PARTS)}")
    if not 1 <= args.balance_forwards <= MoEConfig().eplb_window:
        parser.error(f"--balance-forwards must be in [1, {MoEConfig().eplb_window}] (the layers' load window)")
    if args.streams < 2 or args.streams % 2:
        parser.error(f"--streams must be even and >= 2 (split over 2 ranks), got {args.streams}")
    return args


def run_paths(args: argparse.Namespace) -> list[dict]:
    torch._dynamo.config.recompile_limit = 64
    cells = []
    for name in args.shapes:
        for dtype in args.dtypes:
            for tokens in args.tokens:
                cells.append(run_cell(name, SHAPES[name], dtype, tokens, args))
                print_cell(cells[-1], 1e-4 if dtype == torch.float32 else 5e-2)
    return cells


def _ep_shape(name: str, quick: bool) -> tuple[str, BenchShape]:
    """--quick runs a tiny stand-in for the many-expert shape (named so: no target applies to it)."""
    return ("tiny", TINY) if quick and name == "big" else (name, SHAPES[name])


def _ep_ranks(group: EPGroup, layer: LayerSpec | None, model: ModelSpec | None) -> dict:
    """Every rank of the group: the layer parts, then the model part (a spawn target: module level)."""
    out = layer_ranks(group, layer) if layer is not None else {}
    return {**out, "model": model_ranks(group, model)} if model is not None else out


def run_expert_parallel(args: argparse.Namespace) -> dict:
    parts = set(args.parts)
    big = _ep_shape("big", args.quick)[1]
    shapes = tuple(_ep_shape(n, args.quick) for n in args.ep_shapes) if parts & {"ep-layer", "bytes"} else ()
    layer = LayerSpec(shapes, args.ep_dtype, args.streams, args.ep_rounds, args.ep_steps,
                      big if "balance" in parts else None, args.skew, args.hot_order, args.redundant,
                      args.balance_forwards)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="moe_bench_") as tmp:
        model = None
        if "ep-model" in parts:
            random_model = many_expert_checkpoint(Path(tmp) / "many-expert", args.quick)
            model = ModelSpec((("strata-moe-tiny", str(BUNDLED_MODEL)), ("many-expert", str(random_model))),
                              args.ep_dtype, args.streams, args.prompt_len, args.decode_steps, args.model_rounds)
        if shapes or layer.balance_shape is not None or model is not None:
            with cpu_contention() as load:
                out = run_ranks(2, _ep_ranks, layer if shapes or layer.balance_shape else None, model)[0]
            out["contention"] = load
    for part, key, show in (("ep-layer", "layer", print_layer), ("bytes", "layer", print_bytes),
                            ("ep-model", "model", print_model), ("balance", "balance", print_balance)):
        if part in parts:
            show(out[key])
    if "capacity" in parts:
        spec = CapacitySpec(big, args.capacity_tokens, (1.0, 1.25, 1.5), args.skew, args.capacity_total_tokens)
        out["capacity"] = capacity_drops(spec)
        print_capacity(out["capacity"], spec)
    print_summary(out)
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    result = {"benchmark": "moe_bench", "torch_threads": torch.get_num_threads(), "parts": args.parts}
    result["cells"] = run_paths(args) if "paths" in args.parts else []
    if set(args.parts) - {"paths"}:
        result["expert_parallel"] = run_expert_parallel(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
