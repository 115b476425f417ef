"""A prompt whose prefix only one prefill worker holds, in its host tier (not on its device), is routed to that
worker, every time: the load guard does not send it to the other prefill worker, which would recompute it all.

Real processes (`strata serve`'s launcher, the bundled model): a router, two prefill workers and one decode worker,
with host and disk tiers and KV events. The prefix gets into prefill-0's tiers through a Prefill sent to that worker
directly, then leaves its device through the worker's own FlushCache; the test waits until the router has applied
every KV-event batch prefill-0 published (counted from the worker's replay buffer) before it routes anything.
"""
from __future__ import annotations

import random
import re
import time
import urllib.request
import uuid

import grpc
import pytest

from kvstore.events import ZmqEventSubscriber
from strata.client import StrataClient, sampling
from strata.launcher import ServeConfig
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster

pytestmark = pytest.mark.slow

HOLDER, OTHER = "prefill-0", "prefill-1"
BLOCK = 16
PREFIX = random.Random(7).choices(range(20, 250), k=20 * BLOCK)  # 20 full blocks
# NOTE: more tokens of its own than `local_prefill_max_tokens`: once the decode worker holds the prefix too (it pulls
# the first request's KV), a request with fewer would prefill there (conditional disaggregation), not in the pool.
OWN_TOKENS = 24
WAIT_S = 120.0  # generous: a loaded 2-core machine runs four model processes here


@pytest.fixture(scope="module")
def cluster():
    config = ServeConfig(prefill=2, decode=1, grpc_port=0, http_port=0, local_prefill_max_tokens=16,
                         ready_timeout_s=240, **SMALL_WORKERS)
    with own_cluster(config, "cached-prefix") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def holder(cluster):
    """A direct stub to prefill-0, the worker that holds the prefixes."""
    address = next(p.address for p in cluster.info.processes if p.name == HOLDER)
    with grpc.insecure_channel(address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def published_batches(events_endpoint: str, replay_endpoint: str) -> int:
    """How many KV-event batches a worker has published: its replay buffer, read from sequence 0."""
    last = -1
    with ZmqEventSubscriber(events_endpoint, replay_endpoint, topic="", from_seq=0, replay_timeout_s=10.0) as sub:
        sub.catch_up()
        while (item := sub.recv(timeout_s=2.0)) is not None:
            last = item.seq
    return last + 1


def applied_batches(http_url: str, worker_id: str) -> int:
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^strata_router_kv_event_batches{{worker="{worker_id}"}} (\S+)$', text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def wait_until_the_router_follows(cluster, client: StrataClient, worker_id: str) -> None:
    info = next(w for w in client.workers() if w.id == worker_id)
    want = published_batches(info.kv_events_endpoint, info.kv_replay_endpoint)
    assert want > 0, f"{worker_id} published no KV events"
    deadline = time.monotonic() + WAIT_S
    while applied_batches(cluster.http_url, worker_id) < want:
        assert time.monotonic() < deadline, f"the router applied fewer than {want} of {worker_id}'s KV-event batches"
        time.sleep(0.2)


def put_prefix_in_host_tier_only(holder: worker_pb2_grpc.WorkerStub) -> None:
    """prefill-0 computes the prefix (its blocks go to its store: host now, disk behind), then drops it from its
    device: what is left is the host (and disk) copy."""
    answer = holder.Prefill(worker_pb2.PrefillRequest(
        request_id=f"seed-{uuid.uuid4().hex[:8]}", token_ids=PREFIX + [5, 6, 7], sampling=sampling(max_tokens=2)),
        timeout=WAIT_S)
    if answer.kv.lease_id:
        holder.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=answer.kv.lease_id), timeout=30)
    stats = holder.Stats(worker_pb2.StatsRequest(), timeout=30).cache
    assert next(t.blocks for t in stats.tiers if t.tier == "host") >= len(PREFIX) // BLOCK
    flushed = holder.FlushCache(common_pb2.FlushCacheRequest(worker_id=HOLDER, tier="device"), timeout=60)
    assert [(r.tier, r.error) for r in flushed.results] == [("device", "")]
    assert flushed.results[0].blocks_removed >= len(PREFIX) // BLOCK


@pytest.mark.timeout(900)
def test_the_only_holder_of_a_host_tier_prefix_gets_every_request(cluster, holder):
    put_prefix_in_host_tier_only(holder)
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S) as client:
        wait_until_the_router_follows(cluster, client, HOLDER)
        routed = []
        for i in range(6):  # one after another, each with tokens of its own after the shared prefix
            own = random.Random(i).choices(range(300, 4000), k=OWN_TOKENS)
            out = client.generate(PREFIX + own, max_tokens=2, ignore_eos=True, include_metrics=True)
            routed.append((out.metrics.prefill_worker_id, out.usage.cached_tokens >= len(PREFIX)))
    assert routed == [(HOLDER, True)] * 6, f"{OTHER} recomputed a prefix only {HOLDER} holds: {routed}"


@pytest.mark.timeout(600)
def test_prefill_worker_reads_no_more_blocks_than_the_router_planned(holder):
    """PrefillRequest.max_load_blocks: the router found the blocks past it slower to read than to recompute, so the
    worker recomputes them even though its host tier holds them."""
    prefix = random.Random(11).choices(range(300, 4000), k=10 * BLOCK)

    def prefill(max_load_blocks: int | None) -> int:
        answer = holder.Prefill(worker_pb2.PrefillRequest(
            request_id=f"cap-{uuid.uuid4().hex[:8]}", token_ids=prefix + [9, 9, 9], sampling=sampling(max_tokens=2),
            max_load_blocks=max_load_blocks), timeout=WAIT_S)
        if answer.kv.lease_id:
            holder.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=answer.kv.lease_id), timeout=30)
        flushed = holder.FlushCache(common_pb2.FlushCacheRequest(worker_id=HOLDER, tier="device"), timeout=60)
        assert [r.error for r in flushed.results] == [""]  # only the host (and disk) copy is left for the next one
        return answer.cached_tokens

    assert prefill(None) == 0  # computes the prefix and stores it
    assert prefill(0) == 0
    assert prefill(4) == 4 * BLOCK
    assert prefill(None) == len(prefix)
