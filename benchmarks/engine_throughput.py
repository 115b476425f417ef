"""Generated tokens per second: Strata's engine, compiled and eager, against transformers' `generate`, on the same
model, prompts and lengths, with the physical bounds of this machine measured in the same run.

Fair and stable by construction:
- every side runs greedy on the same prompt token ids (all of one length, so transformers needs no padding) and
  generates exactly `--output-len` tokens per request (EOS ignored; asserted);
- each concurrency level runs `--rounds` interleaved rounds; in each round every side runs once, on prompts no side
  has seen (new random ids per round: no prefix-cache hit, no cached answer), in alternating order (round 0:
  compiled, eager, transformers; round 1 the reverse, so Strata and transformers take turns going first);
- every engine is warmed at every level first (the compiled engine compiles its batch-size buckets at construction
  or first use: never timed);
- figures are medians over the rounds; ratios are ratios of those medians.

Strata runs twice side by side: `LLM(..., enforce_eager=False)` (the compiled decode step) and `enforce_eager=True`.

Physical bounds, measured in this run:
- batch 1, memory: the weight bytes one decode token reads (every non-expert weight, top_k/E of the expert
  weights, one embedding row, the whole lm_head) / the copy bandwidth of a 256 MB `torch` copy (read + written
  bytes per second, median of 5) = the most tokens/s a weight-streaming decoder can make;
- batch 32, compute: FLOPs per token (2 x active parameters incl. lm_head, plus attention at the mean context) /
  the matmul throughput of [512x1024]x[1024x1024] in the run's dtype and thread count (median of 5, the faster of
  the two layouts of the right operand).

    OMP_NUM_THREADS=1 python benchmarks/engine_throughput.py          # 1, 8, 32, 64 concurrent, 3 rounds
    python benchmarks/engine_throughput.py --device cuda --dtype bfloat16   # on a GPU: CUDA graphs vs eager vs HF
    python benchmarks/engine_throughput.py --concurrency 1,8 --output-len 16 --rounds 2
    python benchmarks/engine_throughput.py --quick                    # CI smoke run
With `--json` the last line is one JSON object with every sample.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cpu_features import fp32_gemm_min_rows  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from strata.llm import LLM  # noqa: E402
from strata.paths import resolve_model  # noqa: E402

SIDES = ("strata_compiled", "strata_eager", "transformers")
Run = Callable[[list[list[int]], int], int]   # (prompts, output_len) -> generated tokens


class Cost(NamedTuple):
    """What one decode token costs the model."""

    weight_bytes: int        # read at batch 1
    flops: float             # at the mean context


def make_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids above the special tokens; random ids make every prompt distinct (no prefix-cache hits).
    return [[rng.randrange(8, vocab_size) for _ in range(length)] for _ in range(count)]


def strata_run(llm: LLM) -> Run:
    def run(prompts: list[list[int]], output_len: int) -> int:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        return sum(len(o.token_ids) for o in llm.generate(prompts, params))
    return run


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read after it counts all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def transformers_run(model) -> Run:
    @torch.inference_mode()
    def run(prompts: list[list[int]], output_len: int) -> int:
        input_ids = torch.tensor(prompts, dtype=torch.long, device=model.device)  # [batch, prompt_len]
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False, pad_token_id=0,
            repetition_penalty=1.0, temperature=None, top_p=None, top_k=None,  # plain greedy, as on Strata's side
        )
        synchronize(out.device)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return run


def tokens_per_s(run: Run, prompts: list[list[int]], output_len: int) -> float:
    start = time.perf_counter()
    generated = run(prompts, output_len)
    elapsed = time.perf_counter() - start
    assert generated == output_len * len(prompts), "every request must generate exactly output_len tokens"
    return generated / elapsed


def side_order(round_index: int) -> tuple[str, ...]:
    return SIDES if round_index % 2 == 0 else SIDES[::-1]


def measure_level(runs: dict[str, Run], vocab: int, level: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """tok/s samples per side, one per round."""
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        prompts = make_prompts(vocab, level, args.prompt_len, seed=1_000 * level + r)  # new every round
        for side in side_order(r):
            samples[side].append(tokens_per_s(runs[side], prompts, args.output_len))
    return samples


def warm_up(runs: dict[str, Run], vocab: int, levels: list[int], prompt_len: int) -> None:
    """Every side at every level's batch size (the compiled engine's buckets), on prompts never timed."""
    for level in levels:
        prompts = make_prompts(vocab, level, prompt_len, seed=-level)
        for side in SIDES:
            runs[side](prompts, 4)


def decode_cost(model, element_bytes: int, context: float) -> Cost:
    """Per decode token: the weights read at batch 1 and the FLOPs, from the transformers model's parameters."""
    config = model.config
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 1
    top_k = getattr(config, "num_experts_per_tok", None) or num_experts
    dense = expert = 0
    for name, param in model.named_parameters():
        if param is embed or param is head:
            continue
        if re.search(r"\.experts\.", name):
            expert += param.numel()
        else:
            dense += param.numel()
    active = dense + expert * top_k / num_experts + head.numel()           # lm_head: every row, every token
    weight_bytes = int((active + embed.shape[1]) * element_bytes)          # + the token's embedding row
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_attention_heads * head_dim * context * config.num_hidden_layers  # QK^T and PV
    return Cost(weight_bytes, 2 * active + attention)


def copy_bandwidth(device: torch.device = torch.device("cpu"), num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second read + written by a large `torch` copy on `device` (median of `repeats`)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)


def matmul_throughput(dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """FLOP/s of [512x1024]x[1024x1024] on `device` (median of `repeats`), the fastest of the right operand stored
    by rows or by columns (on a CPU without native bf16 the layouts' bf16 speeds differ 5-12x) and, where the engine
    runs bf16 products in fp32 (`cpu_features.fp32_gemm_min_rows`), that conversion."""
    a, b = (torch.randn(n, 1024, dtype=dtype, device=device) for n in (512, 1024))
    products = [lambda: torch.mm(a, b), lambda: torch.mm(a, b.t())]   # a @ b (rows) and a @ b^T, as `F.linear`
    if fp32_gemm_min_rows(dtype, device):       # the engine converts such products to fp32 from a few rows
        products.append(lambda: torch.mm(a.float(), b.t().float()).to(dtype))
    rates = []
    for product in products:
        product()
        synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            synchronize(device)
            times.append(time.perf_counter() - start)
        rates.append(2 * 512 * 1024 * 1024 / statistics.median(times))
    return max(rates)


def level_row(level: int, samples: dict[str, list[float]]) -> dict:
    med = {side: statistics.median(values) for side, values in samples.items()}
    return {"concurrency": level, "samples_tok_s": samples, **{f"{s}_tok_s": med[s] for s in SIDES},
            "compiled_vs_transformers": med["strata_compiled"] / med["transformers"],
            "eager_vs_transformers": med["strata_eager"] / med["transformers"],
            "compiled_vs_eager": med["strata_compiled"] / med["strata_eager"]}


def print_row(row: dict, rounds: int) -> None:
    print(f"concurrency {row['concurrency']:>3}: compiled {row['strata_compiled_tok_s']:8.1f} | eager "
          f"{row['strata_eager_tok_s']:8.1f} | transformers {row['transformers_tok_s']:8.1f} tok/s | "
          f"compiled/transformers {row['compiled_vs_transformers']:.2f}x, eager/transformers "
          f"{row['eager_vs_transformers']:.2f}x, compiled/eager {row['compiled_vs_eager']:.2f}x "
          f"(medians of {rounds})", flush=True)


def bounds(cost: Cost, rows: list[dict], dtype: torch.dtype, device: torch.device) -> dict:
    """The batch-1 memory bound and the batch-32 compute bound (or the largest level run), and how far Strata is."""
    bandwidth, flop_s = copy_bandwidth(device), matmul_throughput(dtype, device)
    by_level = {row["concurrency"]: row for row in rows}
    one, many = by_level.get(1), by_level.get(32) or by_level[max(by_level)]
    memory_bound, compute_bound = bandwidth / cost.weight_bytes, flop_s / cost.flops
    out = {"weight_bytes_per_token": cost.weight_bytes, "copy_bandwidth_bytes_s": bandwidth,
           "memory_bound_tok_s": memory_bound, "flops_per_token": cost.flops, "matmul_flop_s": flop_s,
           "compute_bound_tok_s": compute_bound, "compute_bound_level": many["concurrency"]}
    for side in ("strata_compiled", "strata_eager"):
        if one is not None:
            out[f"{side}_of_memory_bound"] = one[f"{side}_tok_s"] / memory_bound
        out[f"{side}_of_compute_bound"] = many[f"{side}_tok_s"] / compute_bound
    return out


def print_bounds(b: dict, dtype: str, device: torch.device) -> None:
    where = f"{torch.get_num_threads()} thread(s)" if device.type == "cpu" else str(device)
    if "strata_compiled_of_memory_bound" in b:
        print(f"memory bound at batch 1: {b['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token / "
              f"{b['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s copy bandwidth = {b['memory_bound_tok_s']:.0f} tok/s; "
              f"compiled reaches {b['strata_compiled_of_memory_bound']:.1%} of it "
              f"({1 / b['strata_compiled_of_memory_bound']:.1f}x from it), eager "
              f"{b['strata_eager_of_memory_bound']:.1%}")
    print(f"compute bound at batch {b['compute_bound_level']}: {b['flops_per_token'] / 1e6:.2f} MFLOP per token / "
          f"{b['matmul_flop_s'] / 1e9:.1f} GFLOP/s matmul ({dtype}, {where}) = "
          f"{b['compute_bound_tok_s']:.0f} tok/s; compiled reaches {b['strata_compiled_of_compute_bound']:.1%} of it "
          f"({1 / b['strata_compiled_of_compute_bound']:.1f}x from it), eager "
          f"{b['strata_eager_of_compute_bound']:.1%}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level; medians are reported")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: both engines and the bounds run there")
    parser.add_argument("--quick", action="store_true", help="tiny run that checks the benchmark still works")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.prompt_len, args.output_len, args.rounds = "1,4", 16, 8, 1
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main() -> None:
    args = parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    levels = [int(c) for c in args.concurrency.split(",")]
    device = torch.device(args.device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    engine = dict(dtype=args.dtype, max_num_seqs=max(levels), device=args.device)
    runs = {"strata_compiled": strata_run(LLM(path, enforce_eager=False, **engine)),
            "strata_eager": strata_run(LLM(path, enforce_eager=True, **engine)),
            "transformers": transformers_run(hf)}
    vocab = hf.config.vocab_size
    warm_up(runs, vocab, levels, args.prompt_len)

    rows = []
    for level in levels:
        rows.append(level_row(level, measure_level(runs, vocab, level, args)))
        print_row(rows[-1], args.rounds)
    element_bytes = torch.finfo(dtype).bits // 8
    cost = decode_cost(hf, element_bytes, context=args.prompt_len + args.output_len / 2)
    limits = bounds(cost, rows, dtype, device)
    print_bounds(limits, args.dtype, device)

    summary = {"benchmark": "engine_throughput", "model": path, "dtype": args.dtype, "device": args.device,
               "prompt_len": args.prompt_len,
               "output_len": args.output_len, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
               "results": rows, "bounds": limits}
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
