"""A decode worker's speculative decoding figures, as operators read them: `SpeculativeStats` (in `Stats`, in every
heartbeat, so `strata workers` lists them) and Prometheus on the worker's `/metrics`:

    strata_spec_draft_tokens_total{worker}      drafted tokens verified
    strata_spec_accepted_tokens_total{worker}   of them, accepted by the target
    strata_spec_verifies_total{worker}          request-steps that verified drafts
    strata_spec_emitted_tokens_total{worker}    tokens those verifies emitted (accepted + one corrected or bonus each)
    strata_spec_draft_seconds_total{worker}     time in the drafters
    strata_spec_verify_seconds_total{worker}    target forward + sampling of steps that verified drafts
    strata_spec_acceptance_rate{worker}         accepted / drafted
    strata_spec_mean_accepted_length{worker}    emitted / verifies (tokens per verify of one request)

NOTE: the engine thread updates `SpecStats` while these are read from another thread: each field is read once (a
plain int or float), never `SpecStats.as_dict()`, whose `by_method` dict may grow during the read.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from strata.v1 import common_pb2

# (SpeculativeStats field, Prometheus name without `strata_spec_` and `_total`, help)
_COUNTERS = (
    ("draft_tokens", "draft_tokens", "Drafted tokens the target verified"),
    ("accepted_tokens", "accepted_tokens", "Drafted tokens the target accepted"),
    ("verifies", "verifies", "Request-steps that verified at least one drafted token"),
    ("emitted_tokens", "emitted_tokens", "Tokens emitted by verifies: accepted drafts + one corrected or bonus each"),
    ("draft_seconds", "draft_seconds", "Seconds spent in the drafters"),
    ("verify_seconds", "verify_seconds", "Seconds of target forward and sampling in steps that verified drafts"),
)
_GAUGES = (
    ("acceptance_rate", "Accepted / drafted tokens since start (0 before the first verify)"),
    ("mean_accepted_length", "Tokens emitted per verify of one request since start (0 before the first verify)"),
)


def speculative_stats(speculation) -> common_pb2.SpeculativeStats | None:
    """The engine's `Speculation` (None: the worker does not speculate) as the proto; None when off."""
    if speculation is None:
        return None
    st, config = speculation.stats, speculation.config
    # NOTE: accepted before drafted, so that a step ending between the reads never makes the rate exceed 1
    accepted, emitted = st.num_accepted_tokens, st.num_emitted_tokens
    drafted, verifies = st.num_draft_tokens, st.num_verifies
    return common_pb2.SpeculativeStats(
        method=config.method or "", methods=sorted(speculation.drafters),
        num_speculative_tokens=config.num_speculative_tokens, verifies=verifies, draft_tokens=drafted,
        accepted_tokens=accepted, emitted_tokens=emitted, draft_seconds=st.draft_seconds,
        verify_seconds=st.verify_seconds, acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=emitted / verifies if verifies else 0.0)


class SpecCollector:
    """`strata_spec_*{worker}` from `stats()`, called once per scrape (nothing is yielded while it gives None)."""

    def __init__(self, worker_id: str, stats: Callable[[], common_pb2.SpeculativeStats | None]) -> None:
        self._worker_id, self._stats = worker_id, stats

    def describe(self):
        return []

    def collect(self):
        stats = self._stats()
        if stats is None:
            return
        for field, name, doc in _COUNTERS:
            family = CounterMetricFamily(f"strata_spec_{name}", doc, labels=["worker"])
            family.add_metric([self._worker_id], float(getattr(stats, field)))
            yield family
        for name, doc in _GAUGES:
            family = GaugeMetricFamily(f"strata_spec_{name}", doc, labels=["worker"])
            family.add_metric([self._worker_id], float(getattr(stats, name)))
            yield family
