"""End-to-end serving benchmark on real processes (issue 17): a load generator against `strata serve`.

It starts `strata serve` itself (`LocalLauncher`: router + prefill + decode worker processes, loopback) or drives one
already running (`--grpc-address`, `--http-url`), sends a workload through gRPC or the OpenAI HTTP API, and reports
TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99, as vLLM's serving benchmark defines them:
`serve_metrics.py`), throughput, goodput under `--slo`, and the cache hit ratio per tier.

Workloads (`serve_workload.py`): Poisson arrivals (`--rate`, `--num-requests`, lengths, a prefill-heavy mix with
`--long-fraction`); a replayed trace (`--trace mooncake|azure-code|azure-conv|PATH`, `--time-scale`); multi-turn
sessions with shared system prompts (`--sessions N --turns T --system-prompt-tokens K`).

Comparisons, each in one run on this machine, every baseline measured in the same run (`serve_compare.py`,
`serve_disagg.py`; figures and commands in benchmarks/README.md):
`--compare disagg` (1 prefill + 1 decode vs 2 colocated workers, interleaved rounds over a rate sweep),
`policies` (kv_aware vs round_robin vs least_loaded on the replayed Mooncake trace), `store` (tiered store vs
device-only caching on multi-turn sessions), `tiers` (TTFT with the prefix in one tier only vs cold: runs
`ttft_tiers.py`), `all`.

    python benchmarks/serve_bench.py --rate 4 --num-requests 200 --slo ttft:1 --slo tpot:0.05
    python benchmarks/serve_bench.py --trace mooncake --num-requests 500 --time-scale 0.25 --prefill 2
    python benchmarks/serve_bench.py --sessions 16 --turns 4 --system-prompt-tokens 512 --target http
    OMP_NUM_THREADS=1 python benchmarks/serve_bench.py --compare all --compiled --plot benchmarks/plots --json
    python benchmarks/serve_bench.py --quick --json          # CI smoke run: seconds, real processes
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# NOTE: strata first: it turns gRPC's fork support off before grpc loads (strata/__init__.py says why); the clusters
# started after a client has been used would otherwise lose a child now and then ("exits with -6").
import strata  # noqa: E402, F401, I001
from serve_cluster import TARGETS, attached, measure, serve_config, started  # noqa: E402
from serve_metrics import Slo, print_summary, tier_lookups  # noqa: E402
from serve_workload import TRACES, WorkloadSpec  # noqa: E402
from strata.paths import resolve_model  # noqa: E402

COMPARISONS = ("disagg", "policies", "store", "tiers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or bundled name (default: the bundled model)")
    p.add_argument("--target", choices=TARGETS, default="grpc", help="the router's door requests go through")
    p.add_argument("--grpc-address", default="", help="drive this running router instead of starting one")
    p.add_argument("--http-url", default="", help="its OpenAI HTTP API (with --grpc-address and --target http)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers of the cluster started here")
    p.add_argument("--decode", type=int, default=1, help="decode workers of the cluster started here")
    p.add_argument("--policy", default="kv_aware", help="the router's policy (cluster started here)")
    w = p.add_argument_group("workload")
    w.add_argument("--arrivals", choices=("poisson",), default="poisson", help="without --trace")
    w.add_argument("--rate", type=float, default=4.0, help="requests (or sessions) per second")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests (from a trace: the first N); default 100 (--compare policies: 1,000)")
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -+ ratio)")
    w.add_argument("--long-fraction", type=float, default=0.0, help="share of long-prompt requests (mix)")
    w.add_argument("--long-input-len", type=int, default=1024)
    w.add_argument("--long-output-len", type=int, default=8)
    w.add_argument("--trace", default="", help=f"replay a trace: {', '.join(TRACES)} or a file")
    w.add_argument("--time-scale", type=float, default=None,
                   help="trace times x this (0.5 = twice as fast); default 1 (--compare policies: 0.5)")
    w.add_argument("--tokens-per-id", type=int, default=16, help="Mooncake: tokens per 512-token hash id")
    w.add_argument("--length-scale", type=float, default=0.25, help="Azure: token lengths x this")
    w.add_argument("--trace-offset", type=int, default=0, help="skip this many trace records")
    w.add_argument("--sessions", type=int, default=0, help="multi-turn sessions instead of single requests")
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--system-prompt-tokens", type=int, default=256)
    w.add_argument("--system-prompts", type=int, default=1, help="distinct system prompts the sessions share")
    w.add_argument("--user-tokens", type=int, default=64)
    w.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", action="append", default=[], metavar="METRIC:SECONDS",
                   help="goodput's SLO, repeatable: ttft:1.0, tpot:0.05, e2e:10 (default ttft:1 tpot:0.05)")
    c = p.add_argument_group("comparisons")
    c.add_argument("--compare", default="", help=f"{', '.join(COMPARISONS)}, comma-separated, or all")
    c.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    c.add_argument("--rates", default="2,4,6,8", help="disagg: the request rates swept (the middle one is the "
                                                          "headline)")
    c.add_argument("--seconds", type=float, default=20.0, help="disagg: seconds of arrivals per run")
    c.add_argument("--local-prefill-min-backlog-s", type=float, default=None, metavar="S",
                   help="disagg: add a third arm, the disaggregated cluster with conditional disaggregation under "
                        "load (long prompts may prefill on the decode worker while the prefill worker is S s behind)")
    c.add_argument("--chunk-tokens", type=int, default=0,
                   help="every worker's prefill chunk budget per step (--max-num-batched-tokens; 0 = its default)")
    p.add_argument("--compiled", action="store_true",
                   help="compile the workers' decode step, as `strata serve` does by default (default here: eager, "
                        "which starts in seconds; compiled takes ~35 s per cluster with a warm Inductor cache)")
    p.add_argument("--quick", action="store_true", help="a few seconds of load (CI smoke run)")
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    p.add_argument("--plot", default="", metavar="DIR", help="write PNG plots into this folder")
    p.add_argument("--log-dir", default="", metavar="DIR",
                   help="keep every cluster's process output here (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    args.slo = Slo.parse(args.slo or ["ttft:1.0", "tpot:0.05"])
    args.compare = _comparisons(p, args.compare)
    if args.quick:
        args.num_requests, args.rate, args.input_len, args.output_len = 16, 8.0, 128, 16
        args.sessions, args.turns = min(args.sessions, 3), min(args.turns, 3)
    return args


def _comparisons(p: argparse.ArgumentParser, value: str) -> tuple[str, ...]:
    names = COMPARISONS if value == "all" else tuple(n for n in value.split(",") if n)
    unknown = [n for n in names if n not in COMPARISONS]
    if unknown:
        p.error(f"--compare takes {', '.join(COMPARISONS)} or all, got {', '.join(unknown)}")
    return names


def workload_spec(args: argparse.Namespace, vocab: int) -> WorkloadSpec:
    """The workload the options describe (`WorkloadSpec` validates it, naming the field)."""
    names = {f.name for f in fields(WorkloadSpec)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(source=args.trace or "poisson", think_time_s=args.think_time, vocab=vocab,
                  num_requests=args.num_requests or 100, time_scale=args.time_scale or 1.0)
    return WorkloadSpec(**values)


def single_run(args: argparse.Namespace, spec: WorkloadSpec, log_dir: Path) -> dict:
    """One workload against one cluster: the one at --grpc-address, or one started here."""
    with ExitStack() as stack:
        if args.grpc_address:
            cluster = stack.enter_context(attached("given", args.grpc_address, args.http_url, args.target))
        else:
            config = serve_config(args, prefill=args.prefill, decode=args.decode, policy=args.policy)
            cluster = stack.enter_context(started("cluster", config, args.target, log_dir))
        before = cluster.client.cache_stats()
        summary, result = measure(cluster, spec, args.slo, args.target)
        after = cluster.client.cache_stats()
    summary.update(target=args.target, store_lookups=tier_lookups(before, after))
    print_summary(f"{args.target}, {summary['workload']}", summary)
    return {"summary": summary, "records": result.records}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = json.loads((Path(resolve_model(args.model)) / "config.json").read_text())["vocab_size"]
    spec = workload_spec(args, vocab)
    out: dict = {"quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as scratch:
        log_dir = Path(args.log_dir or scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        if not args.compare:
            run = single_run(args, spec, log_dir)
            out["run"] = run["summary"]
            if args.plot:
                from serve_plots import latency_cdfs
                latency_cdfs({"run": run["records"]}, Path(args.plot) / "latency_cdf.png", out["run"]["workload"])
        else:
            from serve_compare import run_comparisons
            out.update(run_comparisons(args, spec, log_dir))
    if args.json:
        print(json.dumps(out, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
