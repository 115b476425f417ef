"""The router's EvictCache / FlushCache fan-out (router/service.py), with fake worker stubs: local tiers go to every
selected worker; a shared tier (redis, s3) goes to one worker only (READY first; the next one only when a worker
could not be reached, never after one may have acted); each worker gets the caller's deadline, less a margin."""
from __future__ import annotations

import grpc
import pytest

from router.registry import LoadFigures, ModelFacts, WorkerRecord, WorkerView
from router.service import StrataService, _admin_timeout_s
from strata.v1 import common_pb2

ALL_TIERS = ("device", "host", "disk", "redis", "s3")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeStub:
    """A worker's stub: answers one result per tier asked, or raises the error it was given."""

    def __init__(self, worker_id: str, calls: list, error: grpc.StatusCode | None = None) -> None:
        self.worker_id, self.calls, self.error = worker_id, calls, error

    def _answer(self, method: str, request, timeout: float):
        self.calls.append((self.worker_id, method, request.tier, timeout))
        if self.error is not None:
            raise FakeRpcError(self.error, f"{self.worker_id} failed")
        result = common_pb2.CacheAdminResult(worker_id=self.worker_id, tier=request.tier, blocks_removed=7,
                                             shared=request.tier in ("redis", "s3"))
        return common_pb2.EvictCacheResponse(results=[result])

    def EvictCache(self, request, timeout):
        return self._answer("EvictCache", request, timeout)

    def FlushCache(self, request, timeout):
        return common_pb2.FlushCacheResponse(results=self._answer("FlushCache", request, timeout).results)


class FakeContext:
    def __init__(self, remaining_s: float | None = 30.0) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self):
        return self.remaining_s

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def make_view(worker_id: str, state: str = "ready", tiers: tuple[str, ...] = ALL_TIERS) -> WorkerView:
    record = WorkerRecord(worker_id, "decode", f"addr-{worker_id}", ModelFacts("m"), tiers=tiers)
    return WorkerView(record, state, LoadFigures(), 0, 0, 0.0, None)


class FakeRegistry:
    def __init__(self, views: list[WorkerView]) -> None:
        self.views = views

    def workers(self, role=None, include_dead=False):
        return list(self.views)


class FakeChannels:
    def __init__(self, stubs: dict[str, FakeStub]) -> None:
        self.stubs = stubs

    def stub(self, address: str) -> FakeStub:
        return self.stubs[address]


class FakeDispatcher:
    def __init__(self, stubs: dict[str, FakeStub]) -> None:
        self.channels = FakeChannels(stubs)


def make_service(views: list[WorkerView], errors: dict[str, grpc.StatusCode] | None = None):
    calls: list = []
    stubs = {v.record.address: FakeStub(v.record.id, calls, (errors or {}).get(v.record.id)) for v in views}
    return StrataService(FakeDispatcher(stubs), FakeRegistry(views)), calls


def evict(service: StrataService, tier: str, context: FakeContext | None = None) -> list[tuple]:
    request = common_pb2.EvictCacheRequest(tier=tier, block_hashes=[b"h" * 16])
    response = service.EvictCache(request, context or FakeContext())
    return [(r.worker_id, r.tier, r.shared, r.blocks_removed, r.error) for r in response.results]


@pytest.mark.parametrize("tier", ["redis", "s3"])
def test_a_shared_tier_is_asked_of_one_worker_only(tier):
    service, calls = make_service([make_view("w0"), make_view("w1"), make_view("w2")])
    assert evict(service, tier) == [("w0", tier, True, 7, "")]
    assert [(c[0], c[2]) for c in calls] == [("w0", tier)]


def test_a_local_tier_is_asked_of_every_worker():
    service, calls = make_service([make_view("w0"), make_view("w1")])
    assert evict(service, "host") == [("w0", "host", False, 7, ""), ("w1", "host", False, 7, "")]
    assert sorted(c[0] for c in calls) == ["w0", "w1"]


def test_the_shared_tier_goes_to_a_ready_worker_that_runs_it():
    views = [make_view("w0", state="draining"), make_view("w1", tiers=("device", "host")), make_view("w2")]
    service, calls = make_service(views)
    assert evict(service, "s3") == [("w2", "s3", True, 7, "")]
    assert [c[0] for c in calls] == ["w2"]


def test_an_unreachable_worker_is_skipped_for_the_next():
    service, calls = make_service([make_view("w0"), make_view("w1")], {"w0": grpc.StatusCode.UNAVAILABLE})
    assert evict(service, "redis") == [("w1", "redis", True, 7, "")]
    assert [c[0] for c in calls] == ["w0", "w1"]


def test_a_worker_that_may_have_acted_is_not_retried_elsewhere():
    """DEADLINE_EXCEEDED: the worker may still be deleting; asking another would act (and count) twice."""
    service, calls = make_service([make_view("w0"), make_view("w1")], {"w0": grpc.StatusCode.DEADLINE_EXCEEDED})
    assert evict(service, "s3") == [("w0", "s3", True, 0, "DEADLINE_EXCEEDED: w0 failed")]
    assert [c[0] for c in calls] == ["w0"]


def test_no_worker_running_the_shared_tier_is_one_error_result():
    views = [make_view("w0", tiers=("device", "host")), make_view("w1", tiers=("device", "host"))]
    service, calls = make_service(views)
    assert evict(service, "redis") == [("", "redis", True, 0, "no worker runs the redis tier")]
    assert calls == []


def test_a_flush_of_a_shared_tier_is_asked_of_one_worker_too():
    service, calls = make_service([make_view("w0"), make_view("w1")])
    response = service.FlushCache(common_pb2.FlushCacheRequest(tier="redis"), FakeContext())
    assert [(r.worker_id, r.shared) for r in response.results] == [("w0", True)]
    assert [(c[0], c[1]) for c in calls] == [("w0", "FlushCache")]


def test_workers_get_the_callers_deadline_less_a_margin():
    service, calls = make_service([make_view("w0")])
    evict(service, "s3", FakeContext(remaining_s=100.0))
    assert calls[0][3] == 99.0
    assert _admin_timeout_s(5.0) == 4.5 and _admin_timeout_s(0.05) == 0.1
    assert _admin_timeout_s(None) == 600.0
