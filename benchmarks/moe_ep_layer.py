"""One expert-parallel MoE layer on real ranks: moe_bench's parts `ep-layer`, `bytes` and `balance`.

`layer_ranks(group, spec)` runs on every rank of a 2-rank group (moe_ep_spawn.py), one torch thread each:

  ep-layer  tokens/s of one layer with `streams` tokens per step in all. EP 1: rank 0 alone runs `LocalMoE` with
            every expert on all tokens (the other rank waits in a collective, off the CPU). EP 2: each rank runs
            its `streams / 2` tokens (attention is data-parallel) through `ExpertParallelMoE`, one joined step per
            forward. Blocks of `steps` forwards alternate EP 1 / EP 2 (the order flips every round); the figure is
            the median over rounds of a block's mean step time (EP 2: the slower rank's).
  bytes     during the EP 2 blocks: all-to-all bytes sent to the peer per token (`EPGroup.bytes_to_peers`, padding
            included) and the useful part: rows that carry a token to a rank holding one of its experts.
  balance   skewed routing (Zipf) on the many-expert shape, float32: pairs each rank computed
            (`pairs_window`), all-gathered; max/mean over ranks, summed over the forwards (and per forward, mean).
            Contiguous placement first, then `ExpertParallelStep.rebalance()` (EPLB from the load the forwards
            routed) without and with `num_redundant_experts`; measured after on other batches of the same
            workload. The output of one batch is compared before and after each rebalance.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, NamedTuple

import torch

from engine.config import MoEConfig
from engine.moe.backend import MoESetup, make_moe_backend
from engine.moe.ep_dispatch import row_bytes
from engine.moe.ep_group import EPGroup
from engine.moe.ep_step import ExpertParallelStep
from engine.moe.local import LocalMoE
from ep_step_clock import PHASES, step_clock
from moe_workloads import BenchShape, expert_weights, route

NUM_BATCHES = 4                    # distinct batches cycled through the timed forwards


class LayerSpec(NamedTuple):
    shapes: tuple[tuple[str, BenchShape], ...]   # ep-layer and bytes
    dtype: str
    streams: int                                 # tokens per step over all ranks
    rounds: int
    steps: int                                   # forwards per timed block
    balance_shape: BenchShape | None             # None: no balance part
    skew: float
    hot_order: str                               # moe_workloads.HOT_ORDERS
    redundant: int                               # num_redundant_experts of the replicated run
    balance_forwards: int


def layer_ranks(group: EPGroup, spec: LayerSpec) -> dict:
    """Every rank returns the same dict."""
    with torch.inference_mode():
        out = {"layer": [_throughput(group, name, shape, spec) for name, shape in spec.shapes]}
        if spec.balance_shape is not None:
            out["balance"] = _balance(group, spec)
    return out


# ---- ep-layer and bytes ----------------------------------------------------------------------------------------

def _batch(shape: BenchShape, tokens: int, skew: float, seed: int, dtype: torch.dtype,
           hot_order: str = "ids") -> tuple[torch.Tensor, ...]:
    """(x [T, H], ids [T, k], weights [T, k]) of the whole group's step."""
    routing = route(tokens, shape.experts, shape.top_k, skew, seed, dtype, hot_order)
    x = torch.randn(tokens, shape.hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x, routing.ids, routing.weights


def _mine(batch: tuple[torch.Tensor, ...], group: EPGroup) -> tuple[torch.Tensor, ...]:
    rows = batch[0].shape[0] // group.world_size
    return tuple(t[group.rank * rows:(group.rank + 1) * rows] for t in batch)


def _ep_forward(group: EPGroup, layer: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    group.join_step(batch[0].shape[0])
    try:
        return layer(*batch)
    finally:
        group.end_step()


def _block_seconds(fn: Callable[[int], object], steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        fn(i)
    return (time.perf_counter() - start) / steps


def _barrier(group: EPGroup) -> None:
    group.all_reduce_sum(torch.zeros(1))


def _useful_bytes(group: EPGroup, ids: torch.Tensor, block: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of the rows that carry one of this rank's tokens to a peer holding one of its experts, both ways."""
    owner = ids // block                                                         # [T, k] rank of each expert
    peers = sum(int((owner == j).any(dim=1).sum()) for j in range(group.world_size) if j != group.rank)
    return peers * (row_bytes(hidden, ids.shape[1], dtype) + hidden * dtype.itemsize)


def _throughput(group: EPGroup, name: str, shape: BenchShape, spec: LayerSpec) -> dict:
    dtype = getattr(torch, spec.dtype)
    w13, w2 = expert_weights(shape, dtype)
    full = LocalMoE(w13, w2)                                 # EP 1, and the reference of every rank's output
    layer = make_moe_backend(MoESetup(MoEConfig(backend="expert_parallel"), group), w13, w2)
    layer.post_load()
    batches = [_batch(shape, spec.streams, 0.0, seed, dtype) for seed in range(NUM_BATCHES)]
    mine = [_mine(b, group) for b in batches]
    reference = full(*mine[0]).float()
    error = (_ep_forward(group, layer, mine[0]).float() - reference).abs().max().item() / reference.abs().max().item()
    ep1 = lambda i: full(*batches[i % NUM_BATCHES])                                # noqa: E731
    ep2 = lambda i: _ep_forward(group, layer, mine[i % NUM_BATCHES])               # noqa: E731
    if group.rank == 0:
        _block_seconds(ep1, 2)                                                     # warm-up
    _barrier(group)
    _block_seconds(ep2, 2)
    ep1_s, ep2_s, phases, sent = [], [], [], 0
    with step_clock(group, layer) as clock:
        for r in range(spec.rounds):
            for mode in ("ep1", "ep2") if r % 2 == 0 else ("ep2", "ep1"):
                _barrier(group)               # both ranks start the block together; EP 1's peer waits here
                if mode == "ep1" and group.rank == 0:
                    ep1_s.append(_block_seconds(ep1, spec.steps))
                elif mode == "ep2":
                    before, clock_before = group.bytes_to_peers, [clock.seconds[p] for p in PHASES]
                    ep2_s.append(_block_seconds(ep2, spec.steps))
                    sent += group.bytes_to_peers - before
                    phases.append([(clock.seconds[p] - b) / spec.steps for p, b in zip(PHASES, clock_before)])
    block = math.ceil(shape.experts / group.world_size)         # the contiguous layout: rank = expert // block
    per_batch = [_useful_bytes(group, m[1], block, shape.hidden, dtype) for m in mine]
    useful = spec.rounds * sum(per_batch[i % NUM_BATCHES] for i in range(spec.steps))
    return _layer_result(group, name, shape, spec, ep1_s, ep2_s, phases, (sent, useful), error)


def _layer_result(group: EPGroup, name: str, shape: BenchShape, spec: LayerSpec, ep1_s: list[float],
                  ep2_s: list[float], phases: list[list[float]], sums: tuple[float, float], error: float) -> dict:
    """`phases`: per EP 2 round, seconds per step in each of `PHASES`; `sums`: bytes sent, useful bytes."""
    ep1_all = group.all_gather(torch.tensor(ep1_s or [0.0] * spec.rounds, dtype=torch.float64))   # [N, rounds]
    ep2_all = group.all_gather(torch.tensor(ep2_s, dtype=torch.float64)).amax(dim=0)              # [rounds]
    phase_all = group.all_gather(torch.tensor(phases, dtype=torch.float64)).mean(dim=0)           # [rounds, P]
    totals = group.all_reduce_sum(torch.tensor(sums, dtype=torch.float64))
    error = group.all_gather(torch.tensor(error, dtype=torch.float64)).max().item()
    tokens = spec.rounds * spec.steps * spec.streams
    ep1_step, ep2_step = statistics.median(ep1_all[0].tolist()), statistics.median(ep2_all.tolist())
    median_round = int(ep2_all.argsort()[(spec.rounds - 1) // 2])
    return {"shape": name, "dims": shape._asdict(), "dtype": spec.dtype, "streams": spec.streams,
            "rounds": spec.rounds, "steps_per_round": spec.steps,
            "ep1_tokens_per_s": spec.streams / ep1_step, "ep2_tokens_per_s": spec.streams / ep2_step,
            "ep2_over_ep1": ep1_step / ep2_step, "ep1_step_ms": [1e3 * t for t in ep1_all[0].tolist()],
            "ep2_step_ms": [1e3 * t for t in ep2_all.tolist()],
            "ep2_phase_ms_per_step": {p: 1e3 * t for p, t in zip(PHASES, phase_all[median_round].tolist())},
            "ep2_max_rel_error": error,
            "bytes_to_peers_per_token": float(totals[0]) / tokens, "useful_bytes_per_token": float(totals[1]) / tokens,
            "activation_bytes_per_token": shape.hidden * getattr(torch, spec.dtype).itemsize}


# ---- balance ---------------------------------------------------------------------------------------------------

def _measured_imbalance(group: EPGroup, layer: torch.nn.Module, forwards: int) -> dict:
    pairs = group.all_gather(torch.tensor(list(layer.pairs_window)[-forwards:], dtype=torch.float64))   # [N, F]
    per_rank = pairs.sum(dim=1)                                                                  # [N]
    per_forward = pairs.amax(dim=0) / pairs.mean(dim=0).clamp_min(1e-9)                          # [F]
    return {"imbalance": float(per_rank.max() / per_rank.mean()), "imbalance_per_forward": float(per_forward.mean()),
            "pairs_per_rank": per_rank.tolist()}


def _forwards(group: EPGroup, layer: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """Runs every batch; returns the first one's output."""
    first = _ep_forward(group, layer, batches[0])
    for batch in batches[1:]:
        _ep_forward(group, layer, batch)
    return first


def _balance_run(group: EPGroup, spec: LayerSpec, redundant: int, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    shape, n = spec.balance_shape, spec.balance_forwards
    config = MoEConfig(backend="expert_parallel", num_redundant_experts=redundant)
    layer = make_moe_backend(MoESetup(config, group), w13, w2)
    layer.post_load()
    batches = [_mine(_batch(shape, spec.streams, spec.skew, seed, torch.float32, spec.hot_order), group)
               for seed in range(2 * n)]
    calibrate, held_out = batches[:n], batches[n:]
    out_before = _forwards(group, layer, calibrate)
    before = _measured_imbalance(group, layer, n)
    result = ExpertParallelStep(group, [layer], config, shape.top_k, torch.float32).rebalance()
    _forwards(group, layer, held_out)
    after = _measured_imbalance(group, layer, n)
    out_after = _ep_forward(group, layer, calibrate[0])
    diff = group.all_gather(torch.tensor((out_after - out_before).abs().max().item())).max().item()
    return {"redundant": redundant, "slots_per_rank": layer.slots_per_rank, "before": before, "after": after,
            "expected_before": result.imbalance_before, "expected_after": result.imbalance_after,
            "experts_moved": result.experts_moved, "max_abs_diff": diff,
            "output_scale": out_before.abs().max().item()}


def _balance(group: EPGroup, spec: LayerSpec) -> dict:
    shape = spec.balance_shape
    w13, w2 = expert_weights(shape, torch.float32)
    runs = [_balance_run(group, spec, r, w13, w2) for r in sorted({0, spec.redundant})]
    return {"dims": shape._asdict(), "dtype": "float32", "skew": spec.skew, "hot_order": spec.hot_order,
            "streams": spec.streams,
            "forwards": spec.balance_forwards, "runs": runs}


# ---- printing --------------------------------------------------------------------------------------------------

def print_layer(cells: list[dict]) -> None:
    for c in cells:
        d = c["dims"]
        ep1_ms, ep2_ms = 1e3 * c["streams"] / c["ep1_tokens_per_s"], 1e3 * c["streams"] / c["ep2_tokens_per_s"]
        phase = c["ep2_phase_ms_per_step"]
        phases = " + ".join(f"{p} {ms:.2f}" for p, ms in phase.items())
        exchange = (phase["join"] + phase["all_to_all"]) / ep2_ms
        print(f"ep-layer {c['shape']:>7} E={d['experts']} k={d['top_k']} H={d['hidden']} I={d['inter']} "
              f"{c['dtype']} {c['streams']} tok/step | EP1 {c['ep1_tokens_per_s']:8.0f} tok/s  EP2 "
              f"{c['ep2_tokens_per_s']:8.0f} tok/s  EP2/EP1 {c['ep2_over_ep1']:.2f}x | step ms: EP1 {ep1_ms:.2f}, "
              f"EP2 {ep2_ms:.2f} ({phases} + rest: median round, rank mean; exchange {exchange:.0%}) | EP2 rel err "
              f"{c['ep2_max_rel_error']:.1e}", flush=True)


def print_bytes(cells: list[dict]) -> None:
    for c in cells:
        sent, useful = c["bytes_to_peers_per_token"], c["useful_bytes_per_token"]
        print(f"bytes    {c['shape']:>7} EP2 all-to-all to peers: {sent:8.0f} B/token sent, {useful:8.0f} useful "
              f"(sent/useful {sent / max(useful, 1):.2f}x; one activation row {c['activation_bytes_per_token']} B)",
              flush=True)


def print_balance(b: dict) -> None:
    d = b["dims"]
    head = (f"balance  E={d['experts']} k={d['top_k']} zipf s={b['skew']} (hot: {b['hot_order']}) {b['streams']} "
            f"tok/step, {b['forwards']} fwd")
    first = b["runs"][0]["before"]
    print(f"{head} | contiguous: max/mean {first['imbalance']:.3f} (per forward {first['imbalance_per_forward']:.3f})",
          flush=True)
    for run in b["runs"]:
        a = run["after"]
        print(f"         rebalanced R={run['redundant']} ({run['slots_per_rank']} slots/rank, {run['experts_moved']} "
              f"moved): max/mean {a['imbalance']:.3f} (per forward {a['imbalance_per_forward']:.3f}; expected "
              f"{run['expected_after']:.3f}) | output max abs diff before/after {run['max_abs_diff']:.1e} "
              f"(scale {run['output_scale']:.2f})", flush=True)
