"""A worker's MoE load figures on its Prometheus `/metrics` (nothing when the model has no sparse layers):

    strata_moe_expert_tokens_total{worker,layer,expert}   (token, expert) pairs this process routed to each expert
    strata_moe_capacity_dropped_total{worker,layer}       pairs dropped at the capacity factor (overflow: drop)
    strata_moe_capacity_rerouted_total{worker,layer}      pairs moved to a token's next choice (overflow: next)
  expert parallel (rank 0 reports the group):
    strata_moe_rank_tokens_total{worker,rank}             pairs each rank's experts computed
    strata_moe_rank_imbalance{worker}                     max / mean of those over the last eplb_window steps
    strata_moe_rebalances_total{worker}                   expert rebalances (EPLB) run
    strata_moe_experts_moved_total{worker}                experts that changed rank in them
    strata_moe_alltoall_bytes_total{worker}               bytes this rank sent to other ranks

NOTE: read from the scrape thread while the engine thread updates them: each value is read once, and a counter
read mid-step is at worst one step behind.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from torch import nn


class MoECollector:
    def __init__(self, worker_id: str, model: nn.Module, ep=None) -> None:
        """`ep`: the runner's `ExpertParallelStep` (None: one process)."""
        self._worker_id, self._ep = worker_id, ep
        self._layers = [(str(i), layer.mlp) for i, layer in enumerate(getattr(model, "layers", []))
                        if hasattr(layer.mlp, "expert_tokens")]

    def describe(self):
        return []

    def collect(self):
        if not self._layers:
            return
        w = self._worker_id
        tokens = CounterMetricFamily("strata_moe_expert_tokens_total", "Pairs routed to each expert by this process",
                                     labels=["worker", "layer", "expert"])
        dropped = CounterMetricFamily("strata_moe_capacity_dropped_total", "Pairs dropped at the capacity factor",
                                      labels=["worker", "layer"])
        rerouted = CounterMetricFamily("strata_moe_capacity_rerouted_total",
                                       "Pairs sent to the token's next choice at the capacity factor",
                                       labels=["worker", "layer"])
        for layer, mlp in self._layers:
            for expert, count in enumerate(mlp.expert_tokens.tolist()):
                tokens.add_metric([w, layer, str(expert)], float(count))
            drop, reroute = mlp.capacity_counts.tolist()
            dropped.add_metric([w, layer], float(drop))
            rerouted.add_metric([w, layer], float(reroute))
        yield from (tokens, dropped, rerouted)
        if self._ep is not None:
            yield from self._expert_parallel(w)

    def _expert_parallel(self, w: str):
        ep = self._ep
        ranks = CounterMetricFamily("strata_moe_rank_tokens_total", "Pairs each rank's experts computed",
                                    labels=["worker", "rank"])
        for rank, count in enumerate(list(ep.group.rank_pairs)):
            ranks.add_metric([w, str(rank)], float(count))
        yield ranks
        yield _gauge("strata_moe_rank_imbalance", "Max / mean pairs per rank over the last eplb_window steps", w,
                     ep.rank_imbalance())
        yield _counter("strata_moe_rebalances_total", "Expert rebalances run", w, ep.rebalances)
        yield _counter("strata_moe_experts_moved_total", "Experts moved between ranks by rebalances", w,
                       ep.experts_moved)
        yield _counter("strata_moe_alltoall_bytes_total", "All-to-all bytes this rank sent to other ranks", w,
                       ep.group.bytes_to_peers)


def _counter(name: str, doc: str, worker: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["worker"])
    family.add_metric([worker], float(value))
    return family


def _gauge(name: str, doc: str, worker: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["worker"])
    family.add_metric([worker], float(value))
    return family
