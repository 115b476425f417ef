"""Time to first token when a prompt's prefix is held in each tier, against recomputing it (cold), on `strata serve`.

One `strata serve` (router + prefill + decode worker processes) with every tier configured: host, disk, a real
`redis-server` and moto's S3 server, all started here on free loopback ports. Per round and per condition, a fresh
random prefix (`--prefix-tokens`, default 1,984 = 124 blocks) is computed once by a warm request, the background
writes are waited for, and every tier but the condition's is flushed; then a request with the
same prefix and `--new-tokens` new tokens is timed over gRPC (first token on the client). "Prefix in host" means in
host only: every other tier, the device cache included, is flushed on every worker (shared tiers once). A second
`strata serve` with host and disk only runs beside it, for the reference of a host hit when no shared tier is
configured.

Conditions run in a different order each round (interleaved); the table shows medians, `cold ÷ this`, and the
onboarding breakdown the serving worker reports (lookup, read, verify, install, then the computation of the new
tokens, and the serving path around it: router, RPCs, queue, each shown apart below the table), next to the bound:
the prefix's bytes ÷ the tier's raw read bandwidth measured in this run (a memcpy for host, a read of the same
bytes from files for disk, one pipelined GET for Redis, one GET of one object for S3).

    python benchmarks/ttft_tiers.py                        # 3 rounds, 1,984 cached + 63 new tokens
    python benchmarks/ttft_tiers.py --rounds 5 --plot ttft_tiers.png
    python benchmarks/ttft_tiers.py --new-tokens 60 --max-tokens 4   # the request goes on: its KV goes to decode
    python benchmarks/ttft_tiers.py --quick --json         # CI smoke run
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
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.client import StrataClient  # noqa: E402
from strata.devservers import RedisServer, S3Server  # noqa: E402
from strata.launcher import LocalLauncher, ServeConfig  # noqa: E402
from strata.paths import resolve_model  # noqa: E402

CONDITIONS = ("cold", "device", "host", "disk", "redis", "s3")
TIERS = ("device", "host", "disk", "redis", "s3")
SETTLE_S = 0.5
BREAKDOWN = ("lookup", "read", "verify", "install", "compute", "serving")
SERVING_PARTS = ("queue", "router", "rest")   # of "serving": the worker's engine queue, client <-> router, the rest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or bundled name (default: the bundled model)")
    parser.add_argument("--prefix-tokens", type=int, default=1984, help="cached prefix (a multiple of 16)")
    parser.add_argument("--new-tokens", type=int, default=63, help="uncached tokens after the prefix")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=1,
                        help="tokens each timed request generates (1: the prefill worker answers alone; more: the "
                             "KV goes to the decode worker, as a request that goes on does)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="short prompts, one round (CI smoke run)")
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    parser.add_argument("--plot", default="", help="save a bar chart of the medians to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.new_tokens, args.rounds = 256, 15, 1
    return args


class Bench:
    def __init__(self, client: StrataClient, vocab: int, args: argparse.Namespace) -> None:
        self.client, self.vocab, self.args = client, vocab, args
        self.rng = random.Random(0)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def run(self, condition: str) -> dict:
        prefix = self.tokens(self.args.prefix_tokens)
        if condition != "cold":
            self.client.generate(prefix + self.tokens(self.args.new_tokens), max_tokens=1, ignore_eos=True)
            self.wait_for_writes()
            configured = {t.tier for w in self.client.cache_stats() for t in w.tiers}
            for tier in TIERS:  # the prefix is left in `condition` only, on whichever worker computed it
                if tier != condition and tier in configured:
                    self.client.flush_cache(tier=tier)
        time.sleep(SETTLE_S)  # every condition alike: the setup's aftermath (KV events, index updates) is not timed
        return self.timed(prefix + self.tokens(self.args.new_tokens))

    def wait_for_writes(self, timeout_s: float = 120.0) -> None:
        """Until no worker owes a background write (the prefix reached every lower tier)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(w.pending_writes == 0 for w in self.client.cache_stats()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"background writes still pending after {timeout_s:.0f}s")

    def timed(self, prompt: list[int]) -> dict:
        started = time.perf_counter()
        ttft, last = None, None
        for chunk in self.client.stream(prompt, max_tokens=self.args.max_tokens, ignore_eos=True,
                                        include_metrics=True):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - started
            last = chunk
        t = last.metrics.timings
        load = {"lookup": t.load_lookup_ms, "read": t.load_read_ms, "verify": t.load_verify_ms,
                "install": t.load_install_ms}
        # The worker's prefill_ms is lookup + read + verify + compute (install runs before its clock starts);
        # serving: the rest of the client's TTFT (`serving_parts`).
        compute = max(0.0, t.prefill_ms - t.load_lookup_ms - t.load_read_ms - t.load_verify_ms)
        return {"ttft_ms": ttft * 1e3, **load, "compute": compute,
                **serving_parts(ttft * 1e3, t),
                "cached_tokens": last.usage.cached_tokens, "by_tier": dict(t.blocks_by_tier),
                # which worker computed it: the prefill worker (handing off when the request goes on) or the decode
                # worker by itself (few uncached tokens: the router's conditional disaggregation)
                "route": "prefill worker" if last.metrics.disaggregated else "decode worker"}


def serving_parts(ttft_ms: float, t) -> dict[str, float]:
    """The client's TTFT around the worker's figures: `serving` (all of it), `queue` (the worker's engine queue),
    `router` (the client's TTFT minus the router's: the client <-> router hop) and `rest` (router -> worker RPC,
    hashing, admission, the answer's way back). Where install overlaps the reads (disk, Redis, S3: chunks install
    while later ones are read) serving is clamped at 0 and `rest` can be negative."""
    serving = max(0.0, ttft_ms - t.prefill_ms - t.load_install_ms)
    router = max(0.0, ttft_ms - t.ttft_ms) if t.ttft_ms else 0.0
    return {"serving": serving, "queue": t.queue_ms, "router": router, "rest": serving - t.queue_ms - router}


def raw_bandwidths(nbytes: int, redis_url: str, s3: S3Server, scratch: Path) -> dict[str, float]:
    """Bytes/s of one plain read of `nbytes` from each backend, medians of 5 (the bound beside each tier)."""
    import boto3
    import numpy as np
    import redis

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    out = np.empty_like(data)
    path = scratch / "raw.bin"
    data.tofile(path)
    r = redis.Redis.from_url(redis_url)
    blocks = 124
    chunk = nbytes // blocks
    r.mset({f"strata-bench-raw:{i}": data[i * chunk:(i + 1) * chunk].tobytes() for i in range(blocks)})
    client = boto3.client("s3", **{k.replace("region", "region_name"): v for k, v in s3.client_options().items()})
    client.create_bucket(Bucket="strata-bench-raw")
    client.put_object(Bucket="strata-bench-raw", Key="raw", Body=data.tobytes())

    def host() -> None:
        np.copyto(out, data)

    def disk() -> None:
        with open(path, "rb") as f:
            f.readinto(memoryview(out))

    def redis_get() -> None:
        r.mget([f"strata-bench-raw:{i}" for i in range(blocks)])

    def s3_get() -> None:
        client.get_object(Bucket="strata-bench-raw", Key="raw")["Body"].read()

    result = {}
    for name, fn in (("host", host), ("disk", disk), ("redis", redis_get), ("s3", s3_get)):
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        result[name] = nbytes / statistics.median(times)
    r.delete(*[f"strata-bench-raw:{i}" for i in range(blocks)])
    return result


def block_bytes(client: StrataClient) -> int:
    """Bytes of one stored block, from the workers' own stats (host tier: used bytes / blocks)."""
    for worker in client.cache_stats():
        for tier in worker.tiers:
            if tier.tier == "host" and tier.blocks:
                return int(tier.used_bytes // tier.blocks)
    return 0


def summarize(samples: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for condition, runs in samples.items():
        med = {key: statistics.median(r[key] for r in runs) for key in ("ttft_ms", *BREAKDOWN, *SERVING_PARTS)}
        med["cached_tokens"] = statistics.median(r["cached_tokens"] for r in runs)
        med["by_tier"] = runs[-1]["by_tier"]
        med["routes"] = sorted({r["route"] for r in runs})
        med["samples_ms"] = [round(r["ttft_ms"], 1) for r in runs]
        out[condition] = med
    cold = out["cold"]["ttft_ms"]
    for med in out.values():
        med["cold_over_this"] = cold / med["ttft_ms"]
    return out


def report(summary: dict[str, dict], bound_ms: dict[str, float], bandwidth: dict[str, float], args) -> None:
    print(f"\nTTFT, {args.prefix_tokens} cached + {args.new_tokens} new tokens, medians of {args.rounds} "
          f"(interleaved); breakdown as the serving worker reports it, ms")
    print(f"{'prefix in':<22} {'TTFT':>8} {'cold÷this':>9} {'cached':>7} " +
          " ".join(f"{k:>8}" for k in BREAKDOWN) + f" {'bound':>8} {'raw GB/s':>8}  served by, on")
    for condition, med in summary.items():
        bound = f"{bound_ms[condition]:8.1f}" if condition in bound_ms else f"{'':>8}"
        bw = f"{bandwidth[condition] / 1e9:8.2f}" if condition in bandwidth else f"{'':>8}"
        print(f"{condition:<22} {med['ttft_ms']:8.1f} {med['cold_over_this']:8.2f}× {med['cached_tokens']:7.0f} " +
              " ".join(f"{med[k]:8.1f}" for k in BREAKDOWN) + f" {bound}{bw}  {med['by_tier']}, "
              + " and ".join(med["routes"]))
    print("serving, of which: the worker's engine queue, client <-> router (the client's TTFT minus the router's), "
          "and the rest (router -> worker RPC, hashing, admission, the answer's way back), medians, ms")
    for condition, med in summary.items():
        print(f"{condition:<22} serving {med['serving']:6.1f}: queue {med['queue']:5.1f}, router "
              f"{med['router']:5.1f}, rest {med['rest']:5.1f}")


def plot(summary: dict[str, dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[plot]'), {path} not written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(names)
    ticks = [n.replace(" (", "\n(") for n in names]  # "host (host+disk only)" on two lines
    for part in BREAKDOWN:
        values = [summary[n][part] for n in names]
        ax.bar(ticks, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token by the tier that holds the prefix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot saved to {path}")


@contextmanager
def serving(config: ServeConfig, env: dict[str, str], log_path: Path) -> Iterator[StrataClient]:
    with log_path.open("w") as log:
        launcher = LocalLauncher(config, log=log, env={**os.environ, **env})
        info = launcher.start()
        try:
            yield StrataClient(info.grpc_address, timeout_s=300.0)
        finally:
            launcher.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())["vocab_size"]
    with RedisServer() as redis_srv, S3Server() as s3_srv, tempfile.TemporaryDirectory() as scratch:
        env = {"AWS_ACCESS_KEY_ID": s3_srv.access_key, "AWS_SECRET_ACCESS_KEY": s3_srv.secret_key,
               "AWS_DEFAULT_REGION": s3_srv.region}
        common = dict(model=args.model, prefill=args.prefill, decode=args.decode, grpc_port=0, http_port=-1,
                      enforce_eager=True, host_tier_mib=512)
        every = ServeConfig(redis_url=redis_srv.url, s3_url=f"{s3_srv.url}/strata-bench/kv",
                            data_dir=f"{scratch}/every", **common)
        local = ServeConfig(data_dir=f"{scratch}/local", **common)  # host + disk only: the 1.2x reference
        with serving(every, env, Path(scratch) / "every.log") as client, \
                serving(local, env, Path(scratch) / "local.log") as local_client:
            benches = {"every": Bench(client, vocab, args), "local": Bench(local_client, vocab, args)}
            benches["every"].run("cold")  # warm-up: first-request costs are nobody's
            benches["local"].run("cold")
            runs = [(c, "every") for c in CONDITIONS] + [("host", "local")]
            samples: dict[str, list[dict]] = {label(c, t): [] for c, t in runs}
            for round_ in range(args.rounds):
                shift = round_ % len(runs)
                for condition, tiers in runs[shift:] + runs[:shift]:
                    samples[label(condition, tiers)].append(benches[tiers].run(condition))
            nbytes = block_bytes(client) * (args.prefix_tokens // 16)
        bandwidth = raw_bandwidths(nbytes, redis_srv.url, s3_srv, Path(scratch)) if nbytes else {}
    bound_ms = {tier: nbytes / bw * 1e3 for tier, bw in bandwidth.items()}
    summary = summarize(samples)
    report(summary, bound_ms, bandwidth, args)
    host_alone = summary["host (host+disk only)"]["ttft_ms"]
    print(f"host hit with every tier configured ÷ with host and disk alone: "
          f"{summary['host']['ttft_ms'] / host_alone:.2f}×")
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        print(json.dumps({"prefix_bytes": nbytes, "raw_bytes_per_s": bandwidth, "bound_ms": bound_ms,
                          "conditions": summary}))
    return 0


def label(condition: str, tiers: str) -> str:
    return condition if tiers == "every" else f"{condition} (host+disk only)"


if __name__ == "__main__":
    sys.exit(main())
