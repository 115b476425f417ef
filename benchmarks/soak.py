"""Overload and soak on `strata serve` (issue 15): what the fleet does at 5× the load it can serve.

One `strata serve` (router + prefill + decode worker processes, bundled model, loopback only) with the router's
bounded queue (`--max-queue-per-worker`). Two phases, in one run:

1. **capacity**: a closed loop of `--clients` clients, each sending its next request when the last one ends, for
   `--seconds`: the requests per second the fleet completes (R) and their latency — the baseline.
2. **overload**: Poisson arrivals at `--overload` × R (default 5×) for `--seconds`, over gRPC and HTTP, every
   request with a deadline of `--deadline-s`. Each ends as: served (finished within its deadline), refused
   (RESOURCE_EXHAUSTED / HTTP 429, with or without a retry hint), past its deadline, or failed otherwise.

Printed: the share of admitted requests that met their deadline, the share of refusals that carried a retry hint,
the served requests' latency against the capacity phase's (ratio), and the router's and workers' peak resident
memory during the overload against their memory after the capacity phase (ratio: bounded memory is ≈ 1).

    python benchmarks/soak.py                          # 30 s per phase, 5× overload
    python benchmarks/soak.py --seconds 120 --overload 5 --plot soak.png
    python benchmarks/soak.py --quick --json           # CI smoke run
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from strata.client import StrataClient  # noqa: E402
from strata.launcher import LocalLauncher, ServeConfig  # noqa: E402

OUTCOMES = ("served", "refused", "late", "failed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or bundled name (default: the bundled model)")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients of the capacity phase")
    p.add_argument("--overload", type=float, default=5.0, help="overload arrival rate, in multiples of capacity")
    p.add_argument("--deadline-s", type=float, default=30.0, help="every overload request's deadline")
    p.add_argument("--max-queue-per-worker", type=int, default=32, help="the router's bounded queue")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="5 s phases (CI smoke run)")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    p.add_argument("--plot", default="", help="save the overload phase's outcomes over time to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.clients, args.max_tokens = 5.0, 4, 8
    return args


class Outcome:
    """One request: when it was sent, how it ended, how long it took."""

    __slots__ = ("sent", "kind", "latency_s", "hinted", "door")

    def __init__(self, sent: float, door: str) -> None:
        self.sent, self.door, self.kind, self.latency_s, self.hinted = sent, door, "failed", 0.0, False


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(words))


def grpc_request(client: StrataClient, text: str, args: argparse.Namespace, deadline_s: float) -> Outcome:
    out = Outcome(time.monotonic(), "grpc")
    try:
        client.generate(text, timeout_s=deadline_s, max_tokens=args.max_tokens, ignore_eos=True)
        out.kind = "served"
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            out.kind = "refused"
            out.hinted = any(k == "grpc-retry-pushback-ms" for k, _ in exc.trailing_metadata() or ())
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            out.kind = "late"
    out.latency_s = time.monotonic() - out.sent
    return out


def http_request(http: httpx.Client, text: str, args: argparse.Namespace, deadline_s: float) -> Outcome:
    out = Outcome(time.monotonic(), "http")
    body = {"prompt": text, "max_tokens": args.max_tokens, "ignore_eos": True}
    try:
        reply = http.post("/v1/completions", json=body, timeout=deadline_s)
        if reply.status_code == 200:
            out.kind = "served"
        elif reply.status_code == 429:
            out.kind, out.hinted = "refused", "retry-after" in reply.headers
    except httpx.TimeoutException:
        out.kind = "late"
    out.latency_s = time.monotonic() - out.sent
    return out


class MemoryWatch:
    """Peak resident memory (VmRSS) of the cluster's processes, sampled every 0.2 s in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.peak = pids, {name: 0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> dict[str, int]:
        return {name: rss_bytes(pid) for name, pid in self.pids.items()}

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name, rss in self.now().items():
                self.peak[name] = max(self.peak[name], rss)

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


def capacity_phase(client: StrataClient, args: argparse.Namespace) -> tuple[float, list[Outcome]]:
    """Closed loop: (completed requests per second, their outcomes)."""
    stop_at = time.monotonic() + args.seconds
    outcomes: list[Outcome] = []

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            outcomes.append(grpc_request(client, prompt(rng, args.prompt_words), args, 600.0))

    started = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(client_loop, range(args.clients)))
    served = [o for o in outcomes if o.kind == "served"]
    return len(served) / (time.monotonic() - started), outcomes


def overload_phase(client: StrataClient, http: httpx.Client, rate: float, args: argparse.Namespace) -> list[Outcome]:
    """Open loop: Poisson arrivals at `rate` per second, alternating gRPC and HTTP (one channel and one connection
    pool each, as a load balancer in front would hold: the load generator shares the machine's cores)."""
    rng = random.Random(7)
    doors: list[Callable[..., Outcome]] = [lambda t: grpc_request(client, t, args, args.deadline_s),
                                           lambda t: http_request(http, t, args, args.deadline_s)]
    futures = []
    with ThreadPoolExecutor(max_workers=1024) as pool:
        start = time.monotonic()
        next_at, i = start, 0
        while next_at < start + args.seconds:
            time.sleep(max(0.0, next_at - time.monotonic()))
            futures.append(pool.submit(doors[i % 2], prompt(rng, args.prompt_words)))
            i += 1
            next_at += rng.expovariate(rate)
        return [f.result() for f in futures]


def summarize(capacity: list[Outcome], overload: list[Outcome], rate: float, r: float,
              baseline_rss: dict[str, int], peak_rss: dict[str, int]) -> dict:
    counts = {k: sum(1 for o in overload if o.kind == k) for k in OUTCOMES}
    admitted = [o for o in overload if o.kind in ("served", "late")]
    refused = [o for o in overload if o.kind == "refused"]
    base = sorted(o.latency_s for o in capacity if o.kind == "served")
    served = sorted(o.latency_s for o in overload if o.kind == "served")
    return {
        "capacity_rps": r, "overload_rps": rate, "requests": len(overload), "outcomes": counts,
        "admitted_met_deadline": (counts["served"] / len(admitted)) if admitted else None,
        "refusals_with_retry_hint": (sum(o.hinted for o in refused) / len(refused)) if refused else None,
        "latency_p50_s": {"capacity": _pct(base, 50), "overload": _pct(served, 50)},
        "latency_p99_s": {"capacity": _pct(base, 99), "overload": _pct(served, 99)},
        "rss_bytes": {"after_capacity": baseline_rss, "peak_overload": peak_rss},
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def report(s: dict) -> None:
    print(f"capacity (closed loop): {s['capacity_rps']:.2f} requests/s; overload offered: {s['overload_rps']:.2f}/s "
          f"({s['overload_rps'] / s['capacity_rps']:.1f}×), {s['requests']} requests")
    print("overload outcomes: " + ", ".join(f"{k} {v}" for k, v in s["outcomes"].items()))
    met, hint = s["admitted_met_deadline"], s["refusals_with_retry_hint"]
    print(f"admitted requests that met their deadline: {'-' if met is None else f'{met:.1%}'}; "
          f"refusals with a retry hint: {'-' if hint is None else f'{hint:.1%}'}")
    for q in ("p50", "p99"):
        lat = s[f"latency_{q}_s"]
        if lat["capacity"] and lat["overload"]:
            print(f"served latency {q}: {lat['overload']:.2f} s overloaded vs {lat['capacity']:.2f} s at capacity "
                  f"({lat['overload'] / lat['capacity']:.2f}×)")
    rss = s["rss_bytes"]
    for name, peak in rss["peak_overload"].items():
        base = rss["after_capacity"][name]
        if base:
            print(f"{name:<10} resident memory: peak {peak / 2**20:.0f} MiB under overload vs "
                  f"{base / 2**20:.0f} MiB after the capacity phase ({peak / base:.2f}×)")


def plot(overload: list[Outcome], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[plot]'), {path} not written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(o.sent for o in overload)
    fig, ax = plt.subplots(figsize=(8, 4))
    for kind in OUTCOMES:
        xs = [o.sent - t0 for o in overload if o.kind == kind]
        ys = [o.latency_s for o in overload if o.kind == kind]
        if xs:
            ax.scatter(xs, ys, s=4, label=kind)
    ax.set_xlabel("sent at (s)")
    ax.set_ylabel("latency (s)")
    ax.legend()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        config = ServeConfig(model=args.model, grpc_port=0, http_port=0, enforce_eager=True, data_dir=scratch,
                             router_args=("--max-queue-per-worker", str(args.max_queue_per_worker)))
        with open(Path(scratch) / "cluster.log", "w") as log, LocalLauncher(config, log=log) as launcher:
            info = launcher.info
            pids = {p.name: p.pid for p in info.processes}
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            with StrataClient(info.grpc_address) as client, \
                    httpx.Client(base_url=info.http_url, limits=limits) as http:
                grpc_request(client, "warm up", args, 600.0)
                r, capacity = capacity_phase(client, args)
                with MemoryWatch(pids) as watch:
                    baseline = watch.now()
                    rate = args.overload * r
                    overload = overload_phase(client, http, rate, args)
            summary = summarize(capacity, overload, rate, r, baseline, watch.peak)
    report(summary)
    if args.plot:
        plot(overload, args.plot)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
