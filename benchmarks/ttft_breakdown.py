"""Time to first token, broken down: disaggregated (prefill worker -> KV transfer -> decode worker) against a
single engine (the decode worker prefilling itself, `Generate`), same processes, prompts and run.

For each prompt length it runs fresh prompts (no prefix-cache hits) through both paths and reports medians:

    disaggregated:  TTFT = Prefill RPC  = queue + prefill + store (pin, encode, lease) + RPC overhead
                    then Decode:          transfer (KV pull) + first decode step  -> second token
    single engine:  TTFT = Generate's first chunk; then its first decode step     -> second token

and the ratios disaggregated / single for TTFT and for time to the second token (where the hand-off cost shows).
With `--json` the last line is one JSON object with every figure.

    python benchmarks/ttft_breakdown.py                      # 128, 512, 1024-token prompts, shm
    python benchmarks/ttft_breakdown.py --transfer tcp
    python benchmarks/ttft_breakdown.py --quick --json       # CI smoke run
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from strata.paths import resolve_model  # noqa: E402
from strata.v1 import worker_pb2  # noqa: E402
from worker_common.client import local  # noqa: E402
from worker_common.convert import sampling_to_proto  # noqa: E402
from worker_common.launch import WorkerProcess  # noqa: E402

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def build_random_llama(folder: Path, vocab: int = 1024) -> str:
    """A seeded random Llama (4 layers, hidden 256) with a word-level tokenizer, for when no model is given."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return str(folder)


def pick_model(model: str | None, scratch: Path) -> str:
    try:
        path = resolve_model(model)
        if (Path(path) / "config.json").is_file():
            return path
    except ValueError:
        if model:
            raise
    return build_random_llama(scratch / "random-llama")


def disaggregated_once(prefill, decode, request_id: str, prompt: list[int]) -> dict:
    sampling = sampling_to_proto(PARAMS)
    started = time.perf_counter()
    first = prefill.Prefill(worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling),
                            timeout=120)
    prefill_rpc_ms = (time.perf_counter() - started) * 1000
    decode_started = time.perf_counter()
    stream = decode.Decode(worker_pb2.DecodeRequest(request_id=request_id, token_ids=prompt,
                                                    first_token_id=first.first_token_id, kv=first.kv,
                                                    sampling=sampling), timeout=120)
    first_chunk_ms, last = 0.0, None
    for chunk in stream:
        first_chunk_ms = first_chunk_ms or (time.perf_counter() - decode_started) * 1000
        last = chunk
    t = first.timings
    transfer_ms = last.timings.transfer_ms
    return {"ttft_ms": prefill_rpc_ms, "queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "store_ms": t.store_ms,
            "rpc_overhead_ms": prefill_rpc_ms - t.queue_ms - t.prefill_ms - t.store_ms,
            "transfer_ms": transfer_ms, "first_decode_step_ms": first_chunk_ms - transfer_ms,
            "second_token_ms": prefill_rpc_ms + first_chunk_ms, "blocks_transferred": last.blocks_transferred,
            "blocks_recomputed": last.blocks_recomputed}


def single_once(decode, request_id: str, prompt: list[int]) -> dict:
    out = local(decode, request_id, prompt, PARAMS, timeout_s=120)
    t = out.last_chunk.timings
    return {"ttft_ms": out.ttft_ms, "queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms,
            "first_decode_step_ms": out.second_token_ms - out.ttft_ms, "second_token_ms": out.second_token_ms}


def medians(rows: list[dict]) -> dict:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def measure(prefill, decode, length: int, repeats: int, vocab: int, rng: random.Random) -> dict:
    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(length)]   # fresh tokens: no prefix-cache hits

    disaggregated_once(prefill, decode, f"warm-d-{length}", prompt())   # warm-up: shapes, sockets, mappings
    single_once(decode, f"warm-s-{length}", prompt())
    disagg, single = [], []
    for i in range(repeats):
        disagg.append(disaggregated_once(prefill, decode, f"d-{length}-{i}", prompt()))
        single.append(single_once(decode, f"s-{length}-{i}", prompt()))
    d, s = medians(disagg), medians(single)
    return {"prompt_tokens": length, "disaggregated": d, "single": s,
            "ttft_ratio": d["ttft_ms"] / s["ttft_ms"],
            "second_token_ratio": d["second_token_ms"] / s["second_token_ms"]}


def print_table(results: list[dict], transfer: str) -> None:
    print(f"TTFT breakdown, medians in ms (transfer: {transfer}); ratio = disaggregated / single engine")
    print(f"{'prompt':>7} | {'path':<6} | {'TTFT':>8} {'queue':>7} {'prefill':>8} {'store':>7} {'rpc':>6} | "
          f"{'transfer':>8} {'1st dec':>8} | {'2nd tok':>8}")
    for r in results:
        d, s = r["disaggregated"], r["single"]
        print(f"{r['prompt_tokens']:>7} | {'disagg':<6} | {d['ttft_ms']:>8.2f} {d['queue_ms']:>7.2f} "
              f"{d['prefill_ms']:>8.2f} {d['store_ms']:>7.2f} {d['rpc_overhead_ms']:>6.2f} | "
              f"{d['transfer_ms']:>8.2f} {d['first_decode_step_ms']:>8.2f} | {d['second_token_ms']:>8.2f}")
        print(f"{'':>7} | {'single':<6} | {s['ttft_ms']:>8.2f} {s['queue_ms']:>7.2f} {s['prefill_ms']:>8.2f} "
              f"{'-':>7} {'-':>6} | {'-':>8} {s['first_decode_step_ms']:>8.2f} | {s['second_token_ms']:>8.2f}")
        print(f"{'':>7} | ratio  | TTFT {r['ttft_ratio']:.2f}x, second token {r['second_token_ratio']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or bundled name (default: bundled, else a "
                                                      "random 4-layer Llama built here)")
    parser.add_argument("--transfer", choices=("shm", "tcp", "nixl"), default="shm")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two short lengths, one repeat (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = [32, 128], 1
    with tempfile.TemporaryDirectory(prefix="strata-ttft-") as scratch:
        model = pick_model(args.model, Path(scratch))
        worker_args = ["--model", model, "--transfer", args.transfer, "--max-model-len", str(max(args.lengths) + 8),
                       "--max-num-batched-tokens", str(max(args.lengths) + 8), "--num-blocks", "1024",
                       "--handoff-mib", "64", "--host-tier-mib", "64"]
        prefill = WorkerProcess("prefill", worker_args, wait=False)
        decode = WorkerProcess("decode", worker_args, wait=False)
        try:
            prefill.wait_ready()
            decode.wait_ready()
            from engine.loader import load_checkpoint
            vocab = min(load_checkpoint(model).spec.vocab_size, 1 << 16)
            rng = random.Random(0)
            results = [measure(prefill.stub(), decode.stub(), n, args.repeats, vocab, rng) for n in args.lengths]
        finally:
            prefill.stop()
            decode.stop()
    print_table(results, args.transfer)
    if args.json:
        print(json.dumps({"benchmark": "ttft_breakdown", "transfer": args.transfer, "model": model,
                          "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
