"""The comparisons of `serve_bench.py --compare` (issue 17), each in one run on this machine, baseline beside it.

- **disagg**: 1 prefill + 1 decode worker vs 2 colocated workers under a prefill-heavy mix (`serve_disagg.py`).
- **policies**: kv_aware vs round_robin vs least_loaded, N prefill + 1 decode worker, replaying the first
  requests of the Mooncake synthetic trace (time-scaled); one cluster per policy, one after the other (the
  replay is deterministic; what differs is where the router sends each request). Hit ratio per tier and latency.
- **store**: the tiered store (host 256 MiB + disk) vs device-only caching, on multi-turn sessions whose working
  set exceeds the device cache. The host tier cannot be turned off (every worker stages and promotes through it;
  `WorkerConfig` wants >= 1 MiB), so "device-only" is the closest honest configuration: no disk tier and a
  1 MiB host tier (about 40 blocks of the bundled model). Interleaved rounds, both clusters side by side.
- **tiers**: TTFT of a prompt whose 1,984-token prefix is held in one tier only vs cold: `ttft_tiers.py`, run
  from here (its own interleaved rounds, real redis-server and moto S3).
"""
from __future__ import annotations

import argparse
import io
import json
from contextlib import ExitStack, redirect_stdout
from dataclasses import replace
from pathlib import Path

from serve_cluster import measure, serve_config, started
from serve_disagg import compare_disagg
from serve_metrics import medians, print_summary, ratio, show, tier_medians
from serve_workload import WorkloadSpec, build

POLICIES = ("kv_aware", "round_robin", "least_loaded")


def run_comparisons(args: argparse.Namespace, spec: WorkloadSpec, log_dir: Path) -> dict:
    out: dict = {}
    runners = {"disagg": compare_disagg, "policies": compare_policies, "store": compare_store,
               "tiers": compare_tiers}
    for name in args.compare:
        out[name] = runners[name](args, spec, log_dir)
    if args.plot:
        _plot(out, Path(args.plot))
    for value in out.values():
        value.pop("_records", None)   # for the plots only, not part of the JSON record
    return out


# ---------------------------------------------------------------------------------------------------- policies

def policies_spec(spec: WorkloadSpec, args: argparse.Namespace) -> WorkloadSpec:
    """The Mooncake synthetic trace (or `--trace`) from its start: `--num-requests` (default 1,000 here), 16 tokens
    per id, outputs scaled alike (6.3 tokens on average), times x `--time-scale` (default 0.5 here)."""
    n = 60 if args.quick else (args.num_requests or 1000)
    return replace(spec, source=args.trace or "mooncake", sessions=0, num_requests=n,
                   time_scale=args.time_scale or 0.5)


def compare_policies(args: argparse.Namespace, spec: WorkloadSpec, log_dir: Path) -> dict:
    """One cluster per policy, max(--prefill, 4) prefill workers + 1 decode worker (2 + 1 with --quick)."""
    trace = policies_spec(spec, args)
    workers = 2 if args.quick else max(args.prefill, 4)
    table, by_tier = {}, {}
    for policy in POLICIES:
        config = serve_config(args, prefill=workers, decode=1, policy=policy)
        with started(policy, config, args.target, log_dir) as cluster:
            summary, _ = measure(cluster, trace, args.slo, policy)
        print_summary(f"policy {policy}", summary)
        table[policy], by_tier[policy] = medians([summary]), summary["hit_ratio"]
        table[policy]["step_retries"] = summary["step_retries"]
    base = table["round_robin"]["hit_ratio.total"]
    result = {"workload": build(trace).description, "prefill_workers": workers, "medians": table,
              "hit_ratio": by_tier,
              "ratios": {p: {"hit_ratio_over_round_robin": ratio(table[p]["hit_ratio.total"], base),
                             "ttft_p50_round_robin_over_this": ratio(table["round_robin"]["ttft.p50"],
                                                                     table[p]["ttft.p50"])} for p in POLICIES}}
    _print_policies(result)
    return result


def _print_policies(r: dict) -> None:
    print(f"\n== routing policies, {r['prefill_workers']} prefill + 1 decode workers, {r['workload']}")
    print(f"{'policy':<14} {'hit ratio':>9} {'÷ rr':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} {'req/s':>6}"
          f" {'failed':>6} {'retries':>7}   per tier")
    for p in POLICIES:
        m, q = r["medians"][p], r["ratios"][p]
        tiers = ", ".join(f"{t} {v:.1%}" for t, v in r["hit_ratio"][p].items() if t != "total")
        print(f"{p:<14} {m['hit_ratio.total']:9.1%} {show(q['hit_ratio_over_round_robin']):>6} "
              f"{m['ttft.p50'] * 1e3:9.1f} {m['ttft.p99'] * 1e3:9.1f} {m['e2e.p50'] * 1e3:8.1f} "
              f"{m['request_throughput']:6.2f} {m['failed']:6.0f} {_count(m['step_retries']):>7}   {tiers}")


# ------------------------------------------------------------------------------------------------------- store

def store_spec(spec: WorkloadSpec, quick: bool, seed: int) -> WorkloadSpec:
    """Multi-turn sessions whose histories outgrow one worker's device cache: 24 sessions x 4 turns over 4 shared
    384-token system prompts, 128-token user turns, 32-token replies, 5 s between turns."""
    if quick:
        return replace(spec, source="poisson", sessions=3, turns=2, system_prompt_tokens=64, system_prompts=1,
                       user_tokens=32, output_len=8, rate=4.0, think_time_s=0.2, seed=seed)
    return replace(spec, source="poisson", sessions=24, turns=4, system_prompt_tokens=384, system_prompts=4,
                   user_tokens=128, output_len=32, rate=2.0, think_time_s=5.0, seed=seed)


DEVICE_BLOCKS = 256   # device KV blocks per worker in the store comparison (4,096 tokens)


def compare_store(args: argparse.Namespace, spec: WorkloadSpec, log_dir: Path) -> dict:
    rounds = 1 if args.quick else args.rounds
    arms = {"tiered": serve_config(args, num_blocks=DEVICE_BLOCKS, host_tier_mib=256),
            "device-only": serve_config(args, num_blocks=DEVICE_BLOCKS, host_tier_mib=1,
                                        disk_tier=False)}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with ExitStack() as stack:
        clusters = {arm: stack.enter_context(started(arm, cfg, args.target, log_dir)) for arm, cfg in arms.items()}
        for round_ in range(rounds):
            order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
            for arm in order:
                runs[arm].append(measure(clusters[arm], store_spec(spec, args.quick, 100 + round_), args.slo,
                                         f"{arm} r{round_}")[0])
    table = {arm: medians(runs[arm]) for arm in arms}
    for arm in arms:  # totals over rounds, not medians: a failure is never noise
        counts = [s["step_retries"] for s in runs[arm]]
        table[arm]["step_retries"] = None if None in counts else sum(counts)
        table[arm]["failed"] = sum(s["failed"] for s in runs[arm])
        table[arm]["requests"] = sum(s["requests"] for s in runs[arm])
    tiers = {arm: tier_medians(runs[arm]) for arm in arms}
    t, d = table["tiered"], table["device-only"]
    result = {"workload": build(store_spec(spec, args.quick, 0)).description, "rounds": rounds,
              "device_blocks": DEVICE_BLOCKS, "medians": table, "hit_ratio": tiers,
              "ratios": {"hit_ratio_tiered_over_device_only": ratio(t["hit_ratio.total"], d["hit_ratio.total"]),
                         "ttft_p50_device_only_over_tiered": ratio(d["ttft.p50"], t["ttft.p50"]),
                         "ttft_p99_device_only_over_tiered": ratio(d["ttft.p99"], t["ttft.p99"]),
                         "e2e_p50_device_only_over_tiered": ratio(d["e2e.p50"], t["e2e.p50"])}}
    _print_store(result)
    return result


def _print_store(r: dict) -> None:
    print(f"\n== tiered store vs device-only caching ({r['device_blocks']} device blocks per worker), "
          f"{r['workload']}; medians of {r['rounds']} interleaved rounds")
    print(f"{'arm':<12} {'hit ratio':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} {'req/s':>6} {'failed':>9} "
          f"{'retries':>7}   per tier (failed, retries: totals over rounds)")
    for arm in ("tiered", "device-only"):
        m = r["medians"][arm]
        tiers = ", ".join(f"{t} {v:.1%}" for t, v in r["hit_ratio"][arm].items() if t != "total")
        print(f"{arm:<12} {m['hit_ratio.total']:9.1%} {m['ttft.p50'] * 1e3:9.1f} {m['ttft.p99'] * 1e3:9.1f} "
              f"{m['e2e.p50'] * 1e3:8.1f} {m['request_throughput']:6.2f} {m['failed']:4.0f}/{m['requests']:<4.0f} "
              f"{_count(m['step_retries']):>7}   {tiers}")
    q = r["ratios"]
    print(f"ratio: hit ratio tiered ÷ device-only {show(q['hit_ratio_tiered_over_device_only'])}; TTFT p50 "
          f"device-only ÷ tiered {show(q['ttft_p50_device_only_over_tiered'])}, p99 "
          f"{show(q['ttft_p99_device_only_over_tiered'])}")


def _count(n: int | None) -> str:
    """Worker steps retried on another worker (router's counter; "-" when its HTTP API is off)."""
    return "-" if n is None else str(n)


# ------------------------------------------------------------------------------------------------------- tiers

def compare_tiers(args: argparse.Namespace, spec: WorkloadSpec, log_dir: Path) -> dict:
    """`ttft_tiers.py` as it is (not duplicated here): its table is printed, its JSON figures kept."""
    import ttft_tiers

    argv = ["--json", "--rounds", str(args.rounds)] + (["--quick"] if args.quick else [])
    if args.model:
        argv += ["--model", args.model]
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
        argv += ["--plot", str(Path(args.plot) / "ttft_tiers.png")]
    captured = io.StringIO()
    with redirect_stdout(captured):
        ttft_tiers.main(argv)
    lines = captured.getvalue().strip().splitlines()
    print("\n== TTFT by the tier holding the prefix (ttft_tiers.py " + " ".join(argv) + ")")
    print("\n".join(lines[:-1]))
    figures = json.loads(lines[-1])
    conditions = figures["conditions"]
    return {"argv": argv, "ttft_ms": {c: v["ttft_ms"] for c, v in conditions.items()},
            "cold_over_this": {c: v["cold_over_this"] for c, v in conditions.items()},
            "bound_ms": figures["bound_ms"]}


# ------------------------------------------------------------------------------------------------------- plots

def _plot(out: dict, folder: Path) -> None:
    import serve_plots

    folder.mkdir(parents=True, exist_ok=True)
    if "disagg" in out:
        d = out["disagg"]
        serve_plots.latency_cdfs(d["_records"], folder / "latency_cdf.png",
                                 f"{d['workload']} (all rounds)")
        serve_plots.goodput_vs_rate(d, folder / "goodput_vs_rate.png")
    if "policies" in out or "store" in out:
        serve_plots.hit_ratios(out.get("policies"), out.get("store"), folder / "hit_ratio.png")
