"""Can one tenant learn another's prompts from timing? (issue 15: "Tenant A never hits tenant B's cached prefix (a
timing probe shows no difference)").

One `strata serve` with API keys for two tenants, alice and bob (loopback only). Per round, alice sends a fresh long
prompt P; then, in a shuffled order: alice sends P again (her own cache hit: the signal a leak would show), bob sends
P (the probe: would he hit alice's blocks?) and bob sends a fresh prompt Q of the same length (the control: a cold
prompt). Time to first token is taken on the client, over gRPC.

Printed: the medians, `probe ÷ control` (≈ 1.00: bob learns nothing) next to `hit ÷ control` (what a leak would
look like), and how many of bob's probes the workers reported as cached tokens (must be 0).

    python benchmarks/tenant_probe.py                 # 8 rounds, 1,024-token prompts
    python benchmarks/tenant_probe.py --quick --json  # CI smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.client import StrataClient  # noqa: E402
from strata.launcher import LocalLauncher, ServeConfig  # noqa: E402

KINDS = ("hit", "probe", "control")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or bundled name (default: the bundled model)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="2 rounds of 256-token prompts (CI smoke run)")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.prompt_tokens = 2, 256
    return args


def fresh_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def ttft(client: StrataClient, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens the last chunk reports)."""
    started, first, cached = time.perf_counter(), None, 0
    for chunk in client.stream(prompt, max_tokens=2, ignore_eos=True, include_metrics=True):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_tokens
    return first or 0.0, cached


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(11)
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    cached: dict[str, list[int]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys.txt"
        keys.write_text("alice:sk-alice-probe\nbob:sk-bob-probe\n")
        os.chmod(keys, 0o600)
        config = ServeConfig(model=args.model, grpc_port=0, http_port=-1, enforce_eager=True, data_dir=scratch,
                             api_keys_file=str(keys))
        with open(Path(scratch) / "cluster.log", "w") as log, LocalLauncher(config, log=log) as launcher:
            address = launcher.info.grpc_address
            with StrataClient(address, timeout_s=300, api_key="sk-alice-probe") as alice, \
                    StrataClient(address, timeout_s=300, api_key="sk-bob-probe") as bob:
                ttft(alice, fresh_prompt(rng, args.prompt_tokens))       # warm-up: first-request costs
                ttft(bob, fresh_prompt(rng, args.prompt_tokens))
                for _ in range(args.rounds):
                    secret = fresh_prompt(rng, args.prompt_tokens)
                    ttft(alice, secret)
                    runs = [("hit", alice, secret), ("probe", bob, secret),
                            ("control", bob, fresh_prompt(rng, args.prompt_tokens))]
                    rng.shuffle(runs)
                    for kind, client, prompt in runs:
                        seconds, hit = ttft(client, prompt)
                        samples[kind].append(seconds)
                        cached[kind].append(hit)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    summary = {"rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
               "ttft_ms_median": {k: v * 1e3 for k, v in medians.items()},
               "probe_over_control": medians["probe"] / medians["control"],
               "hit_over_control": medians["hit"] / medians["control"],
               "probe_cached_tokens": sum(cached["probe"]), "hit_cached_tokens": sum(cached["hit"])}
    print(f"{args.rounds} rounds, {args.prompt_tokens}-token prompts; median time to first token:")
    for kind in KINDS:
        print(f"  {kind:<8} {medians[kind] * 1e3:8.1f} ms   (range {min(samples[kind]) * 1e3:.1f} to "
              f"{max(samples[kind]) * 1e3:.1f})")
    print(f"bob probing alice's prompt ÷ bob's cold control: {summary['probe_over_control']:.2f}× "
          f"(a leak would look like alice's own hit: {summary['hit_over_control']:.2f}×)")
    print(f"cached tokens reported: bob's probes {summary['probe_cached_tokens']}, "
          f"alice's hits {summary['hit_cached_tokens']}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
