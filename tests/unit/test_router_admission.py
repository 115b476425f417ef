"""The router's bounded queue per decode worker (`router.admission`): full decoders leave the view; with none left
the request is refused with RESOURCE_EXHAUSTED and a retry hint that grows with how far past the bound they are."""
from __future__ import annotations

import grpc
import pytest

from router.admission import AdmissionConfig, check_fleet, with_room
from router.load import LoadView, WorkerLoad
from router.validation import ApiError

CONFIG = AdmissionConfig(max_queue_per_worker=4, retry_after_s=1.0, max_retry_after_s=5.0)


def make_view(*queues: int, prefill_queue: int = 0) -> LoadView:
    decoders = [WorkerLoad(f"d{i}", "decode", queue_len=q) for i, q in enumerate(queues)]
    return LoadView.of([WorkerLoad("p0", "prefill", queue_len=prefill_queue), *decoders])


def test_full_decoders_leave_the_view_and_the_others_stay():
    view = with_room(make_view(4, 3, 9), CONFIG, "m")
    assert [w.worker_id for w in view.workers] == ["d1", "p0"]


def test_no_decoder_with_room_is_resource_exhausted_with_a_retry_hint():
    with pytest.raises(ApiError) as err:
        with_room(make_view(8, 12), CONFIG, "m")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.retry_after_s == 2.0        # the least loaded is twice the bound: twice the base hint
    assert "--max-queue-per-worker" in err.value.message and "'m'" in err.value.message


def test_the_retry_hint_is_capped():
    with pytest.raises(ApiError) as err:
        with_room(make_view(400), CONFIG, "m")
    assert err.value.retry_after_s == 5.0


def test_no_bound_and_no_decoder_leave_the_view_alone():
    view = make_view(1000)
    assert with_room(view, AdmissionConfig(max_queue_per_worker=0), "m") is view
    prefill_only = LoadView.of([WorkerLoad("p0", "prefill", queue_len=99)])
    assert with_room(prefill_only, CONFIG, "m") is prefill_only   # routing answers UNAVAILABLE for it


def test_a_negative_bound_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="max_queue_per_worker"):
        AdmissionConfig(max_queue_per_worker=-1)


def test_the_fleet_bound_counts_every_request_in_flight_against_the_decoders_shares():
    check_fleet(7, 2, CONFIG, "m")                 # 2 decoders × 4 = 8: one more fits
    with pytest.raises(ApiError) as err:
        check_fleet(8, 2, CONFIG, "m")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s == 1.0
    assert "2 decode workers" in err.value.message
    check_fleet(10 ** 6, 0, CONFIG, "m")           # no decoder: routing answers UNAVAILABLE
    check_fleet(10 ** 6, 2, AdmissionConfig(max_queue_per_worker=0), "m")
