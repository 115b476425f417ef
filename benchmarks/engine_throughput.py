"""Generated tokens per second: Strata's engine against transformers' `generate`, same model, prompts and lengths.

Both sides run greedy with the same prompt token ids (all prompts of one length, so transformers needs no padding)
and generate exactly `--output-len` tokens per request (EOS ignored). Each concurrency level runs on fresh prompts
for both sides, so neither side is measured on a cached answer. Prints the ratio Strata / transformers per level;
with `--json` the last line is one JSON object with every figure.

    python benchmarks/engine_throughput.py                 # 1, 8, 32 concurrent requests
    python benchmarks/engine_throughput.py --quick         # CI smoke run
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from strata.llm import LLM  # noqa: E402
from strata.paths import resolve_model  # noqa: E402


def make_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids above the special tokens; random ids make every prompt distinct (no prefix-cache hits).
    return [[rng.randrange(8, vocab_size) for _ in range(length)] for _ in range(count)]


def time_strata(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == output_len * len(prompts), "every request must generate exactly output_len tokens"
    return elapsed, generated


@torch.inference_mode()
def time_transformers(model, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch, prompt_len]
    start = time.perf_counter()
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len,
        min_new_tokens=output_len, do_sample=False, pad_token_id=0,
        repetition_penalty=1.0, temperature=None, top_p=None, top_k=None,  # plain greedy, as on Strata's side
    )
    elapsed = time.perf_counter() - start
    generated = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return elapsed, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="tiny run that checks the benchmark still works")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.prompt_len, args.output_len = "1,4", 16, 8

    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(path, dtype=args.dtype, max_num_seqs=max(levels))
    vocab = hf.config.vocab_size

    warm = make_prompts(vocab, 2, args.prompt_len, seed=12345)
    time_strata(llm, warm, 4)
    time_transformers(hf, warm, 4)

    results = []
    for i, c in enumerate(levels):
        prompts = make_prompts(vocab, c, args.prompt_len, seed=i)
        # Strata and transformers each see the same fresh prompts once.
        s_time, s_tokens = time_strata(llm, prompts, args.output_len)
        h_time, h_tokens = time_transformers(hf, prompts, args.output_len)
        row = {
            "concurrency": c,
            "strata_tok_s": s_tokens / s_time,
            "transformers_tok_s": h_tokens / h_time,
        }
        row["ratio"] = row["strata_tok_s"] / row["transformers_tok_s"]
        results.append(row)
        print(f"concurrency {c:>3}: strata {row['strata_tok_s']:8.1f} tok/s | transformers "
              f"{row['transformers_tok_s']:8.1f} tok/s | ratio {row['ratio']:.2f}x", flush=True)

    summary = {"benchmark": "engine_throughput", "model": path, "dtype": args.dtype,
               "prompt_len": args.prompt_len, "output_len": args.output_len,
               "torch_threads": torch.get_num_threads(), "results": results}
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
