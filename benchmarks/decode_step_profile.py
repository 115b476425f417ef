"""Per-step time of one decode batch on the model runner, and the ops that step spends it on.

Each batch size B runs B decode sequences (one new token each, every sequence with its own `--table-blocks`
distinct blocks) through `ModelRunner.execute` as a real decode does: the first step at position `--context - 1`,
each later step one position further (so steady-state optimizations apply; the first step is a warm-up). The
cache holds whatever earlier steps wrote, which is enough for timing. Prints the median and minimum step time per
batch size and the top ops of a profiled run of the largest batch; with `--json` the last line is one JSON object
with every figure. Runs on 1 torch thread unless `--threads` says otherwise.

    OMP_NUM_THREADS=1 python benchmarks/decode_step_profile.py                   # batch 1, 8, 32
    python benchmarks/decode_step_profile.py --batch 32 --top 15 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.batch import ScheduledSeq, StepBatch  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from strata.llm import LLM  # noqa: E402


def make_decode_batch(batch: int, position: int, table_blocks: int, block_size: int) -> StepBatch:
    """`batch` decodes at `position`; sequence i owns blocks [i*table_blocks, (i+1)*table_blocks)."""
    if position >= table_blocks * block_size:
        raise ValueError(f"--table-blocks must cover every position: {table_blocks} blocks of {block_size} "
                         f"<= {position}")
    return StepBatch([ScheduledSeq(f"r{i}", [(7 * i + 11) % 256 + 8], position,
                                   list(range(i * table_blocks, (i + 1) * table_blocks)))
                      for i in range(batch)])


def decode_steps(batch: int, context: int, steps: int, table_blocks: int, block_size: int) -> list[StepBatch]:
    """One warm-up step at position context-1, then `steps` steps each one position further."""
    return [make_decode_batch(batch, context - 1 + i, table_blocks, block_size) for i in range(steps + 1)]


def step_times(runner: ModelRunner, batches: list[StepBatch]) -> list[float]:
    runner.execute(batches[0])
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        runner.execute(batch)
        times.append(time.perf_counter() - start)
    return times


def top_ops(runner: ModelRunner, batches: list[StepBatch], top: int) -> list[dict]:
    """The `top` ops by self CPU time, per step (microseconds), over the steps after the warm-up."""
    from torch.profiler import ProfilerActivity, profile
    runner.execute(batches[0])
    steps = len(batches) - 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches[1:]:
            runner.execute(batch)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_us_per_step": e.self_cpu_time_total / steps, "calls_per_step": e.count / steps}
            for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=96, help="tokens per sequence after the step")
    parser.add_argument("--table-blocks", type=int, default=16, help="blocks per sequence (cover context+steps)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--top", type=int, default=12, help="ops to list for the largest batch (0: none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch.split(",")]
    llm = LLM(args.model, max_num_seqs=max(sizes), num_blocks=max(sizes) * args.table_blocks + 1)
    runner = llm.engine.runner
    results = []
    for size in sizes:
        times = step_times(runner, decode_steps(size, args.context, args.steps, args.table_blocks, runner.block_size))
        row = {"batch": size, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
        results.append(row)
        print(f"batch {size:>3}: median {row['median_ms']:7.3f} ms/step | min {row['min_ms']:7.3f} ms", flush=True)
    ops = []
    if args.top:
        largest = decode_steps(max(sizes), args.context, 10, args.table_blocks, runner.block_size)
        ops = top_ops(runner, largest, args.top)
        print(f"top ops per step, batch {max(sizes)}:")
        for op in ops:
            print(f"  {op['op']:<40} {op['self_us_per_step']:9.1f} us  {op['calls_per_step']:6.1f} calls")
    if args.json:
        print(json.dumps({"benchmark": "decode_step_profile", "context": args.context,
                          "torch_threads": torch.get_num_threads(), "results": results, "top_ops": ops}))


if __name__ == "__main__":
    main()
