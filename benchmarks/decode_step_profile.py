"""Per-step time of a decode batch: the whole `LLMEngine.step()` and the share spent outside the forward, then the
model runner alone and the ops its step spends the time on.

Engine mode (on by default; `--no-engine` skips it): B concurrent requests with `--prompt-len`-token prompts are
added to a real engine and run past their prefill; then each of `--steps` decode steps is timed whole and inside
`runner.execute` (wrapped), and the medians give the share of the step outside the forward (scheduling, sampling,
detokenizing, outputs). Two workloads per batch size: `greedy`, and `mixed` (rows cycle through temperature,
top-k, top-p, seeds, repetition / presence / frequency penalties, logit bias and min_tokens). Requests ask for the
text only when they finish, as `LLM.generate` does (`--stream-text`: every step, as a stream).

Runner mode: each batch size B runs B decode sequences (one new token each, every sequence with its own `--table-blocks`
distinct blocks) through `ModelRunner.execute` as a real decode does: the first step at position `--context - 1`,
each later step one position further (so steady-state optimizations apply; the first step is a warm-up). The
cache holds whatever earlier steps wrote, which is enough for timing. Prints the median and minimum step time per
batch size and the top ops of a profiled run of the largest batch; with `--json` the last line is one JSON object
with every figure. Runs on 1 torch thread unless `--threads` says otherwise.

    OMP_NUM_THREADS=1 python benchmarks/decode_step_profile.py                   # batch 1, 8, 32
    python benchmarks/decode_step_profile.py --batch 32 --top 15 --json
    python benchmarks/decode_step_profile.py --quick --json                       # the CI smoke run
    OMP_NUM_THREADS=1 python benchmarks/decode_step_profile.py --guarded-ab 8 --context 128 --steps 20

`--guarded-ab ROUNDS` measures the compiled step's direct dispatch (engine/compiled_decode.py `_adopt`) against
dynamo's guarded dispatch (`STRATA_GUARDED_DISPATCH=1`): two engines built in this process, runner mode, ROUNDS
interleaved rounds (the order alternates), each round's median per batch size, then the median of those.

`--env-ab NAME=VALUE` (with `--ab-rounds`) measures the same way an engine built with NAME=VALUE in its environment
against one built without: e.g. `--dtype bfloat16 --env-ab STRATA_NATIVE_BF16=1` runs the MoE paths chosen for a
CPU with native bf16 GEMMs (engine/moe/plan.py) against this CPU's own choice.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.batch import ScheduledSeq, StepBatch  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
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


def workload_params(kind: str, row: int, max_tokens: int) -> SamplingParams:
    """Row `row`'s params: `greedy`, or `mixed` (every sampler option, cycling over rows). No request stops early."""
    common = {"max_tokens": max_tokens, "ignore_eos": True}
    if kind == "greedy":
        return SamplingParams(**common)
    mixed = [  # row 0 alone (batch 1) is a seeded, filtered, penalised draw
        {"temperature": 0.8, "top_p": 0.9, "seed": row, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
        {},
        {"temperature": 1.0, "top_k": 40, "repetition_penalty": 1.2, "seed": row},
        {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.1, "logit_bias": {5: -3.0, 17: 2.0}},
        {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": row, "min_tokens": max_tokens,
         "stop_token_ids": (3,)},
    ]
    return SamplingParams(**common, **mixed[row % len(mixed)])


def text_policy(params: SamplingParams, stream_text: bool) -> SamplingParams:
    """`LLM.generate`'s policy (text decoded once, at the end) unless `--stream-text` (text every step)."""
    return params if stream_text else dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


class TimedRunner:
    """Wraps `runner.execute` to record the time of each call."""

    def __init__(self, runner) -> None:
        self.runner, self.times = runner, []
        self._execute = runner.execute

    def __enter__(self) -> "TimedRunner":
        def execute(batch):
            start = time.perf_counter()
            try:
                return self._execute(batch)
            finally:
                self.times.append(time.perf_counter() - start)
        self.runner.execute = execute
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute


def engine_step_times(llm: LLM, batch: int, kind: str, prompt_len: int, steps: int,
                      stream_text: bool = False) -> tuple[list, list]:
    """(step seconds, forward seconds) of `steps` decode steps with `batch` running requests."""
    engine, warmup = llm.engine, 3
    gen = torch.Generator().manual_seed(2 * batch + (kind == "mixed"))  # no prefix hits
    vocab = engine.runner.vocab_size
    ids = [f"{kind}-{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = torch.randint(8, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(request_id, prompt, text_policy(workload_params(kind, i, warmup + steps + 2), stream_text))
    while any(r.num_output_tokens == 0 for r in map(engine.scheduler.get_request, ids)):
        engine.step()   # prefills
    for _ in range(warmup):
        engine.step()
    step_s = []
    with TimedRunner(engine.runner) as timed:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    assert len(timed.times) == steps, "every timed step must run the forward exactly once"
    return step_s, timed.times


def engine_rows(llm: LLM, sizes: list[int], prompt_len: int, steps: int, stream_text: bool) -> list[dict]:
    engine_step_times(llm, max(sizes), "mixed", prompt_len, 4, stream_text)  # warm-up
    rows = []
    for kind in ("greedy", "mixed"):
        for size in sizes:
            step_s, forward_s = engine_step_times(llm, size, kind, prompt_len, steps, stream_text)
            step, forward = statistics.median(step_s), statistics.median(forward_s)
            outside = statistics.median(s - f for s, f in zip(step_s, forward_s))
            row = {"workload": kind, "batch": size, "step_ms": 1e3 * step, "forward_ms": 1e3 * forward,
                   "outside_ms": 1e3 * outside, "outside_share": outside / step}
            rows.append(row)
            print(f"engine {kind:<6} batch {size:>3}: step {row['step_ms']:7.3f} ms | forward "
                  f"{row['forward_ms']:7.3f} ms | outside the forward {row['outside_ms']:6.3f} ms "
                  f"({100 * row['outside_share']:4.1f}%)", flush=True)
    return rows


def env_ab(args: argparse.Namespace, sizes: list[int], dtype: dict, rounds: int, setting: str,
           names: tuple[str, str]) -> tuple[dict, list[dict]]:
    """Two engines built in this process, the second with `setting` (NAME=VALUE) in the environment while it is
    built (and compiled); their runners' decode step per batch size in `rounds` interleaved rounds (the order
    alternates). (runners, a row per batch size: each engine's median of its round medians, ms, and b / a)."""
    a, b = names
    env, value = setting.split("=", 1)
    blocks = max(sizes) * args.table_blocks + 1
    llms = {a: LLM(args.model, max_num_seqs=max(sizes), num_blocks=blocks, **dtype)}
    saved = os.environ.get(env)
    os.environ[env] = value
    try:
        llms[b] = LLM(args.model, max_num_seqs=max(sizes), num_blocks=blocks, **dtype)
    finally:
        os.environ.pop(env) if saved is None else os.environ.__setitem__(env, saved)
    runners = {name: llm.engine.runner for name, llm in llms.items()}
    medians: dict[tuple[str, int], list[float]] = {(n, size): [] for n in runners for size in sizes}
    for r in range(rounds):
        for size in sizes:
            for name in ((a, b) if r % 2 == 0 else (b, a)):
                runner = runners[name]
                times = step_times(runner, decode_steps(size, args.context, args.steps, args.table_blocks,
                                                        runner.block_size))
                medians[(name, size)].append(statistics.median(times))
    rows = []
    for size in sizes:
        ta, tb = (statistics.median(medians[(n, size)]) for n in names)
        rows.append({"batch": size, f"{a}_ms": 1e3 * ta, f"{b}_ms": 1e3 * tb, f"{b}_over_{a}": tb / ta})
        print(f"batch {size:>3}: {a} {1e3 * ta:7.3f} ms/step | {b} {1e3 * tb:7.3f} ms/step | "
              f"{b} / {a} {tb / ta:.3f}x (medians of {rounds} interleaved rounds)", flush=True)
    return runners, rows


def guarded_ab(args: argparse.Namespace, sizes: list[int], dtype: dict) -> list[dict]:
    """Guarded ÷ direct step time per batch size (`--guarded-ab`)."""
    from engine.compiled_decode import ENV_GUARDED
    runners, rows = env_ab(args, sizes, dtype, args.guarded_ab, f"{ENV_GUARDED}=1", ("direct", "guarded"))
    assert runners["direct"].compiled.direct_buckets and not runners["guarded"].compiled.direct_buckets, \
        "direct dispatch needs the compiled step on a CPU"
    return rows


def setting_ab(args: argparse.Namespace, sizes: list[int], dtype: dict) -> list[dict]:
    """With `--env-ab NAME=VALUE` ÷ without, step time per batch size."""
    return env_ab(args, sizes, dtype, args.ab_rounds, args.env_ab, ("default", args.env_ab))[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=96, help="tokens per sequence after the step")
    parser.add_argument("--table-blocks", type=int, default=16, help="blocks per sequence (cover context+steps)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="engine dtype (default: the engine's default)")
    parser.add_argument("--top", type=int, default=12, help="ops to list for the largest batch (0: none)")
    parser.add_argument("--prompt-len", type=int, default=64, help="engine mode: prompt tokens per request")
    parser.add_argument("--stream-text", action="store_true",
                        help="engine mode: requests stream text every step (default: text at the end, as generate)")
    parser.add_argument("--no-engine", dest="engine", action="store_false", help="skip the engine-step mode")
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 1 and 4, few steps, no op table")
    parser.add_argument("--guarded-ab", type=int, default=0, metavar="ROUNDS",
                        help="direct vs guarded dispatch of the compiled step, ROUNDS interleaved rounds (see above)")
    parser.add_argument("--env-ab", default="", metavar="NAME=VALUE",
                        help="an engine built with NAME=VALUE in its environment vs one without (see above)")
    parser.add_argument("--ab-rounds", type=int, default=6, help="--env-ab: interleaved rounds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps, args.top, args.prompt_len = "1,4", 4, 0, 16
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch.split(",")]
    engine_blocks = -(-(args.prompt_len + args.steps + 8) // 16)   # a request's table in engine mode (block 16)
    dtype = {"dtype": args.dtype} if args.dtype else {}
    for mode, rounds, run in (("guarded_ab", args.guarded_ab, guarded_ab),
                              ("env_ab", args.ab_rounds if args.env_ab else 0, setting_ab)):
        if rounds:
            rows = run(args, sizes, dtype)
            if args.json:
                print(json.dumps({"benchmark": "decode_step_profile", "mode": mode, "context": args.context,
                                  "setting": args.env_ab, "torch_threads": torch.get_num_threads(), "rounds": rounds,
                                  "results": rows}))
            return
    llm = LLM(args.model, max_num_seqs=max(sizes), num_blocks=max(sizes) * max(args.table_blocks, engine_blocks) + 1,
              **dtype)
    runner = llm.engine.runner
    engine = engine_rows(llm, sizes, args.prompt_len, args.steps, args.stream_text) if args.engine else []
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
                          "torch_threads": torch.get_num_threads(), "stream_text": args.stream_text,
                          "engine": engine, "results": results, "top_ops": ops}))


if __name__ == "__main__":
    main()
