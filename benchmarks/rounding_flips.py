"""How often the last bits decide a sampled token: the same seeded requests through the eager engine and through the
compiled decode step, per sampling setting, and which requests come out different (and where).

The compiled step rounds differently from the eager forward (logits within ~5e-6 here). A seeded draw is a
deterministic function of the logits, so a request can only differ where its draw sat that close to a boundary:
top-p's nucleus edge (one candidate more or less changes the mass the draw is scaled by), or the edge between two
candidates in the inverse CDF. This is what bounds "token-exact" for sampled requests that are migrated or batched
differently (README, "Request migration"). Requests: the fault test's 64 prompts (`tests/faults/test_decode_faults.py`:
half share a prefix), seeds 1000 + i, T 0.9, presence penalty 0.3, 64 tokens, EOS ignored.

    python benchmarks/rounding_flips.py            # ~3 min here, most of it compiling
    python benchmarks/rounding_flips.py --quick    # 8 requests, 16 tokens
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from strata.llm import LLM  # noqa: E402

SETTINGS = {"top-p 0.95": dict(temperature=0.9, top_p=0.95), "whole vocabulary": dict(temperature=0.9),
            "top-k 50": dict(temperature=0.9, top_k=50), "greedy": dict(temperature=0.0)}


def prompt(i: int) -> str:
    """Request i's prompt, as `tests/faults/test_decode_faults.py` sends it (it imports this)."""
    return f"shared preamble of the fault test {i % 2} " * 3 + f"request {i} asks for w{i % 13} w{i % 5}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 8, 16
    engines = {eager: LLM(None, dtype=args.dtype, enforce_eager=eager, max_num_seqs=args.requests)
               for eager in (True, False)}
    prompts = [prompt(i) for i in range(args.requests)]
    results = {}
    for name, setting in SETTINGS.items():
        params = [SamplingParams(max_tokens=args.max_tokens, seed=1000 + i, ignore_eos=True, presence_penalty=0.3,
                                 **setting) for i in range(args.requests)]
        eager, compiled = ([o.token_ids for o in engines[e].generate(prompts, params)] for e in (True, False))
        differing = {i: first_difference(a, b) for i, (a, b) in enumerate(zip(eager, compiled)) if a != b}
        results[name] = differing
        where = ", ".join(f"request {i} at token {j}" for i, j in differing.items()) or "none"
        print(f"{name:<17} {len(differing)} of {args.requests} requests differ (eager vs compiled): {where}",
              flush=True)
    if args.json:
        print(json.dumps({"benchmark": "rounding_flips", "requests": args.requests, "max_tokens": args.max_tokens,
                          "dtype": args.dtype, "differing": {k: {str(i): j for i, j in v.items()}
                                                             for k, v in results.items()}}))


if __name__ == "__main__":
    main()
