"""`serve_bench.py --compare disagg`: disaggregated vs colocated serving at equal resources (issue 17).

- **disaggregated**: 1 prefill + 1 decode worker (`strata serve` as shipped: prompts of at most 64 uncached tokens
  prefill on their decode worker, longer ones on the prefill worker, which hands the KV over).
- **colocated**: 2 workers that each prefill and decode their own requests (`prefill=0, decode=2`: with no prefill
  worker the router sends each request to the least loaded decode worker, which prefills it itself).

- **spill** (with `--local-prefill-min-backlog-s S`): the disaggregated cluster whose router also lets a long
  prompt prefill on the decode worker while the prefill worker is at least S seconds behind (conditional
  disaggregation under load, `router.policy.kv_aware`); the disaggregated arm then stays as shipped beside it.

Same worker count, model, chunk budget and request streams. The load is a prefill-heavy mix (`disagg_spec`) with
Poisson arrivals at each of `--rates`. Both clusters run side by side and take turns: every round runs each rate on
both, the order alternating, with a fresh seed per round (no prefix is reused across runs); figures are medians over
rounds. Goodput is also computed, from the same runs, under other SLOs (TPOT bounds `TPOT_BOUNDS_S` with `--slo`'s
TTFT bound and twice it), so the table shows where along the SLO axes one arm overtakes the other.
"""
from __future__ import annotations

import argparse
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import numpy as np

from serve_client import RunResult
from serve_cluster import measure, serve_config, started
from serve_metrics import Slo, goodput, medians, ratio, show
from serve_workload import WorkloadSpec, build
from worker_common.config import WorkerConfig

ARMS = ("disaggregated", "colocated")
SPILL = "spill"
TPOT_BOUNDS_S = (0.01, 0.02, 0.05, 0.1)
TTFT_FACTORS = (1.0, 2.0)   # the TTFT bound of the sensitivity table: --slo's, and twice it


def disagg_spec(spec: WorkloadSpec, rate: float, seconds: float, seed: int) -> WorkloadSpec:
    """The prefill-heavy mix at `rate`: half the requests a ~1,536-token prompt and 16 outputs, half a ~48-token
    prompt (prefilled where it decodes: under the router's 64-token local-prefill bound) and ~64 outputs; lengths
    +-25%.

    NOTE: prefill-heavy in what it costs here, not only in tokens: measured on this 2-core machine (compiled decode),
    the prefill worker spends ~2x the CPU time of the decode worker on it (0.80-0.93 vs 0.35-0.56 cores at 4-8/s).
    An earlier mix (1,024 in / 16 out + 48 in / 128 out, eager decode) had 7x more prompt than output tokens, yet
    kept the decode worker busier than the prefill worker (0.91 vs 0.55 cores at 10/s): one decode token of the
    bundled model costs far more CPU than one prompt token."""
    return replace(spec, source="poisson", sessions=0, rate=rate, num_requests=max(4, round(rate * seconds)),
                   long_fraction=0.5, long_input_len=1536, long_output_len=16, input_len=48, output_len=64,
                   range_ratio=0.25, seed=seed)


def compare_disagg(args: argparse.Namespace, spec: WorkloadSpec, log_dir: Path) -> dict:
    rates = [float(r) for r in args.rates.split(",")] if not args.quick else [4.0]
    rounds, seconds = (1, 3.0) if args.quick else (args.rounds, args.seconds)
    configs = {"disaggregated": serve_config(args, prefill=1, decode=1),
               "colocated": serve_config(args, prefill=0, decode=2, local_prefill_max_tokens=2048)}
    if args.local_prefill_min_backlog_s is not None:
        configs[SPILL] = serve_config(args, prefill=1, decode=1,
                                      local_prefill_min_backlog_s=args.local_prefill_min_backlog_s)
    arms = tuple(configs)
    summaries: dict[str, dict[float, list[dict]]] = {arm: {r: [] for r in rates} for arm in arms}
    raw: dict[str, dict[float, list[RunResult]]] = {arm: {r: [] for r in rates} for arm in arms}
    with ExitStack() as stack:
        clusters = {arm: stack.enter_context(started(arm, configs[arm], args.target, log_dir)) for arm in arms}
        for round_ in range(rounds):
            for i, rate in enumerate(rates):
                for arm in (arms if (round_ + i) % 2 == 0 else arms[::-1]):
                    summary, run = measure(clusters[arm], disagg_spec(spec, rate, seconds, 1000 * round_ + i),
                                           args.slo, f"{arm} {rate:g}/s r{round_}")
                    summaries[arm][rate].append(summary)
                    raw[arm][rate].append(run)
    table = {arm: {str(r): medians(summaries[arm][r]) for r in rates} for arm in arms}
    headline = rates[len(rates) // 2]
    result = {"rates": rates, "rounds": rounds, "headline_rate": headline, "slo": str(args.slo),
              "chunk_tokens": args.chunk_tokens or WorkerConfig.max_num_batched_tokens,
              "decode_step": "compiled" if args.compiled else "eager",
              "workload": build(disagg_spec(spec, headline, seconds, 0)).description, "medians": table,
              "arms": list(arms), "local_prefill_min_backlog_s": args.local_prefill_min_backlog_s,
              "samples": {arm: {str(r): [_brief(s) for s in summaries[arm][r]] for r in rates} for arm in arms},
              "ratios": _ratios(table, rates),
              "goodput_by_slo": _goodput_by_slo(raw, rates, args.slo),
              "max_rate_at_90pct_slo": {arm: _max_rate(table[arm], rates, 0.9) for arm in arms}}
    if SPILL in arms:
        result["ratios_spill"] = _ratios(table, rates, SPILL)
        result["goodput_by_slo_spill"] = _goodput_by_slo(raw, rates, args.slo, SPILL)
    _print(result)
    result["_records"] = {arm: [rec for run in raw[arm][headline] for rec in run.records] for arm in ARMS}
    return result


def _brief(s: Mapping) -> dict[str, float]:
    return {"goodput": s["goodput"], "itl_p99": s["itl"]["p99"], "ttft_p99": s["ttft"]["p99"],
            "tpot_p50": s["tpot"]["p50"], "failed": s["failed"], "step_retries": s["step_retries"]}


def _ratios(table: dict, rates: list[float], arm: str = "disaggregated") -> dict[str, dict[str, float | None]]:
    """`arm` (a disaggregated cluster) against colocated, per rate."""
    out = {}
    for r in rates:
        d, c = table[arm][str(r)], table["colocated"][str(r)]
        out[str(r)] = {"itl_p99_colocated_over_disagg": ratio(c["itl.p99"], d["itl.p99"]),
                       "tpot_p99_colocated_over_disagg": ratio(c["tpot.p99"], d["tpot.p99"]),
                       "ttft_p99_colocated_over_disagg": ratio(c["ttft.p99"], d["ttft.p99"]),
                       "goodput_disagg_over_colocated": ratio(d["goodput"], c["goodput"])}
    return out


def _max_rate(table: Mapping[str, Mapping], rates: list[float], attainment: float) -> float | None:
    """DistServe's goodput: the highest swept rate up to which every rate kept `attainment` of requests in SLO."""
    best = None
    for r in sorted(rates):
        if table[str(r)]["slo_attainment"] < attainment:
            break
        best = r
    return best


def _goodput_by_slo(raw: dict, rates: list[float], slo: Slo, arm: str = "disaggregated") -> dict[str, dict]:
    """Per (TTFT, TPOT) bound pair and rate: `arm`'s and colocated's median goodput over rounds and their ratio
    (keyed "disaggregated" / "colocated" whichever disaggregated arm it is)."""
    out: dict[str, dict] = {}
    for factor in TTFT_FACTORS:
        for bound in TPOT_BOUNDS_S:
            other = replace(slo, ttft=(slo.ttft or 1.0) * factor, tpot=bound)
            row = {}
            for r in rates:
                g = {name: float(np.median([goodput(run, other) for run in raw[source][r]]))
                     for name, source in (("disaggregated", arm), ("colocated", "colocated"))}
                row[str(r)] = {**g, "disagg_over_colocated": ratio(g["disaggregated"], g["colocated"])}
            out[str(other)] = {"slo": str(other), "ttft_s": other.ttft, "tpot_s": other.tpot, "by_rate": row}
    return out


def _print(r: dict) -> None:
    print(f"\n== disaggregated (1 prefill + 1 decode) vs colocated (2 workers), {r['workload']}; SLO {r['slo']}; "
          f"prefill chunks of {r['chunk_tokens']} tokens, {r['decode_step']} decode step; medians of {r['rounds']} "
          f"interleaved rounds")
    print(f"{'rate':>5} {'arm':<14} {'req/s':>6} {'goodput':>8} {'in SLO':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (ms)")
    for rate in r["rates"]:
        for arm in r["arms"]:
            m = r["medians"][arm][str(rate)]
            print(f"{rate:5g} {arm:<14} {m['request_throughput']:6.2f} {m['goodput']:8.2f} {m['slo_attainment']:7.0%} "
                  f"{m['ttft.p50'] * 1e3:9.1f} {m['ttft.p99'] * 1e3:9.1f} {m['tpot.p50'] * 1e3:9.1f} "
                  f"{m['tpot.p99'] * 1e3:9.1f} {m['itl.p50'] * 1e3:8.1f} {m['itl.p99'] * 1e3:8.1f}")
        q = r["ratios"][str(rate)]
        print(f"{'':5} {'ratio':<14} ITL p99 colocated ÷ disaggregated {show(q['itl_p99_colocated_over_disagg'])}, "
              f"TPOT p99 {show(q['tpot_p99_colocated_over_disagg'])}, TTFT p99 "
              f"{show(q['ttft_p99_colocated_over_disagg'])}; goodput disaggregated ÷ colocated "
              f"{show(q['goodput_disagg_over_colocated'])}")
        if "ratios_spill" in r:
            q = r["ratios_spill"][str(rate)]
            print(f"{'':5} {'ratio, spill':<14} ITL p99 colocated ÷ spill {show(q['itl_p99_colocated_over_disagg'])}, "
                  f"TTFT p99 {show(q['ttft_p99_colocated_over_disagg'])}; goodput spill ÷ colocated "
                  f"{show(q['goodput_disagg_over_colocated'])}")
    failed = {arm: sum(x["failed"] for runs in r["samples"][arm].values() for x in runs) for arm in r["arms"]}
    if any(failed.values()):
        print("FAILED requests (all rounds): " + ", ".join(f"{arm} {n}" for arm, n in failed.items()))
    best = r["max_rate_at_90pct_slo"]
    print("highest swept rate with >= 90% of requests in SLO (DistServe's goodput): " +
          ", ".join(f"{arm} {'-' if v is None else f'{v:g}/s'}" for arm, v in best.items()))
    for key, name in (("goodput_by_slo", "disaggregated"), ("goodput_by_slo_spill", "spill")):
        if key not in r:
            continue
        print(f"goodput (req/s, {name} / colocated = ratio) under other SLOs, same runs:")
        for row in r[key].values():
            cells = [f"{rate:g}/s {v['disaggregated']:.2f}/{v['colocated']:.2f} = {show(v['disagg_over_colocated'])}"
                     for rate, v in ((float(k), v) for k, v in row["by_rate"].items())]
            print(f"  {row['slo']:<30} " + "; ".join(cells))
