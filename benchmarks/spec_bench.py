"""Speculative decoding: output tokens per second of the same engine with and without speculation, measured in the
same run, per drafter, batch size and temperature; and tokens per target forward.

Workloads (the bundled target was trained on the Python 3.11 standard library; these files were held out):
- `heldout`: windows of `--prompt-len` tokens from the held-out stdlib files (models/recipe/heldout_files.txt, read
  from this interpreter's stdlib), each continued for `--output-len` tokens;
- `edit` (ngram only): a code-editing prompt that holds most of the expected output: a held-out snippet, a short
  instruction, and the start of the snippet again, continued for `--output-len` tokens.

Fair by construction:
- the baseline is the same engine (`LLM`, same dtype, compiled unless `--eager`) without speculation; both are
  built and warmed (compiled) before anything is timed;
- each configuration runs `--rounds` interleaved rounds, in alternating order (plain first, then speculative
  first), each round on prompt windows neither engine has seen (no prefix-cache hit, no cached answer);
- EOS is ignored: every request generates exactly `--output-len` tokens; at temperature > 0 requests are seeded;
- figures are medians over the rounds, ratios are ratios of the medians.

Reported per configuration: the speed-up (speculative / plain output tokens per second of the decode phase, from the
step that gave every request its first token; `e2e`: the same over the whole run, prefill included), the mean
accepted length (tokens
a speculating request gains per target forward: accepted drafts + 1), the acceptance rate, the share of decode
steps that speculated (adaptive length may turn it off), and the cost of a verify step against a plain one
(ms per step over the decode phase, which bounds the speed-up: at most accepted length x plain step / verify step;
the JSON also holds the whole run's verify average, which counts steps that verify beside other requests' prefill).

    OMP_NUM_THREADS=1 python benchmarks/spec_bench.py                       # every drafter, batch 1/8/32, T 0/0.7
    python benchmarks/spec_bench.py --drafters ngram --batches 1 --workloads edit
    python benchmarks/spec_bench.py --state-cost 1024                      # drafter state on a decode worker
    python benchmarks/spec_bench.py --device cuda --batches 1,32          # on a GPU
    python benchmarks/spec_bench.py --quick --json                          # CI smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.batch import ScheduledSeq, StepBatch  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from strata.llm import LLM  # noqa: E402
from strata.paths import REPO_ROOT, bundled_model  # noqa: E402

EDIT_INSTRUCTION = "\n\n# The same code as above, with comments kept:\n"


class Corpus:
    """Token windows of the held-out files, handed out once each (a window is never reused across rounds)."""

    def __init__(self, tokenizer, prompt_len: int, output_len: int) -> None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        names = (REPO_ROOT / "models" / "recipe" / "heldout_files.txt").read_text().split()
        self.windows: list[list[int]] = []
        self.tokenizer = tokenizer
        step = prompt_len + output_len
        for name in names:
            path = stdlib / name
            if not path.is_file():
                continue
            ids = _ids(tokenizer.encode(path.read_text(errors="replace")))
            self.windows.extend(ids[i:i + step] for i in range(0, len(ids) - step + 1, step))
        if not self.windows:
            raise SystemExit(f"no held-out stdlib files of at least {step} tokens under {stdlib}")
        self.prompt_len, self._next = prompt_len, 0

    def take(self, count: int, workload: str) -> list[list[int]]:
        out = []
        for _ in range(count):
            window = self.windows[self._next % len(self.windows)]
            self._next += 1
            out.append(window[:self.prompt_len] if workload == "heldout" else self._edit(window))
        return out

    def _edit(self, window: list[int]) -> list[int]:
        """snippet + instruction + the snippet's first tenth: the expected continuation is mostly in the prompt."""
        snippet = window[:self.prompt_len]
        return snippet + _ids(self.tokenizer.encode(EDIT_INSTRUCTION)) + snippet[:max(1, len(snippet) // 10)]


def _ids(encoded) -> list[int]:
    return list(encoded.ids if hasattr(encoded, "ids") else encoded)


def params_for(batch: int, temperature: float, output_len: int, round_index: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature, output_kind="final_only",
                           seed=None if temperature == 0 else 1000 * round_index + i) for i in range(batch)]


class Timing(NamedTuple):
    seconds: float                 # end to end: the prompts' prefill and every output
    decode_seconds: float          # from the step that gave every request its first token to the end
    tokens: list[list[int]]
    stats_at_first: dict           # the speculation counters at that step ({} without speculation)


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Timing:
    """Run the batch on the engine's own loop, noting when every request has its first token (prefill is the same
    work with or without speculation: the decode phase is what speculation changes)."""
    engine, tag = llm.engine, f"bench-{time.perf_counter_ns()}"
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start, first, at_first = time.perf_counter(), None, {}
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
        if first is None and all(rid in final or (r := engine.scheduler.get_request(rid)) is not None
                                 and r.num_output_tokens > 0 for rid in ids):
            first = time.perf_counter()
            at_first = engine.speculation.stats.as_dict() if engine.speculation else {}
    end = time.perf_counter()
    tokens = [final[rid] for rid in ids]
    assert sum(map(len, tokens)) == sum(p.max_tokens for p in params), "every request generates output_len tokens"
    return Timing(end - start, end - (first or start), tokens, at_first)


def stats_delta(llm: LLM, before: dict) -> dict:
    now = llm.engine.speculation.stats.as_dict()
    return {k: now[k] - before.get(k, 0) for k in now if isinstance(now[k], (int, float))}


def measure(plain: LLM, spec: LLM, corpus: Corpus, workload: str, batch: int, temperature: float,
            args: argparse.Namespace) -> dict:
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    decode_rates: dict[str, list[float]] = {"plain": [], "spec": []}
    counters: list[dict] = []           # the speculative engine's, per round: the whole run
    decode_counters: list[dict] = []    # the same from the step that gave every request its first token
    same = 0
    for r in range(args.rounds):
        prompts = corpus.take(batch, workload)
        params = params_for(batch, temperature, args.output_len, r)
        order = [("plain", plain), ("spec", spec)] if r % 2 == 0 else [("spec", spec), ("plain", plain)]
        outputs = {}
        for name, llm in order:
            before = llm.engine.speculation.stats.as_dict() if name == "spec" else {}
            timing = timed(llm, prompts, params)
            outputs[name] = timing.tokens
            produced = sum(map(len, timing.tokens))
            rates[name].append(produced / timing.seconds)
            decode_rates[name].append((produced - batch) / timing.decode_seconds)
            if name == "spec":
                counters.append(stats_delta(llm, before))
                decode_counters.append(stats_delta(llm, timing.stats_at_first or before))
        same += sum(a == b for a, b in zip(outputs["plain"], outputs["spec"]))
    total = {k: sum(c[k] for c in counters) for k in counters[0]}
    # NOTE: step costs over the decode phase only: a step that verifies while other requests still prefill is
    # mostly prefill (at batch 32 on an H200 such steps made the whole-run verify step average 51 ms).
    decode = {k: sum(c[k] for c in decode_counters) for k in decode_counters[0]}
    plain_rate, spec_rate = statistics.median(rates["plain"]), statistics.median(rates["spec"])
    plain_decode, spec_decode = statistics.median(decode_rates["plain"]), statistics.median(decode_rates["spec"])
    steps = total["num_verify_steps"] + total["num_plain_steps"]
    return {
        "plain_decode_tokens_per_s": plain_decode, "spec_decode_tokens_per_s": spec_decode,
        "speedup": spec_decode / plain_decode,
        "plain_tokens_per_s": plain_rate, "spec_tokens_per_s": spec_rate, "speedup_end_to_end": spec_rate / plain_rate,
        "mean_accepted_length": total["num_emitted_tokens"] / total["num_verifies"] if total["num_verifies"] else 0.0,
        "acceptance_rate": total["num_accepted_tokens"] / total["num_draft_tokens"] if total["num_draft_tokens"]
        else 0.0,
        "speculating_step_share": total["num_verify_steps"] / steps if steps else 0.0,
        "verify_step_ms": 1000 * decode["verify_seconds"] / max(1, decode["num_verify_steps"]),
        "plain_step_ms_in_spec_engine": 1000 * decode["plain_seconds"] / max(1, decode["num_plain_steps"]),
        "draft_ms_per_verify_step": 1000 * decode["draft_seconds"] / max(1, decode["num_verify_steps"]),
        "verify_step_ms_whole_run": 1000 * total["verify_seconds"] / max(1, total["num_verify_steps"]),
        # NOTE: greedy, equal tokens are the contract; in bfloat16 the verify and decode paths round differently
        # (as prefill and decode do), so a near-tie may flip. Seeded sampling matches for point-mass drafters.
        "same_tokens_as_plain": same / (batch * args.rounds),
        "rounds": {k: v for k, v in rates.items()}, "decode_rounds": {k: v for k, v in decode_rates.items()},
    }


def build(args: argparse.Namespace, drafter: str | None) -> LLM:
    kwargs = dict(dtype=args.dtype, enforce_eager=args.eager, max_num_seqs=max(args.batches),
                  max_model_len=2048, num_blocks=4096, seed=0, device=args.device)
    if drafter is None:
        return LLM(**kwargs)
    return LLM(speculative=drafter, num_speculative_tokens=args.k, speculative_adaptive=not args.no_adaptive,
               **kwargs)


def state_cost(args: argparse.Namespace) -> dict:
    """What building a drafter's state for a prompt costs on a decode worker (disaggregation): the draft model's
    prefill and the EAGLE head's pass over the prompt against the target's own prefill (medians of 5), and the
    head's acceptance without the target's features for the prompt. A prefix-cache hit stands in for a prompt
    prefilled on another worker: the target then computes only the last block here, so the head reads zeros for
    the rest, exactly as on a decode worker."""
    n = args.state_cost
    kwargs = dict(dtype=args.dtype, enforce_eager=args.eager, max_num_seqs=8, num_blocks=4096, seed=0,
                  device=args.device)
    eagle = LLM(speculative="eagle", speculative_adaptive=False, num_speculative_tokens=4, **kwargs)
    draft = LLM(speculative="draft", speculative_adaptive=False, num_speculative_tokens=4, **kwargs)
    params = SamplingParams(max_tokens=64, ignore_eos=True, output_kind="final_only")
    prompts = Corpus(eagle.tokenizer, n, 64).take(6, "heldout")

    def acceptance(prompt: list[int]) -> float:
        before = stats_delta(eagle, {})
        eagle.generate([prompt], params)
        delta = stats_delta(eagle, before)
        return delta["num_accepted_tokens"] / max(1, delta["num_draft_tokens"])

    with_features = statistics.mean(acceptance(p) for p in prompts)        # first time: every position computed
    without = statistics.mean(acceptance(p) for p in prompts)              # again: the prompt from the cache
    batch = StepBatch([ScheduledSeq("cost", prompts[0], 0, list(range(n // 16 + 1)), 1)])

    def timed_pass(run) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    head = eagle.engine.speculation.drafters["eagle"]
    zeros = torch.zeros(n, eagle.engine.runner.spec.hidden_size, dtype=getattr(torch, args.dtype))
    with torch.inference_mode():
        head_s = timed_pass(lambda: head._forward(batch, zeros))
    draft_runner = draft.engine.speculation.drafters["draft"].runner
    draft_s = timed_pass(lambda: (draft_runner.execute(batch), draft_runner.attention.invalidate()))
    target = eagle.engine.runner
    target_s = timed_pass(lambda: (target.execute(batch), target.attention.invalidate()))
    out = {"prompt_tokens": n, "target_prefill_ms": 1e3 * target_s, "draft_prefill_ms": 1e3 * draft_s,
           "eagle_head_pass_ms": 1e3 * head_s, "eagle_acceptance_with_features": with_features,
           "eagle_acceptance_without_prompt_features": without}
    print(f"prompt {n} tokens: target prefill {out['target_prefill_ms']:.1f} ms; draft model prefill "
          f"{out['draft_prefill_ms']:.1f} ms ({draft_s / target_s:.2f}x); EAGLE head pass {out['eagle_head_pass_ms']:.1f}"
          f" ms ({head_s / target_s:.2f}x); EAGLE acceptance {with_features:.3f} with the target's features of the "
          f"prompt, {without:.3f} without")
    return out


def report(results: list[dict]) -> None:
    print(f"\n{'drafter':8} {'workload':8} {'batch':>5} {'temp':>4} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speed-up':>8} {'e2e':>6} {'acc len':>7} {'acc rate':>8} {'spec steps':>10} {'verify ms':>9} {'draft ms':>8} "
          f"{'same':>5}")
    for r in results:
        m = r["measured"]
        print(f"{r['drafter']:8} {r['workload']:8} {r['batch']:5d} {r['temperature']:4.1f} "
              f"{m['plain_decode_tokens_per_s']:11.1f} {m['spec_decode_tokens_per_s']:10.1f} {m['speedup']:7.2f}x "
              f"{m['speedup_end_to_end']:5.2f}x "
              f"{m['mean_accepted_length']:7.2f} {m['acceptance_rate']:8.2f} {m['speculating_step_share']:10.2f} "
              f"{m['verify_step_ms']:9.2f} {m['draft_ms_per_verify_step']:8.2f} {m['same_tokens_as_plain']:5.2f}")


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed, {path} not written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['drafter']}/{r['workload']}\nB{r['batch']} T{r['temperature']}" for r in results]
    values = [r["measured"]["speedup"] for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels)), 4))
    ax.bar(range(len(values)), values)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("speed-up vs the same engine without speculation")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", default="ngram,draft,eagle")
    p.add_argument("--workloads", default="heldout,edit", help="edit runs for ngram only")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("-k", type=int, default=8, help="num_speculative_tokens (the adaptive length picks <= k)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where both engines run")
    p.add_argument("--eager", action="store_true", help="no compiled decode / verify steps (both engines)")
    p.add_argument("--no-adaptive", action="store_true", help="always propose k tokens")
    p.add_argument("--quick", action="store_true", help="tiny run that checks the benchmark still works")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--plot", default="", help="save a bar chart of the speed-ups to this file")
    p.add_argument("--state-cost", type=int, default=0, metavar="PROMPT_LEN",
                   help="only measure what building the drafters' state for a prompt of this length costs")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.drafters = args.drafters.split(",")
    args.workloads = args.workloads.split(",")
    if args.quick:
        args.drafters, args.workloads, args.batches, args.temperatures = ["ngram", "draft"], ["heldout", "edit"], \
            [2], [0.0, 0.7]
        args.rounds, args.prompt_len, args.output_len, args.eager = 1, 32, 8, True
    if "eagle" in args.drafters and not Path(bundled_model("strata-eagle-tiny")).is_dir():
        print("no models/strata-eagle-tiny: the eagle drafter is skipped")
        args.drafters.remove("eagle")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    if args.state_cost:
        out = state_cost(args)
        if args.json:
            print(json.dumps(out))
        return
    print(f"spec_bench: torch threads {torch.get_num_threads()}, dtype {args.dtype}, "
          f"{'eager' if args.eager else 'compiled'}, k={args.k}, adaptive={not args.no_adaptive}", flush=True)
    plain = build(args, None)
    results = []
    for drafter in args.drafters:
        spec = build(args, drafter)
        corpus = Corpus(spec.tokenizer, args.prompt_len, args.output_len)
        for workload in args.workloads:
            if workload == "edit" and drafter != "ngram":
                continue
            for batch in args.batches:
                for temperature in args.temperatures:
                    measured = measure(plain, spec, corpus, workload, batch, temperature, args)
                    results.append({"drafter": drafter, "workload": workload, "batch": batch,
                                    "temperature": temperature, "measured": measured})
                    print(f"{drafter} {workload} batch {batch} T {temperature}: {measured['speedup']:.2f}x, "
                          f"accepted length {measured['mean_accepted_length']:.2f}", flush=True)
        del spec
    report(results)
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps({"args": {k: v for k, v in vars(args).items()}, "results": results}))


if __name__ == "__main__":
    main()
