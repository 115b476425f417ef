"""Pairs lost at an expert capacity (moe_bench part `capacity`): `engine.moe.capacity.apply_capacity` on routed
steps of the uniform and the Zipf workload (moe_workloads.py), for each capacity factor and overflow policy.

A step is one rank's forward of `tokens` tokens: the engine caps each expert per rank and step at
ceil(factor * T * k / E) pairs, so decode steps (T = streams per rank) lose more than long prefill chunks. The
fraction is over all (token, expert) pairs of all steps; "next" also reports the pairs it moved to another expert.
"""
from __future__ import annotations

from typing import NamedTuple

from engine.moe.capacity import OVERFLOW_POLICIES, apply_capacity, expert_capacity
from moe_workloads import BenchShape, route


class CapacitySpec(NamedTuple):
    shape: BenchShape
    tokens: tuple[int, ...]       # tokens per rank and step
    factors: tuple[float, ...]
    skew: float
    total_tokens: int             # per (workload, tokens): steps = ceil(total_tokens / tokens)


def capacity_drops(spec: CapacitySpec) -> list[dict]:
    """One row per (workload, tokens, policy): dropped and rerouted fractions per factor."""
    rows = []
    shape = spec.shape
    for workload, skew in (("uniform", 0.0), (f"zipf {spec.skew:g}", spec.skew)):
        for tokens in spec.tokens:
            count = -(-spec.total_tokens // tokens)
            steps = [route(tokens, shape.experts, shape.top_k, skew, seed) for seed in range(count)]
            pairs = count * tokens * shape.top_k
            for policy in OVERFLOW_POLICIES:
                row = {"workload": workload, "tokens": tokens, "policy": policy, "steps": count, "dropped": {},
                       "rerouted": {}, "capacity": {}}
                for factor in spec.factors:
                    capacity = expert_capacity(tokens, shape.top_k, shape.experts, factor)
                    row["capacity"][str(factor)] = capacity
                    dropped = rerouted = 0
                    for r in steps:
                        result = apply_capacity(r.probs, r.ids, r.weights, capacity, policy, True)
                        dropped, rerouted = dropped + int(result.dropped), rerouted + int(result.rerouted)
                    row["dropped"][str(factor)] = dropped / pairs
                    row["rerouted"][str(factor)] = rerouted / pairs
                rows.append(row)
    return rows


def print_capacity(rows: list[dict], spec: CapacitySpec) -> None:
    s = spec.shape
    print(f"capacity E={s.experts} k={s.top_k}, {spec.total_tokens} tokens per row: pairs dropped (next: and moved "
          f"to another expert); cap = pairs per expert and step", flush=True)
    header = "".join(f"{'cf ' + format(f, 'g'):<24}" for f in spec.factors)
    print(f"  {'workload':<9} {'T/rank':>6} {'policy':<6} {header}", flush=True)
    for row in rows:
        cells = []
        for f in map(str, spec.factors):
            moved = f" ({row['rerouted'][f]:.1%})" if row["policy"] == "next" else ""
            cells.append(f"{row['dropped'][f]:.2%}{moved} cap {row['capacity'][f]}")
        print(f"  {row['workload']:<9} {row['tokens']:>6} {row['policy']:<6} "
              f"{''.join(f'{c:<24}' for c in cells)}", flush=True)
