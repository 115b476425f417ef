"""What a worker measures for the router's cost model (DESIGN §2): its prefill rate (`worker_common.load`) and its
store tiers' read costs (`worker_common.read_costs`), carried by `WorkerLoad`. Counters only, no engine, no torch."""
from __future__ import annotations

import math

import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from kvstore.tiers.base import LATENCY_BUCKETS, TierStats
from strata.v1 import common_pb2
from worker_common.load import LoadSnapshot, LoadTracker
from worker_common.read_costs import ReadCost, ReadCostMeter, ReadFit


def make_request(request_id: str = "r", prompt_len: int = 100) -> Request:
    return Request(request_id, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4))


def tier_stats(tier: str, calls: int, nbytes: int, seconds: float) -> TierStats:
    """Cumulative counters of `calls` get calls (their histogram bucket does not matter to the meter)."""
    counts = [calls] + [0] * len(LATENCY_BUCKETS)
    return TierStats(tier=tier, bytes_read=nbytes, get_latency_counts=counts, get_latency_sum_s=seconds)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------------------------------ prefill rate

def test_prefill_rate_counts_computed_prompt_tokens_not_cache_hits_nor_decode():
    tracker, r = LoadTracker(), make_request()
    tracker.refresh([r])
    r.status, r.num_cached_tokens, r.num_computed_tokens = RequestStatus.RUNNING, 16, 64  # 16 hit, 48 computed
    tracker.observe_step(64, 0.010)
    tracker.refresh([r])
    assert (tracker.snapshot.prefill_tokens_per_s, tracker.snapshot.prefill_rate_samples) == (4_800.0, 1)
    r.num_computed_tokens = 100  # the last 36 prompt tokens
    tracker.observe_step(36, 0.010)
    tracker.refresh([r])
    assert tracker.snapshot.prefill_tokens_per_s == pytest.approx((0.95 * 48 + 36) / (0.95 * 0.010 + 0.010))
    r.append_output(7)
    r.num_computed_tokens = 101  # a decode step computes no prompt token: no sample
    tracker.observe_step(1, 0.002)
    tracker.refresh([r])
    assert tracker.snapshot.prefill_rate_samples == 2


def test_prefill_rate_counts_a_request_that_finished_in_the_step():
    """A prefill worker's request ends in the step that computes its prompt (max_tokens=1) and is gone from the
    next refresh; the step still counts."""
    tracker, r = LoadTracker(), make_request(prompt_len=40)
    tracker.refresh([r])
    r.num_computed_tokens = 40
    tracker.observe_step(40, 0.004)
    tracker.refresh([])
    assert (tracker.snapshot.prefill_tokens_per_s, tracker.snapshot.prefill_rate_samples) == (10_000.0, 1)


def test_prefill_rate_is_zero_before_any_prompt_token_is_computed():
    tracker = LoadTracker()
    tracker.observe_step(0, 0.01)
    assert tracker.refresh([]) == LoadSnapshot()


# ---------------------------------------------------------------------------------------------- tier reads fit

def test_read_fit_recovers_latency_and_bandwidth_when_calls_differ_in_size():
    fit = ReadFit()
    for calls, nbytes in ((10, 10_000_000), (10, 1_000_000), (4, 8_000_000)):  # 1 ms a call, 1 GB/s
        fit.add(calls, nbytes, calls * 0.001 + nbytes / 1e9)
    cost = fit.cost()
    assert cost.latency_s == pytest.approx(0.001) and cost.bytes_per_s == pytest.approx(1e9)
    assert cost.samples == 24


def test_read_fit_charges_bytes_when_windows_cannot_tell_latency_from_bandwidth():
    fit = ReadFit()
    for calls in (2, 5, 9):  # always 1 MB a call, 3 ms a call
        fit.add(calls, calls * 1_000_000, calls * 0.003)
    assert fit.cost() == ReadCost(0.0, pytest.approx(1e6 / 0.003), 16)


def test_read_fit_never_goes_below_zero():
    only_misses = ReadFit()
    only_misses.add(5, 0, 0.005)
    assert only_misses.cost() == ReadCost(pytest.approx(0.001), math.inf, 5)
    size_free = ReadFit()  # bigger calls were not slower: no per-byte cost, all latency
    size_free.add(10, 10_000_000, 0.010)
    size_free.add(10, 1_000_000, 0.011)
    cost = size_free.cost()
    # least squares of latency alone, the older window weighing 0.9: sum(w c s) / sum(w c^2)
    assert cost.bytes_per_s == math.inf
    assert cost.latency_s == pytest.approx((0.9 * 10 * 0.010 + 10 * 0.011) / (0.9 * 100 + 100))
    assert ReadFit().cost() is None


# --------------------------------------------------------------------------------------------------- the meter

def test_meter_reads_the_counters_at_most_once_per_interval_and_fits_each_window():
    clock, stats = FakeClock(), {"host": tier_stats("host", 0, 0, 0.0), "disk": tier_stats("disk", 0, 0, 0.0)}
    meter = ReadCostMeter(lambda: stats, min_interval_s=1.0, clock=clock)
    assert meter.fields()["host_read_samples"] == 0
    stats["host"] = tier_stats("host", 10, 10_000_000, 0.020)  # 10 calls of 1 MB: 1 ms + 1 ms each
    assert meter.fields()["host_read_samples"] == 0  # not read again within the interval
    clock.now = 1.0
    stats["host"] = tier_stats("host", 10, 10_000_000, 0.020)
    assert meter.fields()["host_read_samples"] == 10
    clock.now = 2.0
    stats["host"] = tier_stats("host", 20, 11_000_000, 0.031)  # + 10 calls of 100 KB
    fields = meter.fields()
    assert fields["host_read_latency_s"] == pytest.approx(0.001)
    assert fields["host_read_bytes_per_s"] == pytest.approx(1e9)
    assert (fields["host_read_samples"], fields["disk_read_samples"], fields["s3_read_samples"]) == (20, 0, 0)
    assert set(meter.costs()) == {"host"}


def test_meter_restarts_a_tiers_baseline_when_its_counters_go_back():
    clock, stats = FakeClock(), {"redis": tier_stats("redis", 8, 8_000, 0.008)}
    meter = ReadCostMeter(lambda: stats, min_interval_s=0.0, clock=clock)
    assert meter.fields()["redis_read_samples"] == 8
    stats["redis"] = tier_stats("redis", 2, 2_000, 0.002)  # the tier was rebuilt: counters from 0
    assert meter.fields()["redis_read_samples"] == 8
    stats["redis"] = tier_stats("redis", 6, 6_000, 0.006)
    assert meter.fields()["redis_read_samples"] == 12


def test_snapshot_carries_the_tiers_read_costs_into_worker_load():
    """Every snapshot field is a WorkerLoad field: the worker builds its heartbeat's load from it as is."""
    clock = FakeClock()
    stats = {"disk": tier_stats("disk", 4, 4_000_000, 0.040), "custom": tier_stats("custom", 1, 1, 1.0)}
    tracker = LoadTracker()
    tracker.tier_reads = ReadCostMeter(lambda: stats, clock=clock).fields
    load = common_pb2.WorkerLoad(kv_usage=0.5, **tracker.snapshot._asdict())
    assert (load.disk_read_samples, load.disk_read_latency_s) == (4, 0.0)
    assert load.disk_read_bytes_per_s == pytest.approx(1e8)
    assert load.host_read_samples == 0  # a tier the store does not run; "custom" has no WorkerLoad field


# ------------------------------------------------------------------------------------------- hand-off transfers

def test_meter_fits_a_decode_workers_hand_off_reads_and_the_router_prices_transfers_with_them():
    from router.cost_model import CostModelConfig
    from router.service import measured_from_proto
    from worker_common.read_costs import TransferCounter

    clock, transfer = FakeClock(), TransferCounter()
    meter = ReadCostMeter(lambda: {}, min_interval_s=1.0, clock=clock, transfer=transfer)
    assert meter.fields()["transfer_read_samples"] == 0
    # two windows of reads of different sizes: 1 ms each plus 1 GB/s
    for calls, nbytes in ((10, 1_000_000), (30, 8_000_000)):
        for _ in range(calls):
            transfer.record(nbytes, 1e-3 + nbytes / 1e9)
        clock.now += 1.0
        fields = meter.fields()
    assert fields["transfer_read_samples"] == 40
    assert fields["transfer_read_latency_s"] == pytest.approx(1e-3, rel=1e-6)
    assert fields["transfer_read_bytes_per_s"] == pytest.approx(1e9, rel=1e-6)

    load = common_pb2.WorkerLoad(**LoadSnapshot()._replace(**fields)._asdict())
    measured = measured_from_proto(load)
    assert measured is not None and measured.transfer is not None and measured.transfer.samples == 40
    prior = CostModelConfig(kv_bytes_per_token=1_000)
    priced = prior.with_measured(measured)
    assert priced.transfer_s(8_000) == pytest.approx(1e-3 + 8e6 / 1e9)   # the measured link, not the prior's
    assert prior.replace(min_measured_samples=41).with_measured(measured).transfer == prior.transfer
    # a prefill worker measures none: its load carries no transfer figure
    assert measured_from_proto(common_pb2.WorkerLoad(prefill_tokens_per_s=1.0, prefill_rate_samples=3)).transfer is None
