"""Quantization, each scheme against bf16 in one run: weight and KV bytes, held-out perplexity, greedy agreement,
decode speed on memory-bound shapes against the memory-bandwidth bound, and disaggregated TTFT with fp8 KV.

Schemes: bf16 (the baseline: `quantization=None`, `kv_cache_dtype="auto"`, model dtype bfloat16), int8, int4 (group
`--group-size`, default 128), fp8 and mxfp4 weights (`LLM(..., quantization=...)`, quantized at load time), and fp8 /
int8 KV with bf16 weights (`kv_cache_dtype=...`). Every figure is measured here, in this run:

1. Bytes. Weight bytes: every parameter AND buffer of every module of the loaded model (a packed int4 weight is a
   uint8/int32 buffer, its scales and zeros are buffers too), each storage counted once; ratio to bf16's. A scheme
   keeps the embedding and lm_head in bf16 (engine/quant/apply.py), so the tables also give `layers`, the ratio
   without them; its "+vocab" variant (`quantize_vocab=True`, `--quantize-vocab`) quantizes them too, and the byte,
   perplexity and speed targets are judged on those (one configuration meeting all three). (The bundled model ties
   lm_head to the embedding; the transposed copy of it that CPU logits use is a plain attribute, not a parameter or
   buffer, and is not counted.) KV bytes per token: the
   engine's cache, `block_bytes` (values and scales of one block, every layer) / `block_size`.
2. Perplexity of the bundled model (`models/strata-moe-tiny`) on its recipe's held-out split: the files of
   models/recipe/heldout_files.txt, read from this interpreter's standard library, encoded with the bundled
   tokenizer and joined by <|endoftext|> (`prepare_data.encode_files`), cut into non-overlapping 512-token windows
   (`train.eval_windows`; `--ppl-windows` evenly spaced ones, 0 = all 342 = 175,104 tokens; if a listed file is
   missing, the recipe's split rule over the sources this Python has, and the output says so). Each window is a
   prompt of 513 tokens to Strata's engine with `SamplingParams(prompt_logprobs=0)`: perplexity = exp(mean of
   -logprob of every prompt token after the first). For fp8/int8 KV this measures the quantized cache too: the
   torch attention backend attends a fresh prefill over what the cache holds after its write
   (engine/attention/torch_paged.py).
3. Greedy agreement with bf16: `--greedy-prompts` prompts (the first 64 tokens of evenly spaced held-out windows),
   `--greedy-tokens` tokens each, EOS ignored. `agree` = share of positions whose token equals bf16's at the same
   position, counting EVERY position, those after a sequence's first divergence included (the contexts differ
   there, so a later match means the model recovered or matched by chance); `prefix` = share of positions before
   each sequence's first divergence (the strict measure); `same` = sequences identical to bf16's throughout.
4. Decode tokens/s on random-weight checkpoints written here (config.json + bf16 safetensors + the bundled
   tokenizer, nothing downloaded): a ~0.5B dense Qwen3 (hidden 1024, 28 layers, MLP 3072, 16 heads, 8 KV heads,
   head_dim 128, vocab 32,768, untied head) and a ~1B-total Qwen3-MoE (16 layers, 32 experts of 512, top-4).
   Every scheme of one shape is loaded at once; each of `--rounds` rounds runs every scheme (order rotated each
   round) at batch 1 and 16: random 16-token prompts, one prefill step (not timed), then up to `--decode-steps`
   timed decode steps (a sample stops after `--sample-s` seconds, at least 2 steps: a slow kernel cannot hold the
   run up); tokens/s = batch x steps / time; medians over rounds. The bound: the weight bytes one decode step
   reads (everything but the embedding table and the experts, plus one embedding row per token, plus the expert
   bytes x the share of experts the batch hits: top_k/E at batch 1, E(1-(1-k/E)^B)/E at batch B with uniform
   routing) / the copy bandwidth of a 256 MB torch copy (read + written bytes/s, engine_throughput.py's), measured
   once per round, median. KV reads (< 1% here) are left out of the bound, and the KV dtypes are not timed here
   (at these contexts they change < 1% of a step's bytes). Eager by default: compiling the decode step took
   ~25 s per engine at the toy shapes on this 2-core machine (10 engines here, longer at the full shapes);
   `--compiled` times the compiled step (Inductor's cache on disk makes a rerun start fast).
   `--threads` (default 1) sets torch's threads for all of it (the serving workers get OMP_NUM_THREADS): the
   bound's copy runs on the same threads, so the share of the bound compares like with like, and on a 2-core
   machine one thread leaves a core to everything else that runs (the router and 4 workers of part 5, other
   jobs), which keeps the samples steadier.
5. TTFT of disaggregated requests (router + 1 prefill + 1 decode worker, `--transfer tcp`, model dtype bfloat16,
   the bundled model) with fp8 KV against bf16 KV: two `strata serve` clusters side by side (strata.launcher),
   a fresh random `--ttft-prompt`-token prompt per request (no prefix hit), 2 output tokens, `--ttft-rounds`
   rounds, the two clusters alternating first and second; medians. TTFT = first token at the client (the prefill
   worker's token: the KV pull comes after it); TT2T = second token (after the decode worker pulled the KV over
   tcp); bytes moved per request = blocks transferred (the decode worker's count) x the encoded block size
   (kvstore.codec: header, token ids, scales, payload: the length of each block the decode worker reads,
   worker_common/kv_blocks.py `slot_bytes`).

Ends with a table of every target of the issue next to the measured figure (weight bytes and speed on the 0.6B
dense shape, perplexity on the bundled model), each marked met / NOT met / not measured.

    python benchmarks/quant_bench.py                                   # everything, 3 rounds (about 6-9 minutes)
    python benchmarks/quant_bench.py --parts decode --rounds 5 --threads 2
    python benchmarks/quant_bench.py --ppl-windows 0 --plot quant.png   # the whole held-out split
    python benchmarks/quant_bench.py --quick --json                    # CI smoke run (toy shapes, one round)
With `--json` the last line is one JSON object with every figure and sample.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_fixtures as fixtures  # noqa: E402
from engine_throughput import copy_bandwidth  # noqa: E402
import ttft_tiers  # noqa: E402
from quant_targets import lookup, plot, report_targets, targets  # noqa: E402
from engine.checkpoint import load_checkpoint  # noqa: E402
from engine.config import kv_storage_dtype  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kvstore import codec  # noqa: E402
from strata.client import StrataClient  # noqa: E402
from strata.launcher import ServeConfig  # noqa: E402
from strata.llm import LLM  # noqa: E402
from strata.paths import resolve_model  # noqa: E402

PARTS = ("quality", "decode", "ttft")
BATCHES = (1, 16)
PROMPT_LEN = 16           # decode prompts: one block (the prefill is not timed, a short one keeps the run short)
MIN_STEPS = 2
TOKENIZER_IDS = 4096       # the bundled tokenizer's ids: prompts stay inside them
BLOCK_SIZE = 16            # the engine's and the workers' default


class Variant(NamedTuple):
    label: str
    quantization: str | None
    kv_cache_dtype: str = "auto"
    quantize_vocab: bool = False        # "+vocab": the LM head and embedding too (`--quantize-vocab`)


class WeightBytes(NamedTuple):
    total: int               # every parameter and buffer, each storage once
    experts: int             # of which MoE expert stacks (names with "experts")
    embed: int               # of which the embedding table
    head: int                # of which an untied lm_head (0: tied to the embedding)


def weight_variants(group_size: int) -> list[Variant]:
    """bf16, each scheme on the linears, and the schemes with byte targets on the vocabulary matrices too."""
    schemes = [Variant("int8", "int8"), Variant(f"int4-g{group_size}", "int4"), Variant("fp8", "fp8"),
               Variant("mxfp4", "mxfp4")]
    vocab = [Variant(v.label + "+vocab", v.quantization, quantize_vocab=True) for v in schemes if v.label != "fp8"]
    return [Variant("bf16", None), *schemes, *vocab]


KV_VARIANTS = [Variant("kv-fp8", None, "fp8"), Variant("kv-int8", None, "int8")]


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def make_llm(model: str | None, variant: Variant, args: argparse.Namespace, **kwargs) -> LLM | str:
    """The engine for `variant`, or why it could not be built (a scheme that fails is a row, not a crash)."""
    try:
        return LLM(model, dtype="bfloat16", quantization=variant.quantization, quant_group_size=args.group_size,
                   quantize_vocab=variant.quantize_vocab, kv_cache_dtype=variant.kv_cache_dtype,
                   enforce_eager=not args.compiled, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported in the output, per variant
        return failure(exc)


def weight_bytes(model: torch.nn.Module) -> WeightBytes:
    """Bytes of the model's actual tensors: parameters and buffers of every module (shared storages once)."""
    seen: set[tuple[int, int]] = set()
    total = experts = embed = head = 0
    for module_name, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if tensor is None or (tensor.data_ptr(), tensor.numel()) in seen:
                continue
            seen.add((tensor.data_ptr(), tensor.numel()))
            size, full = tensor.numel() * tensor.element_size(), f"{module_name}.{name}".lstrip(".")
            total += size
            experts += size if "experts" in full else 0
            embed += size if full.startswith("embed") else 0
            head += size if "lm_head" in full or full.startswith(("head", "quant_head")) else 0
    return WeightBytes(total, experts, embed, head)


def layer_bytes(wb: dict) -> int:
    """Weight bytes without the embedding and the lm_head (which only "+vocab" variants quantize)."""
    return wb["total"] - wb["embed"] - wb["head"]


def step_bytes(wb: WeightBytes, spec, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens reads (see the docstring, item 4)."""
    head = wb.head or wb.embed                               # tied: the logits read the whole table
    rows = wb.embed / spec.vocab_size * batch                # one embedding row per token
    share = 0.0
    if spec.moe is not None:
        e, k = spec.moe.num_experts, spec.moe.top_k
        share = 1.0 - (1.0 - k / e) ** batch                 # expected share of experts hit
    return wb.total - wb.experts - wb.embed - wb.head + head + rows + wb.experts * share


def kv_bytes_per_token(llm: LLM) -> float:
    cache = llm.engine.runner.cache
    return cache.block_bytes / cache.block_size


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.engine.runner.model


# ---- 2 and 3: perplexity and greedy agreement on the bundled model ---------------------------------------------

def perplexity(llm: LLM, windows: torch.Tensor) -> tuple[float, int]:
    """(exp of the mean negative log-likelihood of every prompt token after the first, tokens scored)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, output_kind="final_only")
    outs = llm.generate([row.tolist() for row in windows], params)
    logprobs = [e.logprob for out in outs for e in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="final_only")
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """Position by position against the reference (docstring, item 3)."""
    same = prefix = total = identical = 0
    for ref, out in zip(reference, tokens):
        matches = [a == b for a, b in zip(ref, out)]
        same += sum(matches)
        prefix += matches.index(False) if False in matches else len(matches)
        identical += all(matches) and len(ref) == len(out)
        total += len(ref)
    return {"agree": same / total, "prefix": prefix / total, "same": identical, "sequences": len(reference)}


def quality_row(llm: LLM, windows: torch.Tensor, prompts: list[list[int]], args) -> dict:
    started = time.perf_counter()
    ppl, scored = perplexity(llm, windows)
    return {"weight_bytes": weight_bytes(model_of(llm))._asdict(), "kv_bytes_per_token": kv_bytes_per_token(llm),
            "perplexity": ppl, "tokens_scored": scored, "tokens": greedy(llm, prompts, args.greedy_tokens),
            "seconds": time.perf_counter() - started}


def quality_section(args: argparse.Namespace) -> dict:
    heldout = fixtures.heldout_windows(512, args.ppl_windows or None)
    print(f"  held-out text: {heldout.source}", flush=True)
    prompts = [row[:64].tolist() for row in fixtures.heldout_windows(64, args.greedy_prompts).windows]
    rows: dict[str, dict] = {}
    for variant in weight_variants(args.group_size) + KV_VARIANTS:
        llm = make_llm(None, variant, args)
        try:
            rows[variant.label] = {"error": llm} if isinstance(llm, str) else \
                quality_row(llm, heldout.windows, prompts, args)
        except Exception as exc:  # noqa: BLE001 - reported in the output, per variant
            rows[variant.label] = {"error": failure(exc)}
        print_quality_row(variant.label, rows[variant.label])
        del llm
        gc.collect()
    add_ratios(rows)
    return {"heldout": heldout.source, "windows": len(heldout.windows), "window_tokens": 512,
            "greedy_prompts": len(prompts), "rows": rows}


def add_ratios(rows: dict[str, dict]) -> None:
    base = rows.get("bf16", {})
    if "error" in base or not base:
        return
    for row in rows.values():
        if "error" in row:
            continue
        row["weight_ratio"] = row["weight_bytes"]["total"] / base["weight_bytes"]["total"]
        row["layers_ratio"] = layer_bytes(row["weight_bytes"]) / layer_bytes(base["weight_bytes"])
        row["kv_ratio"] = row["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        row["ppl_ratio"] = row["perplexity"] / base["perplexity"]
        row["agreement"] = agreement(base["tokens"], row["tokens"])


def print_quality_row(label: str, row: dict) -> None:
    if "error" in row:
        print(f"  {label:<15} not measured: {row['error']}", flush=True)
        return
    print(f"  {label:<15} weights {row['weight_bytes']['total'] / 1e6:7.2f} MB, KV {row['kv_bytes_per_token']:7.1f} "
          f"B/token, perplexity {row['perplexity']:.4f} over {row['tokens_scored']} tokens "
          f"({row['seconds']:.0f} s)", flush=True)


def report_quality(q: dict) -> None:
    print(f"\n[bytes, perplexity, agreement] bundled model, bfloat16; perplexity over {q['windows']} held-out windows "
          f"of {q['window_tokens']} tokens; greedy agreement over {q['greedy_prompts']} prompts")
    print("ratio: to bf16's; layers: weight bytes without the embedding (tied lm_head), bf16 unless +vocab")
    print(f"{'scheme':<15} {'weights MB':>10} {'ratio':>6} {'layers':>6} {'KV B/tok':>9} {'ratio':>6} "
          f"{'perplexity':>10} {'ratio':>7} {'agree':>6} {'prefix':>6} {'same':>6}")
    for label, row in q["rows"].items():
        if "error" in row or "ppl_ratio" not in row:
            print(f"{label:<15} not measured: {row.get('error', 'no bf16 baseline')}")
            continue
        a = row["agreement"]
        print(f"{label:<15} {row['weight_bytes']['total'] / 1e6:10.2f} {row['weight_ratio']:5.3f}x "
              f"{row['layers_ratio']:5.3f}x {row['kv_bytes_per_token']:9.1f} {row['kv_ratio']:5.3f}x "
              f"{row['perplexity']:10.4f} {row['ppl_ratio']:6.4f}x {a['agree']:6.1%} {a['prefix']:6.1%} "
              f"{a['same']:>3}/{a['sequences']}")


# ---- 4: decode speed on memory-bound random models -------------------------------------------------------------

_request_ids = itertools.count()


def decode_tok_s(llm: LLM, batch: int, steps: int, max_s: float, rng: random.Random) -> float:
    """Decode tokens/s of `batch` fresh prompts: the prefill step runs first, untimed; then `steps` decode steps, or
    fewer (at least MIN_STEPS) once `max_s` seconds have passed (a slow scheme cannot hold the run up); the requests
    are then aborted."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, output_kind="final_only")
    ids = [f"decode-{next(_request_ids)}" for _ in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(8, TOKENIZER_IDS) for _ in range(PROMPT_LEN)], params)
    assert batch * PROMPT_LEN <= llm.args.max_num_batched_tokens, "every prefill must fit the first step"
    engine.step()                                    # every prompt's prefill and first token
    started, done, outputs = time.perf_counter(), 0, []
    while done < steps and (done < MIN_STEPS or time.perf_counter() - started < max_s):
        outputs = engine.step()
        done += 1
    elapsed = time.perf_counter() - started
    # NOTE: with FINAL_ONLY outputs a step returns only finished requests: all `batch` finish in step `steps`
    # exactly when every step decoded every request (max_tokens = steps + 1 with the prefill's token).
    assert done < steps or sum(o.finished for o in outputs) == batch, "every request decodes in every step"
    for request_id in ids:
        engine.abort(request_id)
    assert not engine.has_unfinished()
    return batch * done / elapsed


def load_shape(shape: fixtures.Shape, args, scratch: Path) -> tuple[dict[str, LLM], dict[str, str]]:
    path = str(fixtures.write_random_checkpoint(scratch / shape.name, shape))
    blocks = max(BATCHES) * -(-(PROMPT_LEN + args.decode_steps + 2) // 16) + 8
    llms, errors = {}, {}
    for variant in weight_variants(args.group_size):
        started = time.perf_counter()
        llm = make_llm(path, variant, args, num_blocks=blocks, max_num_seqs=max(BATCHES), max_model_len=256)
        if isinstance(llm, str):
            errors[variant.label] = llm
            print(f"  {shape.name} {variant.label}: not measured: {llm}", flush=True)
        else:
            llms[variant.label] = llm
            print(f"  {shape.name} {variant.label}: loaded in {time.perf_counter() - started:.1f} s", flush=True)
    return llms, errors


def decode_rounds(llms: dict[str, LLM], errors: dict[str, str],
                  args) -> tuple[dict[str, dict[int, list[float]]], list[float]]:
    rng = random.Random(0)
    for label, llm in list(llms.items()):           # warm-up: first-call costs are nobody's
        try:
            for batch in BATCHES:
                decode_tok_s(llm, batch, 1, args.sample_s, rng)
        except Exception as exc:  # noqa: BLE001 - the scheme is reported as failed, the others still run
            errors[label] = failure(exc)
            print(f"  {label}: failed: {errors[label]}", flush=True)
            del llms[label]
    labels = list(llms)
    samples = {label: {b: [] for b in BATCHES} for label in labels}
    bandwidths = []
    for r in range(args.rounds if labels else 0):
        bandwidths.append(copy_bandwidth(repeats=3))
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            for batch in BATCHES:
                samples[label][batch].append(decode_tok_s(llms[label], batch, args.decode_steps, args.sample_s, rng))
    return samples, bandwidths


def decode_shape(shape: fixtures.Shape, args, scratch: Path) -> dict:
    started = time.perf_counter()
    llms, errors = load_shape(shape, args, scratch)
    out = {"shape": shape._asdict(), "errors": errors, "rows": {}}
    spec = next(iter(llms.values())).engine.runner.spec if llms else None
    wbs = {label: weight_bytes(model_of(llm)) for label, llm in llms.items()}
    samples, bandwidths = decode_rounds(llms, errors, args)      # drops the schemes that fail from `llms`
    if llms:
        bandwidth = statistics.median(bandwidths)
        out["rows"] = {label: speed_row(wbs[label], samples[label], spec, bandwidth) for label in llms}
        out.update(copy_bandwidth_bytes_s=bandwidth, bandwidth_samples=bandwidths)
        add_speed_ratios(out["rows"])
    llms.clear()
    gc.collect()
    return {**out, "seconds": time.perf_counter() - started}


def speed_row(wb: WeightBytes, samples: dict[int, list[float]], spec, bandwidth: float) -> dict:
    row = {"weight_bytes": wb._asdict(), "samples_tok_s": samples}
    for batch in BATCHES:
        tok_s, read = statistics.median(samples[batch]), step_bytes(wb, spec, batch)
        bound = batch * bandwidth / read
        row[f"b{batch}"] = {"tok_s": tok_s, "step_bytes": read, "bound_tok_s": bound, "of_bound": tok_s / bound}
    return row


def add_speed_ratios(rows: dict[str, dict]) -> None:
    """Ratios to bf16: weight bytes (all, and the quantizable layers alone: without embedding and lm_head, which
    every scheme keeps in bf16) and tokens/s at each batch."""
    base = rows.get("bf16")
    if base is None:
        return
    for row in rows.values():
        row["weight_ratio"] = row["weight_bytes"]["total"] / base["weight_bytes"]["total"]
        row["layers_ratio"] = layer_bytes(row["weight_bytes"]) / layer_bytes(base["weight_bytes"])
        for batch in BATCHES:
            row[f"b{batch}"]["vs_bf16"] = row[f"b{batch}"]["tok_s"] / base[f"b{batch}"]["tok_s"]


def report_decode(d: dict, args) -> None:
    s = d["shape"]
    mlp = f"{s['experts']} experts of {s['intermediate']} (top {s['top_k']})" if s["experts"] else \
        f"MLP {s['intermediate']}"
    print(f"\n[decode] {s['name']}: random weights, {s['layers']} layers, hidden {s['hidden']}, {mlp}, vocab "
          f"{s['vocab']}; up to {args.decode_steps} decode steps ({args.sample_s:g} s) after a {PROMPT_LEN}-token "
          f"prompt, medians of {args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s), "
          f"{'compiled' if args.compiled else 'eager'}")
    for label, error in d["errors"].items():
        print(f"{label:<15} not measured: {error}")
    if not d["rows"] or "weight_ratio" not in next(iter(d["rows"].values())):
        return
    print("ratio: weight bytes / bf16's; layers: the same without the embedding and lm_head (kept in bf16)")
    print(f"copy bandwidth {d['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s (read + written, median of "
          f"{len(d['bandwidth_samples'])})")
    print(f"{'scheme':<15} {'weights MB':>10} {'ratio':>6} {'layers':>6} | " + " | ".join(
        f"{'b' + str(b) + ' tok/s':>10} {'vs bf16':>7} {'MB/step':>8} {'bound':>8} {'of bound':>8}" for b in BATCHES))
    for label, row in d["rows"].items():
        cells = []
        for batch in BATCHES:
            c = row[f"b{batch}"]
            cells.append(f"{c['tok_s']:10.1f} {c['vs_bf16']:6.2f}x {c['step_bytes'] / 1e6:8.1f} "
                         f"{c['bound_tok_s']:8.1f} {c['of_bound']:8.1%}")
        print(f"{label:<15} {row['weight_bytes']['total'] / 1e6:10.1f} {row['weight_ratio']:5.3f}x "
              f"{row['layers_ratio']:5.3f}x | "
              + " | ".join(cells))


# ---- 5: disaggregated TTFT, fp8 KV against bf16 KV, over tcp ----------------------------------------------------

KV_SIDES = {"bf16": "auto", "fp8": "fp8"}


def serving(kv_cache_dtype: str, threads: int, log_path: Path):
    """Router + 1 prefill + 1 decode worker on free ports, bundled model in bfloat16, KV over tcp."""
    dtype = ("--dtype", "bfloat16")   # the router too: the model dtype is part of the block namespace
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, transfer="tcp", enforce_eager=True,
                         kv_cache_dtype=kv_cache_dtype, disk_tier=False, worker_args=dtype, router_args=dtype)
    return ttft_tiers.serving(config, {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}, log_path)


def timed_request(client: StrataClient, prompt: list[int]) -> dict:
    """TTFT and time to the second token at the client, and how the decode worker got the prompt's KV."""
    started, stamps, last = time.perf_counter(), [], None
    for chunk in client.stream(prompt, max_tokens=2, ignore_eos=True, include_metrics=True):
        stamps += [time.perf_counter() - started] * len(chunk.token_ids)
        last = chunk
    m = last.metrics
    return {"ttft_ms": stamps[0] * 1e3, "tt2t_ms": stamps[1] * 1e3, "transfer_ms": m.timings.transfer_ms,
            "disaggregated": m.disaggregated, "blocks_transferred": m.blocks_transferred,
            "blocks_recomputed": m.blocks_recomputed, "blocks_from_store": m.blocks_from_store}


def encoded_block_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one encoded block as the prefill worker exports it (header, token ids, scales, payload): the length
    of each `BlockLocation` the decode worker reads (worker_common/kv_blocks.py `slot_bytes`)."""
    spec = load_checkpoint(resolve_model(None)).spec
    layout = codec.BlockLayout(spec.num_layers, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    dtype = kv_storage_dtype(kv_cache_dtype, "bfloat16")
    return codec.encoded_size(layout.payload_bytes(dtype), layout.scale_bytes(dtype), BLOCK_SIZE)


def ttft_rounds(clients: dict[str, StrataClient], args) -> dict[str, list[dict]]:
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(8, TOKENIZER_IDS) for _ in range(args.ttft_prompt)]

    for client in clients.values():
        timed_request(client, prompt())               # warm-up: first-request costs are nobody's
    samples: dict[str, list[dict]] = {side: [] for side in clients}
    for r in range(args.ttft_rounds):
        for side in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
            samples[side].append(timed_request(clients[side], prompt()))
    return samples


def ttft_section(args: argparse.Namespace) -> dict:
    print(f"[ttft] starting two clusters (bf16 KV, fp8 KV), {args.ttft_prompt}-token prompts", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="quant-bench-serve-") as scratch, ExitStack() as stack:
            clients = {side: stack.enter_context(serving(kv, args.threads, Path(scratch) / f"{side}.log"))
                       for side, kv in KV_SIDES.items()}
            samples = ttft_rounds(clients, args)
    except Exception as exc:  # noqa: BLE001 - reported: the rest of the benchmark still stands
        out = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
        print(f"\n[ttft] not measured: {out['error']}")
        return out
    out = {"prompt_tokens": args.ttft_prompt, "rounds": args.ttft_rounds, "sides": {}}
    block_bytes = {side: encoded_block_bytes(kv) for side, kv in KV_SIDES.items()}
    for side, runs in samples.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_ms", "tt2t_ms", "transfer_ms")}
        blocks = statistics.median(r["blocks_transferred"] for r in runs)
        out["sides"][side] = {**med, "blocks_transferred": blocks, "encoded_block_bytes": block_bytes[side],
                              "bytes_moved": blocks * block_bytes[side], "samples": runs,
                              "all_disaggregated": all(r["disaggregated"] for r in runs)}
    b, f = out["sides"]["bf16"], out["sides"]["fp8"]
    out["fp8_over_bf16"] = {k: f[k] / b[k] if b[k] else None for k in ("ttft_ms", "tt2t_ms", "bytes_moved")}
    report_ttft(out)
    return out


def report_ttft(t: dict) -> None:
    s = t["sides"]
    print(f"\n[ttft] disaggregated, --transfer tcp, bundled model in bfloat16, {t['prompt_tokens']}-token prompts, "
          f"medians of {t['rounds']} interleaved rounds")
    print(f"{'KV':<6} {'TTFT ms':>9} {'TT2T ms':>9} {'pull ms':>8} {'blocks':>7} {'B/block':>8} {'MB moved':>9}  "
          f"disaggregated")
    for side, m in s.items():
        print(f"{side:<6} {m['ttft_ms']:9.1f} {m['tt2t_ms']:9.1f} {m['transfer_ms']:8.1f} "
              f"{m['blocks_transferred']:7.0f} {m['encoded_block_bytes']:8d} {m['bytes_moved'] / 1e6:9.3f}  "
              f"{m['all_disaggregated']}")
    print("fp8 / bf16: " + ", ".join(f"{k} {v:.3f}x" if v is not None else f"{k} -"
                                     for k, v in t["fp8_over_bf16"].items()))


# ---- main ------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128), help="int4 group size")
    parser.add_argument("--ppl-windows", type=int, default=64, help="held-out 512-token windows (0 = all 342)")
    parser.add_argument("--greedy-prompts", type=int, default=16)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per sample (at most)")
    parser.add_argument("--sample-s", type=float, default=3.0,
                        help=f"a sample stops after this many seconds (and at least {MIN_STEPS} steps)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the docstring)")
    parser.add_argument("--compiled", action="store_true", help="the compiled decode step (default: eager)")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes (comma-separated; 1 is needed for "
                                                          "the targets)")
    parser.add_argument("--shapes", default="dense,moe", help="decode shapes: dense, moe or both")
    parser.add_argument("--ttft-prompt", type=int, default=1984, help="prompt tokens of the TTFT requests")
    parser.add_argument("--ttft-rounds", type=int, default=7, help="TTFT rounds (one request per KV dtype each)")
    parser.add_argument("--quick", action="store_true", help="toy shapes, one round (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    parser.add_argument("--plot", default="", help="save bar charts of the ratios to this file (matplotlib)")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"--parts must be a subset of {PARTS}, got {sorted(unknown)}")
    if args.quick:
        args.ppl_windows, args.greedy_prompts, args.greedy_tokens = 2, 4, 8
        args.decode_steps, args.rounds, args.ttft_prompt, args.ttft_rounds = 4, 1, 256, 1
    args.batches = tuple(sorted({int(b) for b in args.batches.split(",") if b}))
    args.shapes = [s for s in args.shapes.split(",") if s]
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches must be positive integers, got {args.batches}")
    if unknown := set(args.shapes) - {"dense", "moe"}:
        parser.error(f"--shapes must be a subset of dense,moe, got {sorted(unknown)}")
    for name in ("rounds", "decode_steps", "ttft_rounds", "ttft_prompt"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    global BATCHES
    args = parse_args(argv)
    BATCHES = args.batches
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result: dict = {"benchmark": "quant_bench", "threads": torch.get_num_threads(), "group_size": args.group_size,
                    "compiled": args.compiled, "quick": args.quick}
    if "quality" in args.parts:
        print("[quality] bundled model, one scheme at a time", flush=True)
        result["quality"] = quality_section(args)
        report_quality(result["quality"])
    if "decode" in args.parts:
        shapes = {"dense": fixtures.DENSE_TOY if args.quick else fixtures.DENSE_06B,
                  "moe": fixtures.MOE_TOY if args.quick else fixtures.MOE_1B}
        shapes = {key: shape for key, shape in shapes.items() if key in args.shapes}
        result["decode"] = {}
        with tempfile.TemporaryDirectory(prefix="quant-bench-") as scratch:
            for key, shape in shapes.items():
                print(f"[decode] {shape.name}: writing a random checkpoint, loading every scheme", flush=True)
                result["decode"][key] = decode_shape(shape, args, Path(scratch))
                report_decode(result["decode"][key], args)
    if "ttft" in args.parts:
        result["ttft"] = ttft_section(args)
    rows = targets(result, args.group_size, [v.label for v in weight_variants(args.group_size)])
    report_targets(rows)
    result["targets"] = [t._asdict() for t in rows]
    result["seconds"] = time.perf_counter() - started
    print(f"\ntotal {result['seconds']:.0f} s")
    if args.plot:
        plot(result, args.plot)
    if args.json:
        for row in (lookup(result, "quality", "rows") or {}).values():
            row.pop("tokens", None)
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
