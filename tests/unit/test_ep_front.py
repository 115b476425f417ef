"""The front of an expert-parallel group (`worker_common.ep_front.EPFront`, issue 14 item 4) over real gRPC: requests
go to the rank with the fewest in flight (ties by prompt affinity) and stream back; a rank's error comes back as it
was; a client's cancel reaches the rank; a rank that is gone, or a group that failed, answers UNAVAILABLE naming it;
Abort and ReleaseKv reach the rank that holds the request or lease; admin calls sum every rank's counts.

The ranks here are scripted `Worker` servicers (no model): the front's contract is about routing, not about what a
rank computes. `tests/e2e` runs real ranks through `strata serve --expert-parallel`."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.ep_front import EPFront, affinity
from worker_common.fleet_tls import FleetTls

BLOCK = 4
WORLD = 3


class ScriptedRank(worker_pb2_grpc.WorkerServicer):
    """One rank: streams tokens 0, 1, 2 (each once `gate` is open), grants a lease per Prefill, records calls."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.address, self.draining = worker_id, "", False
        self.config = SimpleNamespace(block_size=BLOCK, cluster_secret="", fleet_tls=FleetTls)  # FleetTls(): off
        self.calls: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.leases: set[str] = set()

    def Generate(self, request, context):
        self.calls.append(("Generate", request.request_id))
        if self.error:
            context.abort(*self.error)
        self.started.set()
        for token in range(3):
            while not self.gate.wait(0.02):
                if not context.is_active():
                    self.cancelled.set()
                    return
            yield worker_pb2.TokenChunk(request_id=request.request_id, token_ids=[token])
        yield worker_pb2.TokenChunk(request_id=request.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH)

    Decode = Generate

    def Prefill(self, request, context):
        self.calls.append(("Prefill", request.request_id))
        lease = f"{self.worker_id}/{request.request_id}"
        self.leases.add(lease)
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token_id=7, worker_id=self.worker_id,
                                          kv=common_pb2.KvHandle(lease_id=lease, lease_worker_address=self.address))

    def PrefillStream(self, request, context):
        self.calls.append(("PrefillStream", request.request_id))
        yield worker_pb2.PrefillResponse(request_id=request.request_id, first_token_id=7, worker_id=self.worker_id)
        lease = f"{self.worker_id}/{request.request_id}"
        self.leases.add(lease)
        yield worker_pb2.PrefillResponse(request_id=request.request_id, worker_id=self.worker_id,
                                         kv=common_pb2.KvHandle(lease_id=lease, lease_worker_address=self.address))

    def ReleaseKv(self, request, context):
        self.calls.append(("ReleaseKv", request.lease_id))
        released = request.lease_id in self.leases
        self.leases.discard(request.lease_id)
        return worker_pb2.ReleaseKvResponse(released=released)

    def Abort(self, request, context):
        self.calls.append(("Abort", request.request_id))
        return worker_pb2.WorkerAbortResponse(found=("Generate", request.request_id) in self.calls)

    def Health(self, request, context):
        return worker_pb2.HealthResponse(worker_id=self.worker_id, state=common_pb2.WORKER_STATE_READY, detail="ok")

    def load(self) -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(running=1, waiting=2, pending_prefill_tokens=30, running_tokens=40, kv_usage=0.5)

    def Stats(self, request, context):
        return worker_pb2.StatsResponse(worker_id=self.worker_id, load=self.load())

    def FlushCache(self, request, context):
        self.calls.append(("FlushCache", request.worker_id))
        if request.worker_id not in ("", self.worker_id):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker_id must be empty or {self.worker_id!r}")
        tiers = [request.tier] if request.tier else ["device", "host"]
        return common_pb2.FlushCacheResponse(results=[
            common_pb2.CacheAdminResult(worker_id=self.worker_id, tier=t, blocks_removed=1 + i, bytes_freed=10 + i)
            for i, t in enumerate(tiers)])


def make_server(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def group():
    ranks = [ScriptedRank("w")] + [ScriptedRank(f"w-rank{r}") for r in range(1, WORLD)]
    servers = [None]
    for rank in ranks[1:]:
        server, rank.address = make_server(rank)
        servers.append(server)
    alive = {r: True for r in range(WORLD)}
    front = EPFront(ranks[0], [r.address for r in ranks[1:]], alive=lambda r: alive[r])
    front_server, ranks[0].address = make_server(front)
    channel = grpc.insecure_channel(ranks[0].address)
    yield SimpleNamespace(ranks=ranks, servers=servers, alive=alive, front=front,
                          stub=worker_pb2_grpc.WorkerStub(channel))
    for rank in ranks:
        rank.gate.set()
    channel.close()
    front.close()
    for server in [front_server, *servers[1:]]:
        server.stop(0)


def prompt_for(front: EPFront, rank: int) -> list[int]:
    """A prompt an idle group places on `rank` (by affinity)."""
    return next(p for p in ([i, i + 1] for i in range(1000)) if front.pick(p) == rank)


def generate(stub, request_id: str, prompt: list[int], timeout_s: float = 10.0):
    return stub.Generate(worker_pb2.WorkerGenerateRequest(request_id=request_id, token_ids=prompt), timeout=timeout_s)


def tokens_of(call) -> list[int]:
    return [t for chunk in call for t in chunk.token_ids]


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# ---- placement ------------------------------------------------------------------------------------------------------

def test_requests_go_to_the_rank_with_the_fewest_in_flight(group):
    for rank in group.ranks:
        rank.gate.clear()
    prompt = [5, 5, 5, 5]  # the same prompt each time: only the counts can spread them
    calls = []
    for i in range(WORLD):
        calls.append(generate(group.stub, f"r{i}", prompt))
        wait_until(lambda: sum(r.started.is_set() for r in group.ranks) == i + 1)
    assert group.front.inflight() == [1, 1, 1]
    for rank in group.ranks:
        rank.gate.set()
    assert [tokens_of(c) for c in calls] == [[0, 1, 2]] * WORLD
    assert group.front.inflight() == [0, 0, 0] and group.front.idle()


def test_ties_go_by_the_prompts_first_tokens():
    """Prompts that share their first block meet on the same rank of an idle group (its prefix cache)."""
    shared = [9, 8, 7, 6]
    assert affinity(shared + [1, 2], BLOCK) == affinity(shared + [3], BLOCK) != affinity([1] + shared, BLOCK)


def test_a_forwarded_stream_comes_back_whole(group):
    prompt = prompt_for(group.front, 2)
    assert tokens_of(generate(group.stub, "a", prompt)) == [0, 1, 2]
    assert group.ranks[2].calls == [("Generate", "a")] and group.ranks[0].calls == []


# ---- errors and cancellation ----------------------------------------------------------------------------------------

def test_a_ranks_error_comes_back_unchanged(group):
    group.ranks[1].error = (grpc.StatusCode.INVALID_ARGUMENT, "token_ids[3] is out of the vocabulary")
    with pytest.raises(grpc.RpcError) as info:
        tokens_of(generate(group.stub, "bad", prompt_for(group.front, 1)))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                         "token_ids[3] is out of the vocabulary")


def test_a_duplicate_request_id_is_refused_across_ranks(group):
    group.ranks[1].gate.clear()
    first = generate(group.stub, "same", prompt_for(group.front, 1))
    wait_until(group.ranks[1].started.is_set)
    with pytest.raises(grpc.RpcError) as info:
        tokens_of(generate(group.stub, "same", [1, 2, 3]))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    group.ranks[1].gate.set()
    assert tokens_of(first) == [0, 1, 2]


def test_a_clients_cancel_cancels_the_forwarded_call(group):
    group.ranks[2].gate.clear()
    call = generate(group.stub, "c", prompt_for(group.front, 2))
    wait_until(group.ranks[2].started.is_set)
    call.cancel()
    assert group.ranks[2].cancelled.wait(5)
    wait_until(group.front.idle)


def test_an_unreachable_rank_answers_unavailable_naming_it(group):
    prompt = prompt_for(group.front, 1)
    group.servers[1].stop(0).wait(5)
    with pytest.raises(grpc.RpcError) as info:
        tokens_of(generate(group.stub, "u", prompt))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"expert-parallel rank 1 of {WORLD} at {group.ranks[1].address}" in info.value.details()


def test_a_dead_rank_answers_unavailable_and_turns_health_dead(group):
    prompt = prompt_for(group.front, 2)
    group.servers[2].stop(0).wait(5)
    group.alive[2] = False
    with pytest.raises(grpc.RpcError) as info:
        tokens_of(generate(group.stub, "d", prompt))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"expert-parallel rank 2 of {WORLD} is gone" in info.value.details()
    health = group.stub.Health(worker_pb2.HealthRequest(), timeout=5)
    assert (health.state, health.detail) == (common_pb2.WORKER_STATE_DEAD, f"expert-parallel rank 2 of {WORLD} is gone")


def test_a_failed_group_ends_forwarded_calls_and_refuses_new_ones_unavailable(group):
    reason = f"expert-parallel rank 2 of {WORLD} exited with code -9; failing the group"
    group.ranks[1].gate.clear()
    call = generate(group.stub, "f", prompt_for(group.front, 1))
    wait_until(group.ranks[1].started.is_set)
    group.front.fail(reason)
    with pytest.raises(grpc.RpcError) as info:
        tokens_of(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and info.value.details().startswith(reason)
    with pytest.raises(grpc.RpcError) as info:
        group.stub.Prefill(worker_pb2.PrefillRequest(request_id="late", token_ids=[1]), timeout=5)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, reason)
    assert group.stub.Health(worker_pb2.HealthRequest(), timeout=5).state == common_pb2.WORKER_STATE_DEAD


# ---- control --------------------------------------------------------------------------------------------------------

def test_a_forwarded_lease_names_the_front_and_is_released_on_its_rank(group):
    answer = group.stub.Prefill(worker_pb2.PrefillRequest(request_id="p", token_ids=prompt_for(group.front, 2)),
                                timeout=5)
    assert (answer.worker_id, answer.kv.lease_worker_address) == ("w-rank2", group.ranks[0].address)
    release = worker_pb2.ReleaseKvRequest(lease_id=answer.kv.lease_id)
    assert group.stub.ReleaseKv(release, timeout=5).released
    assert [c for r in group.ranks for c in r.calls if c[0] == "ReleaseKv"] == [("ReleaseKv", "w-rank2/p")]
    assert not group.stub.ReleaseKv(release, timeout=5).released   # unknown now: every rank is asked
    assert sum(c[0] == "ReleaseKv" for r in group.ranks for c in r.calls) == 1 + WORLD


def test_a_streamed_prefill_comes_through_the_front_with_its_lease_named_there(group):
    """PrefillStream: the first token, then the handle, both from the rank; the handle's ReleaseKv address is the
    front's, and the lease is released on its rank."""
    first, handoff = group.stub.PrefillStream(
        worker_pb2.PrefillRequest(request_id="s", token_ids=prompt_for(group.front, 1)), timeout=5)
    assert (first.first_token_id, first.kv.lease_id, handoff.worker_id) == (7, "", "w-rank1")
    assert handoff.kv.lease_worker_address == group.ranks[0].address
    assert group.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=handoff.kv.lease_id), timeout=5).released
    assert ("ReleaseKv", "w-rank1/s") in group.ranks[1].calls


def test_abort_goes_to_the_rank_running_the_request_else_to_every_rank(group):
    group.ranks[1].gate.clear()
    call = generate(group.stub, "x", prompt_for(group.front, 1))
    wait_until(group.ranks[1].started.is_set)
    assert group.stub.Abort(worker_pb2.WorkerAbortRequest(request_id="x"), timeout=5).found
    assert [[c for c in r.calls if c[0] == "Abort"] for r in group.ranks] == [[], [("Abort", "x")], []]
    group.ranks[1].gate.set()
    tokens_of(call)
    assert not group.stub.Abort(worker_pb2.WorkerAbortRequest(request_id="nobody"), timeout=5).found
    assert all(("Abort", "nobody") in r.calls for r in group.ranks)


def test_flush_sums_every_ranks_counts_per_tier_under_rank_0s_id(group):
    results = group.stub.FlushCache(common_pb2.FlushCacheRequest(worker_id="w"), timeout=10).results
    assert [(r.worker_id, r.tier, r.blocks_removed, r.bytes_freed, r.error) for r in results] == [
        ("w", "device", WORLD, 10 * WORLD, ""), ("w", "host", 2 * WORLD, 11 * WORLD, "")]
    assert [c for r in group.ranks[1:] for c in r.calls] == [("FlushCache", "")] * (WORLD - 1)


def test_a_named_shared_tier_is_flushed_once_for_the_group(group):
    results = group.stub.FlushCache(common_pb2.FlushCacheRequest(tier="redis"), timeout=10).results
    assert [(r.tier, r.blocks_removed) for r in results] == [("redis", 1)]
    assert all(r.calls == [] for r in group.ranks[1:])


def test_a_rank_that_fails_an_admin_call_is_named_in_every_result(group):
    group.servers[2].stop(0).wait(5)
    results = group.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30).results
    assert [r.blocks_removed for r in results] == [2, 4]
    assert all(f"expert-parallel rank 2 of {WORLD}: UNAVAILABLE" in r.error for r in results)


def test_stats_sum_the_request_counts_of_every_rank(group):
    load = group.stub.Stats(worker_pb2.StatsRequest(), timeout=5).load
    assert (load.running, load.waiting, load.pending_prefill_tokens, load.running_tokens) == (3, 6, 90, 120)
    assert load.kv_usage == 0.5   # rank 0's own
