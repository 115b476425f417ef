"""What a migrated request costs (issue 15 item 3): resuming after k tokens vs rerunning the request from its start.

When a decode worker dies mid-stream, the router hands the request to another decode worker with the tokens the
client already has (`WorkerGenerateRequest.resume_output_ids`): that worker computes prompt + those k tokens in one
prefill and samples on. The baseline is what the router did before: rerun the whole request with the same seed on
the other worker and drop the first k tokens (k decode steps to get back to where the client was). Both give the
same tokens (seeded sampling is keyed by output position; counted and printed); this measures the client's wait
for its next token.

One real decode worker process (bundled model), sampled requests (temperature 0.8, a seed each), interleaved rounds,
medians, per k:

    python benchmarks/migration_bench.py                 # k = 16, 64, 256; 5 rounds
    python benchmarks/migration_bench.py --quick --json  # CI smoke run
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import SamplingParams  # noqa: E402
from strata.paths import resolve_model  # noqa: E402
from strata.v1 import worker_pb2  # noqa: E402
from worker_common.convert import sampling_to_proto  # noqa: E402
from worker_common.launch import WorkerProcess  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or bundled name (default: the bundled model)")
    p.add_argument("--ks", default="16,64,256", help="tokens the client has when the worker dies")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="k = 8, 2 rounds (CI smoke run)")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    args = p.parse_args(argv)
    if args.quick:
        args.ks, args.rounds, args.prompt_tokens = "8", 2, 32
    args.ks = [int(k) for k in args.ks.split(",")]
    return args


class Bench:
    """`first` serves the undisturbed runs (the worker that died); `second` takes over, never having seen the
    prompt (no prefix cache: the prompt and the k tokens are computed there, the costlier case; with a store tier
    holding the prompt's blocks a resume is cheaper still)."""

    def __init__(self, first: WorkerProcess, second: WorkerProcess, args: argparse.Namespace) -> None:
        self.first, self.second, self.args, self.rng, self.n = first, second, args, random.Random(5), 0
        self.checked = self.equal = 0

    def request(self, k: int) -> tuple[list[int], SamplingParams, list[int]]:
        """A fresh prompt, its params, and the k + 1 tokens of an undisturbed run on `first` (the client had the
        first k when that worker died)."""
        prompt = [self.rng.randrange(10, 4000) for _ in range(self.args.prompt_tokens)]
        params = SamplingParams(max_tokens=k + 1, temperature=0.8, seed=self.rng.randrange(2**31), ignore_eos=True)
        tokens, _ = self.stream(self.first, prompt, params, [], k + 1)
        return prompt, params, tokens[:k + 1]

    def stream(self, worker: WorkerProcess, prompt: list[int], params: SamplingParams, resume: list[int],
               until: int) -> tuple[list[int], float]:
        """Tokens of a Generate call until it has `until` of them, and the seconds that took."""
        self.n += 1
        started, tokens = time.perf_counter(), list(resume)
        call = worker.stub().Generate(worker_pb2.WorkerGenerateRequest(
            request_id=f"m{self.n}", token_ids=prompt, sampling=sampling_to_proto(params),
            resume_output_ids=resume, skip_text=True), timeout=600)
        for chunk in call:
            tokens += chunk.token_ids
            if len(tokens) >= until:
                break
        seconds = time.perf_counter() - started
        call.cancel()
        wait_idle(worker)  # NOTE: the next request runs alone, not batched beside this one's abort
        return tokens, seconds

    def resumed(self, k: int) -> float:
        prompt, params, want = self.request(k)
        tokens, seconds = self.stream(self.second, prompt, params, want[:k], k + 1)
        self.checked += 1
        self.equal += tokens[:k + 1] == want    # the next token is the undisturbed run's
        return seconds

    def rerun(self, k: int) -> float:
        prompt, params, _ = self.request(k)
        _, seconds = self.stream(self.second, prompt, params, [], k + 1)
        return seconds


def wait_idle(worker: WorkerProcess) -> None:
    while True:
        load = worker.stub().Stats(worker_pb2.StatsRequest(), timeout=30).load
        if load.running + load.waiting == 0:
            return
        time.sleep(0.002)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = ["--model", resolve_model(args.model), "--enforce-eager", "--num-blocks", "1024"]
    first, second = WorkerProcess("decode", flags, wait=False), WorkerProcess("decode", flags, wait=False)
    try:
        first.wait_ready()
        second.wait_ready()
        bench = Bench(first, second, args)
        bench.resumed(args.ks[0])                               # warm-up
        samples = {k: {"resumed": [], "rerun": []} for k in args.ks}
        for round_ in range(args.rounds):
            for k in args.ks:
                order = ("resumed", "rerun") if round_ % 2 == 0 else ("rerun", "resumed")
                for how in order:
                    samples[k][how].append(getattr(bench, how)(k))
    finally:
        first.stop()
        second.stop()
    summary = {}
    print(f"time to the first token after the k the client has ({args.prompt_tokens}-token prompts, "
          f"{args.rounds} rounds, medians):")
    for k, s in samples.items():
        resumed, rerun = statistics.median(s["resumed"]), statistics.median(s["rerun"])
        summary[k] = {"resumed_ms": resumed * 1e3, "rerun_ms": rerun * 1e3, "speedup": rerun / resumed}
        print(f"  k={k:<4} resumed {resumed * 1e3:8.1f} ms   rerun from the start {rerun * 1e3:8.1f} ms   "
              f"({rerun / resumed:.2f}× faster resumed)")
    print(f"resumed runs whose tokens equal an undisturbed run's: {bench.equal} of {bench.checked}")
    if args.json:
        print(json.dumps({"ks": summary, "token_exact": [bench.equal, bench.checked]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
