"""Workers of one model with fp8 KV and with the model dtype's KV, behind one router and one shared Redis tier: a
request hashed for fp8 KV is computed by fp8 workers only and never hits a block the other workers stored.

Real processes: `strata serve`'s launcher starts a router with `--kv-cache-dtype fp8` and one fp8 prefill and one fp8
decode worker; a prefill and a decode worker with `--kv-cache-dtype auto` (float32 KV) register with the same router
on their own. All four write through to one real `redis-server`. The auto prefill worker computes the prompt first
(a Prefill sent to it directly), so Redis holds its float32 blocks before any routed request.
"""
from __future__ import annotations

import random
import shutil
import time
import uuid

import grpc
import pytest

from strata.client import StrataClient, sampling
from strata.devservers import RedisServer
from strata.launcher import ServeConfig
from strata.paths import resolve_model
from strata.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from worker_common.launch import WorkerProcess

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

BLOCK = 16
PROMPT = random.Random(21).choices(range(20, 4000), k=12 * BLOCK + 5)   # 12 full blocks and a partial one
WAIT_S = 240.0


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def cluster(redis_url):
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, kv_cache_dtype="fp8", redis_url=redis_url,
                         disk_tier=False, local_prefill_max_tokens=0, ready_timeout_s=240, **SMALL_WORKERS)
    with own_cluster(config, "kv-dtype-routing") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def auto_workers(cluster, redis_url):
    args = ["--model", resolve_model(None), "--kv-cache-dtype", "auto", "--redis-url", redis_url,
            "--router", cluster.registry_address, "--num-blocks", "256", "--host-tier-mib", "16", "--handoff-mib", "16"]
    workers = [WorkerProcess(role, [*args, "--worker-id", f"{role}-auto"], wait=False) for role in ("prefill", "decode")]
    try:
        yield [w.wait_ready() for w in workers]
    finally:
        for w in workers:
            w.stop()


def wait_all_ready(client: StrataClient, ids: set[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ids <= {w.id for w in client.workers()}:
        assert time.monotonic() < deadline, f"not every worker of {sorted(ids)} registered"
        time.sleep(0.2)


def compute_on(worker: WorkerProcess, tokens: list[int]) -> None:
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        answer = stub.Prefill(worker_pb2.PrefillRequest(request_id=f"seed-{uuid.uuid4().hex[:8]}", token_ids=tokens,
                                                        sampling=sampling(max_tokens=2)), timeout=WAIT_S)
        if answer.kv.lease_id:
            stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=answer.kv.lease_id), timeout=30)


def device_and_host_blocks(worker: WorkerProcess) -> int:
    with grpc.insecure_channel(worker.address) as channel:
        stats = worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=30).cache
    return {t.tier: t.blocks for t in stats.tiers}


@pytest.mark.timeout(900)
def test_fp8_requests_run_on_fp8_workers_and_never_hit_blocks_of_another_kv_dtype(cluster, auto_workers):
    auto_prefill, auto_decode = auto_workers
    compute_on(auto_prefill, PROMPT)             # float32 blocks of the prompt: auto prefill's host tier and Redis
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S) as client:
        wait_all_ready(client, {"prefill-0", "decode-0", "prefill-auto", "decode-auto"})
        decode_blocks_before = device_and_host_blocks(auto_decode)
        runs = [client.generate(PROMPT, max_tokens=4, ignore_eos=True, include_metrics=True) for _ in range(3)]
    routes = [(r.metrics.prefill_worker_id, r.metrics.decode_worker_id) for r in runs]
    assert routes == [("prefill-0", "decode-0")] * 3, f"an fp8 request reached a float32-KV worker: {routes}"
    cached = [r.usage.cached_tokens for r in runs]
    assert cached[0] == 0, "the first fp8 request hit a block only float32-KV workers had stored"
    assert cached[1] == cached[2] == 12 * BLOCK   # its own fp8 blocks hit afterwards
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert device_and_host_blocks(auto_decode) == decode_blocks_before   # the float32 decoder computed nothing
