"""router.registry: registration, heartbeats, draining, death by silence or failure, and what routing sees."""
from __future__ import annotations

import pytest

from router.registry import (LoadFigures, ModelFacts, RegistryConfig, UnknownWorker, WorkerRecord,
                             WorkerRegistry)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_record(wid: str, role: str = "decode", model: str = "m", **kw) -> WorkerRecord:
    return WorkerRecord(wid, role, f"127.0.0.1:{1000 + len(wid)}", ModelFacts(model), **kw)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock) -> WorkerRegistry:
    return WorkerRegistry(RegistryConfig(heartbeat_interval_ms=1000, heartbeat_timeout_ms=3000, keep_dead_s=60),
                          clock=clock, wall_ms=lambda: int(clock.now * 1000))


def test_register_makes_a_worker_ready_and_routable(registry):
    registry.register(make_record("p0", "prefill"))
    registry.register(make_record("d0", "decode"))
    assert [(v.record.id, v.state) for v in registry.workers()] == [("d0", "ready"), ("p0", "ready")]
    view = registry.load_view("m")
    assert [w.worker_id for w in view.prefill_workers()] == ["p0"]
    assert [w.worker_id for w in view.decode_workers()] == ["d0"]
    registry.check_integrity()


def test_load_view_with_kv_keeps_only_workers_whose_kv_the_model_can_use(registry):
    """fp8-KV and bf16-KV workers of one model id: a request hashed for fp8 KV is routed to fp8 workers only (so a
    prefill never hands fp8 KV to a bf16 decoder); a worker that declares nothing (probed) is not excluded."""
    fp8, bf16 = ModelFacts("m", model_fingerprint="F", kv_dtype="float8_e4m3fn"), ModelFacts("m", model_fingerprint="F",
                                                                                          kv_dtype="bfloat16")
    registry.register(WorkerRecord("p-fp8", "prefill", "a:1", fp8))
    registry.register(WorkerRecord("p-bf16", "prefill", "a:2", bf16))
    registry.register(WorkerRecord("d-fp8", "decode", "a:3", fp8))
    registry.register(WorkerRecord("d-other-weights", "decode", "a:4",
                                   ModelFacts("m", model_fingerprint="G", kv_dtype="float8_e4m3fn")))
    registry.register(WorkerRecord("d-probed", "decode", "a:5", ModelFacts("m")))
    view = registry.load_view("m", kv=("F", "float8_e4m3fn"))
    assert [w.worker_id for w in view.prefill_workers()] == ["p-fp8"]
    assert sorted(w.worker_id for w in view.decode_workers()) == ["d-fp8", "d-probed"]
    assert sorted(w.worker_id for w in registry.load_view("m", kv=("F", "bfloat16")).prefill_workers()) == ["p-bf16"]


def test_record_requires_id_address_role_and_model():
    with pytest.raises(ValueError, match="worker.id"):
        WorkerRecord("", "decode", "a:1", ModelFacts("m"))
    with pytest.raises(ValueError, match="worker.role"):
        WorkerRecord("w", "cook", "a:1", ModelFacts("m"))
    with pytest.raises(ValueError, match="worker.model.id"):
        WorkerRecord("w", "decode", "a:1", ModelFacts(""))


def test_heartbeat_refreshes_load_and_unknown_ids_are_refused(registry):
    registry.register(make_record("d0"))
    assert registry.heartbeat("d0", LoadFigures(running=2, waiting=3, backlog_s=0.5)) == "ready"
    w = registry.load_view().workers[0]
    assert (w.queue_len, w.backlog_s) == (5, 0.5)
    with pytest.raises(UnknownWorker):
        registry.heartbeat("nobody")


def test_silence_past_the_timeout_makes_a_worker_dead_and_unroutable(registry, clock):
    downs = []
    registry.add_listener(on_down=downs.append)
    registry.register(make_record("d0"))
    registry.register(make_record("d1"))
    clock.now += 2.0
    registry.heartbeat("d1")
    clock.now += 1.5  # d0 silent for 3.5 s > 3 s; d1 for 1.5 s
    assert registry.sweep() == ["d0"]
    assert downs == ["d0"]
    assert [w.worker_id for w in registry.load_view().workers] == ["d1"]
    assert [v.record.id for v in registry.workers()] == ["d1"]
    assert [v.state for v in registry.workers(include_dead=True)] == ["dead", "ready"]
    with pytest.raises(UnknownWorker):  # a dead worker must register again
        registry.heartbeat("d0")
    registry.check_integrity()


def test_a_dead_worker_that_registers_again_is_ready(registry, clock):
    ups = []
    registry.add_listener(on_up=lambda r: ups.append(r.id))
    registry.register(make_record("d0"))
    registry.report_failure("d0", "connection refused")
    assert registry.get("d0").state == "dead"
    assert registry.register(make_record("d0")) is True
    assert registry.get("d0").state == "ready" and ups == ["d0", "d0"]


def test_long_dead_workers_are_forgotten(registry, clock):
    registry.register(make_record("d0"))
    registry.report_failure("d0")
    clock.now += 61
    registry.sweep()
    with pytest.raises(UnknownWorker):
        registry.get("d0")


def test_drain_stops_new_requests_but_keeps_the_worker_listed(registry):
    registry.register(make_record("d0"))
    registry.register(make_record("d1"))
    assert registry.drain("d0").state == "draining"
    assert registry.drain("d0").state == "draining"  # idempotent
    assert registry.heartbeat("d0") == "draining"
    assert [w.worker_id for w in registry.load_view().workers] == ["d1"]
    assert {v.record.id: v.state for v in registry.workers()} == {"d0": "draining", "d1": "ready"}


def test_deregister_removes_now_and_is_idempotent(registry):
    downs = []
    registry.add_listener(on_down=downs.append)
    registry.register(make_record("d0"))
    assert registry.deregister("d0") is True
    assert registry.deregister("d0") is False
    assert downs == ["d0"] and registry.workers(include_dead=True) == []


def test_reregistering_a_live_worker_is_a_restart(registry):
    events = []
    registry.add_listener(on_up=lambda r: events.append(("up", r.id)), on_down=lambda w: events.append(("down", w)))
    registry.register(make_record("d0"))
    registry.begin("d0")
    assert registry.register(make_record("d0")) is True
    assert events == [("up", "d0"), ("down", "d0"), ("up", "d0")]
    assert registry.get("d0").inflight == 0  # the old entry's accounting went with it


def test_inflight_and_recent_work_feed_the_load_view(registry, clock):
    registry.register(make_record("d0"))
    registry.begin("d0", work_s=2.0)
    registry.begin("d0", work_s=2.0)
    w = registry.load_view().workers[0]
    assert w.queue_len == 2 and w.recent_busy_s == pytest.approx(4.0)
    clock.now += registry.config.busy_half_life_s
    registry.end("d0")
    registry.end("d0")
    registry.end("d0")  # never negative
    w = registry.load_view().workers[0]
    assert w.queue_len == 0 and w.recent_busy_s == pytest.approx(2.0)
    registry.check_integrity()


def test_prefill_sent_since_the_last_load_report_adds_to_its_backlog(registry, clock):
    registry.register(make_record("d0"))
    registry.heartbeat("d0", LoadFigures(backlog_s=0.5))
    registry.begin("d0", work_s=3.0, prefill_s=0.25)          # decode work counts in recent work only
    registry.begin("d0", work_s=0.25, prefill_s=0.25)
    assert registry.load_view().workers[0].backlog_s == pytest.approx(1.0)
    registry.heartbeat("d0")                                  # liveness only: nothing is reported, nothing replaced
    assert registry.load_view().workers[0].backlog_s == pytest.approx(1.0)
    clock.now += 2 * registry.config.heartbeat_interval_ms / 1000   # unreported sends fade (half per 2 intervals)
    assert registry.load_view().workers[0].backlog_s == pytest.approx(0.75)
    registry.heartbeat("d0", LoadFigures(backlog_s=0.3))      # the report now counts them
    assert registry.load_view().workers[0].backlog_s == pytest.approx(0.3)


def test_load_view_filters_by_model_and_exclusions(registry):
    registry.register(make_record("a", model="m1"))
    registry.register(make_record("b", model="m2"))
    registry.register(make_record("c", model="m1"))
    assert [w.worker_id for w in registry.load_view("m1").workers] == ["a", "c"]
    assert [w.worker_id for w in registry.load_view("m1", exclude=["a"]).workers] == ["c"]


def test_role_filter_lists_both_role_workers_under_either_role(registry):
    registry.register(make_record("b0", "both"))
    registry.register(make_record("p0", "prefill"))
    assert [v.record.id for v in registry.workers("decode")] == ["b0"]
    assert [v.record.id for v in registry.workers("prefill")] == ["b0", "p0"]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="heartbeat_timeout_ms must be > heartbeat_interval_ms"):
        RegistryConfig(heartbeat_interval_ms=1000, heartbeat_timeout_ms=500)


def test_membership_drives_the_kv_event_feed_and_the_index(registry):
    """A registered worker's KV events (real ZeroMQ sockets, vLLM wire format) reach the prefix index, including
    the ones published before the router subscribed (replayed); when the worker dies its entries are dropped."""
    import time

    from kvstore.events import BlockStored, ZmqEventPublisher, worker_topic
    from router.events_feed import EventsFeed, SharedIndex

    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=1.0)
    registry.add_listener(on_up=feed.subscribe, on_down=feed.unsubscribe)
    hashes = [bytes([i]) * 16 for i in range(3)]
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=worker_topic("d0"))
    try:
        pub.publish([BlockStored(hashes[:2], None, list(range(32)), 16, medium="host")])  # before subscribing
        pub.flush()
        registry.register(make_record("d0", kv_events_endpoint=pub.endpoint, kv_replay_endpoint=pub.replay_endpoint))
        time.sleep(0.3)
        pub.publish([BlockStored(hashes[2:], hashes[1], list(range(32, 48)), 16, medium="GPU")])
        deadline = time.monotonic() + 10
        while index.match(hashes).pooled_blocks < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        match = index.match(hashes)
        assert match.pooled_blocks == 3 and match.workers() == ("d0",)
        registry.report_failure("d0")
        assert index.match(hashes).pooled_blocks == 0
        index.check_integrity()
    finally:
        feed.close()
        pub.close()


def test_lost_kv_events_make_the_index_drop_the_worker_and_start_over():
    """A batch delivered after an unrecoverable gap (or from a restarted publisher) must not be applied on top of
    a history with a hole in it: the worker's entries are dropped first."""
    from kvstore.events import BlockStored, KVEventBatch, ReceivedBatch
    from router.events_feed import SharedIndex

    old, new = bytes([1]) * 16, bytes([2]) * 16
    index = SharedIndex()

    def stored(h: bytes) -> KVEventBatch:
        return KVEventBatch(0.0, [BlockStored([h], None, list(range(16)), 16, medium="host")])

    result, resynced = index.apply_received("w", ReceivedBatch(0, stored(old), "kv-events/w"))
    assert (result.status, resynced) == ("applied", False)
    result, resynced = index.apply_received("w", ReceivedBatch(5, stored(new), "kv-events/w", lost_before=4))
    assert (result.status, resynced) == ("applied", True)
    assert index.match([old]).pooled_blocks == 0 and index.match([new]).pooled_blocks == 1
    result, resynced = index.apply_received("w", ReceivedBatch(0, stored(old), "kv-events/w",
                                                               publisher_restarted=True))
    assert resynced and index.match([new]).pooled_blocks == 0 and index.match([old]).pooled_blocks == 1
    index.check_integrity()


def test_measured_costs_from_heartbeats_reach_the_load_view(registry):
    """A worker's WorkerLoad carries its measured prefill rate and tier reads; the policy sees them per worker."""
    import math

    from router.cost_model import MeasuredCosts, MeasuredRead
    from router.service import load_from_proto
    from strata.v1 import common_pb2

    load = common_pb2.WorkerLoad(running=1, prefill_tokens_per_s=8_000.0, prefill_rate_samples=40,
                                 host_read_latency_s=1e-4, host_read_bytes_per_s=5e9, host_read_samples=30,
                                 disk_read_latency_s=2e-3, disk_read_bytes_per_s=math.inf, disk_read_samples=12,
                                 redis_read_latency_s=float("nan"), redis_read_bytes_per_s=1e9, redis_read_samples=9,
                                 s3_read_latency_s=0.02, s3_read_bytes_per_s=0.0, s3_read_samples=5)
    registry.register(make_record("p0", "prefill"))
    registry.heartbeat("p0", load_from_proto(load))
    # redis (NaN latency) and s3 (no bandwidth) are unusable: the cost model's defaults price them
    assert registry.load_view().workers[0].measured == MeasuredCosts(8_000.0, 40, (
        MeasuredRead("host", 1e-4, 5e9, 30), MeasuredRead("disk", 2e-3, math.inf, 12)))
    registry.heartbeat("p0", load_from_proto(common_pb2.WorkerLoad(running=1)))
    assert registry.load_view().workers[0].measured is None  # a worker that measures nothing: defaults
