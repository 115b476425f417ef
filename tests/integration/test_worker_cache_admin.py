"""Stats, EvictCache and FlushCache on a real prefill worker with device, host and disk tiers (issue 5): the
device tier's prefix-cache hits after a repeated prompt, host hits once the device copy is gone, and admin calls
that remove blocks, answer one `CacheAdminResult` per tier and publish `BlockRemoved` / `AllBlocksCleared`."""
from __future__ import annotations

import random
import time

import grpc
import pytest

from engine.model_runner import ModelRunner
from kvstore.events import AllBlocksCleared, BlockRemoved, ZmqEventSubscriber
from kvstore.hashing import hash_blocks
from engine.config import CacheConfig, ModelConfig
from strata.llm import kv_namespace
from strata.v1 import common_pb2, worker_pb2
from worker_common.cache_stats import latency_quantile_ms
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

BLOCK_SIZE, NUM_BLOCKS = 16, 128
WORKER_ID = "prefill-admin"


def make_prompt(seed: int, length: int = 3 * BLOCK_SIZE + 5) -> list[int]:
    """3 full blocks + 5 tokens: 3 cacheable blocks (48 tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 203) for _ in range(length)]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


@pytest.fixture(scope="module")
def fingerprint(model_path) -> bytes:
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=2)
    return kv_namespace(ModelRunner(ModelConfig(model_path, dtype="float32"), cache), cache, "float32").fingerprint()


@pytest.fixture(scope="module")
def worker(model_path, tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk-tier")
    args = ["--model", model_path, "--transfer", "shm", "--worker-id", WORKER_ID, "--num-blocks", str(NUM_BLOCKS),
            "--block-size", str(BLOCK_SIZE), "--handoff-mib", "8", "--host-tier-mib", "8", "--disk-path", str(disk),
            "--metrics-port", "0"]
    with WorkerProcess("prefill", args) as w:
        yield w


@pytest.fixture
def events(worker):
    """A subscriber that has seen everything published so far; `drain(events)` reads what comes next."""
    sub = ZmqEventSubscriber(worker.events_endpoint, worker.replay_endpoint, topic="kv-events", from_seq=0)
    time.sleep(0.3)
    sub.catch_up()
    while sub.recv(timeout_s=0.1) is not None:
        pass
    yield sub
    sub.close()


def next_events(sub: ZmqEventSubscriber, until, timeout_s: float = 10.0) -> list:
    """Events after those already read, until `until(events)` holds (or the timeout)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        item = sub.recv(timeout_s=0.3)
        if item is None:
            sub.catch_up()
        else:
            got.extend(item.batch.events)
    return got


def prefill(worker: WorkerProcess, request_id: str, prompt: list[int]) -> worker_pb2.PrefillResponse:
    sampling = common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
    answer = worker.stub().Prefill(worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt,
                                                             sampling=sampling), timeout=60)
    worker.stub().ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=answer.kv.lease_id), timeout=10)
    return answer


def tiers(worker: WorkerProcess) -> dict[str, common_pb2.CacheTierStats]:
    stats = worker.stub().Stats(worker_pb2.StatsRequest(), timeout=10)
    return {t.tier: t for t in stats.cache.tiers}


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def removed(events: list, medium: str) -> set[bytes]:
    return {h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}


def test_latency_quantiles_are_bucket_upper_bounds_in_ms():
    counts = [0] * 15
    counts[3], counts[5] = 98, 2                      # 98 calls in (0.5, 1] ms, 2 in (2.5, 5] ms
    assert latency_quantile_ms(counts, 0.5) == 1.0
    assert latency_quantile_ms(counts, 0.99) == 5.0
    assert latency_quantile_ms([0] * 15, 0.5) == 0.0
    assert latency_quantile_ms([0] * 14 + [1], 0.5) == 2500.0   # +Inf: the last finite bound


@pytest.mark.timeout(300)
def test_stats_report_tiers_fastest_first_and_load(worker):
    stats = worker.stub().Stats(worker_pb2.StatsRequest(), timeout=10)
    assert [t.tier for t in stats.cache.tiers] == ["device", "host", "disk"]
    device = stats.cache.tiers[0]
    assert device.capacity_bytes > 0 and device.capacity_bytes % NUM_BLOCKS == 0 and not device.shared
    assert stats.cache.worker_id == WORKER_ID and stats.cache.collected_at_unix_ms > 0
    load = stats.load
    assert (load.running, load.waiting, load.pending_prefill_tokens, load.running_tokens) == (0, 0, 0, 0)
    assert 0.0 <= load.kv_usage <= 1.0


@pytest.mark.timeout(300)
def test_metrics_endpoint_shows_the_same_tiers_and_the_load(worker):
    """The worker's own Prometheus /metrics (--metrics-port 0: a free port, named on the READY line)."""
    import httpx

    assert worker.metrics_url.startswith("http://127.0.0.1:") and worker.metrics_url.endswith("/metrics")
    prefill(worker, "metrics-1", make_prompt(7))
    text = httpx.get(worker.metrics_url, timeout=10).text
    stats = {t.tier: t for t in worker.stub().Stats(worker_pb2.StatsRequest(), timeout=10).cache.tiers}
    scraped = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    for tier in ("device", "host", "disk"):
        key = f'strata_cache_capacity_bytes{{tier="{tier}",worker="{WORKER_ID}"}}'
        assert scraped[key] == stats[tier].capacity_bytes > 0, key
    assert f'strata_cache_blocks{{tier="host",worker="{WORKER_ID}"}}' in text
    assert f'strata_worker_running{{worker="{WORKER_ID}"}}' in text
    assert f'strata_worker_kv_usage{{worker="{WORKER_ID}"}}' in text
    assert 'strata_kvstore_get_latency_seconds_bucket{le="+Inf",tier="host"}' in text  # the store's histograms


def test_repeated_prompt_hits_the_device_tier(worker, fingerprint):
    prompt = make_prompt(1)
    before = tiers(worker)["device"]
    assert prefill(worker, "rep-1", prompt).cached_tokens == 0
    assert prefill(worker, "rep-2", prompt).cached_tokens == 3 * BLOCK_SIZE
    after = tiers(worker)
    device = after["device"]
    assert device.hit_blocks - before.hit_blocks == 3
    assert device.miss_blocks - before.miss_blocks == 3          # 3 blocks asked by each of the two requests
    assert device.hit_tokens - before.hit_tokens == 3 * BLOCK_SIZE
    assert device.miss_tokens - before.miss_tokens == 2 * len(prompt) - 3 * BLOCK_SIZE
    host = after["host"]
    assert host.blocks >= 3 and host.bytes_written > 0 and host.put_latency_p50_ms > 0
    assert host.put_latency_p99_ms >= host.put_latency_p50_ms
    wait_for(lambda: tiers(worker)["disk"].blocks >= 3)            # written through in the background


@pytest.mark.timeout(300)
def test_evicting_device_blocks_by_hash_publishes_removals_and_the_next_prefill_hits_host(worker, fingerprint,
                                                                                         events):
    prompt = make_prompt(2)
    hashes = hash_blocks(fingerprint, prompt, BLOCK_SIZE)
    prefill(worker, "dev-1", prompt)
    block_bytes = tiers(worker)["device"].capacity_bytes // NUM_BLOCKS
    answer = worker.stub().EvictCache(common_pb2.EvictCacheRequest(tier="device", block_hashes=hashes), timeout=30)
    assert [(r.worker_id, r.tier, r.blocks_removed, r.bytes_freed, r.error) for r in answer.results] == [
        (WORKER_ID, "device", 3, 3 * block_bytes, "")]
    got = next_events(events, lambda got: set(hashes) <= removed(got, "device"))
    assert set(hashes) <= removed(got, "device")

    host_before = tiers(worker)["host"]
    assert prefill(worker, "dev-2", prompt).cached_tokens == 3 * BLOCK_SIZE    # loaded from host
    host = tiers(worker)["host"]
    assert host.hit_blocks - host_before.hit_blocks == 3
    assert host.hit_tokens - host_before.hit_tokens == 3 * BLOCK_SIZE
    assert host.get_latency_p50_ms > 0


@pytest.mark.timeout(300)
def test_evicting_bytes_from_host_drops_the_least_recently_used_blocks(worker, events):
    prefill(worker, "bytes-1", make_prompt(3))
    before = tiers(worker)["host"]
    slot = before.used_bytes // before.blocks
    answer = worker.stub().EvictCache(common_pb2.EvictCacheRequest(tier="host", bytes=slot + 1), timeout=30)
    (result,) = answer.results
    assert (result.tier, result.blocks_removed, result.bytes_freed, result.error) == ("host", 2, 2 * slot, "")
    assert tiers(worker)["host"].blocks == before.blocks - 2
    got = next_events(events, lambda got: len(removed(got, "host")) >= 2)
    assert len(removed(got, "host")) == 2


@pytest.mark.timeout(300)
def test_flushing_one_tier_removes_its_blocks_and_publishes_them(worker, events):
    wait_for(lambda: tiers(worker)["disk"].blocks > 0)
    held = tiers(worker)["disk"].blocks
    answer = worker.stub().FlushCache(common_pb2.FlushCacheRequest(tier="disk"), timeout=30)
    (result,) = answer.results
    assert (result.tier, result.blocks_removed, result.error) == ("disk", held, "")
    assert tiers(worker)["disk"].blocks == 0
    got = next_events(events, lambda got: len(removed(got, "disk")) >= held)
    assert len(removed(got, "disk")) == held
    assert not any(isinstance(e, AllBlocksCleared) for e in got)


@pytest.mark.timeout(300)
def test_flushing_every_local_tier_empties_them_and_publishes_all_blocks_cleared(worker, events):
    prefill(worker, "flush-1", make_prompt(4))
    answer = worker.stub().FlushCache(common_pb2.FlushCacheRequest(worker_id=WORKER_ID), timeout=30)
    assert [r.tier for r in answer.results] == ["device", "host", "disk"]
    assert all(not r.error for r in answer.results)
    assert answer.results[0].blocks_removed >= 3 and answer.results[1].blocks_removed >= 3
    after = tiers(worker)
    assert (after["device"].blocks, after["host"].blocks, after["disk"].blocks) == (0, 0, 0)
    got = next_events(events, lambda got: any(isinstance(e, AllBlocksCleared) for e in got))
    assert any(isinstance(e, AllBlocksCleared) for e in got)
    assert prefill(worker, "flush-2", make_prompt(4)).cached_tokens == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("request_fields, field", [
    ({"tier": "host"}, "exactly one of block_hashes and bytes"),
    ({"tier": "host", "bytes": 10, "block_hashes": [b"x" * 16]}, "exactly one of block_hashes and bytes"),
    ({"tier": "host", "block_hashes": [b"short"]}, "block_hashes must be 16 bytes"),
    ({"tier": "redis", "bytes": 10}, "tier must be empty or one of"),
    ({"worker_id": "someone-else", "bytes": 10}, "worker_id must be empty or this worker's id"),
], ids=["neither", "both", "short-hash", "unknown-tier", "other-worker"])
def test_bad_evict_requests_are_invalid_argument_naming_the_field(worker, request_fields, field):
    with pytest.raises(grpc.RpcError) as err:
        worker.stub().EvictCache(common_pb2.EvictCacheRequest(**request_fields), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


@pytest.mark.timeout(300)
def test_demoting_moves_blocks_one_tier_down(worker, fingerprint, events):
    """device -> host (already written through: counted as demoted), host -> disk (read, written, deleted); the
    prompt then hits the disk tier. Disk is the slowest tier here: demoting from it is an error result."""
    prompt = make_prompt(5)
    hashes = hash_blocks(fingerprint, prompt, BLOCK_SIZE)
    prefill(worker, "demote-1", prompt)
    stub = worker.stub()
    (device,) = stub.EvictCache(common_pb2.EvictCacheRequest(tier="device", block_hashes=hashes, demote=True),
                                timeout=30).results
    assert (device.blocks_demoted, device.blocks_removed, device.error) == (3, 0, "")
    host_before = tiers(worker)["host"]
    (host,) = stub.EvictCache(common_pb2.EvictCacheRequest(tier="host", block_hashes=hashes, demote=True),
                              timeout=30).results
    assert (host.blocks_demoted, host.blocks_removed, host.error) == (3, 0, "")
    assert host.bytes_freed == 3 * (host_before.used_bytes // host_before.blocks)
    got = next_events(events, lambda got: set(hashes) <= removed(got, "host"))
    assert set(hashes) <= removed(got, "host") and set(hashes) <= removed(got, "device")

    disk_before = tiers(worker)["disk"]
    assert prefill(worker, "demote-2", prompt).cached_tokens == 3 * BLOCK_SIZE
    assert tiers(worker)["disk"].hit_blocks - disk_before.hit_blocks == 3

    (disk,) = stub.EvictCache(common_pb2.EvictCacheRequest(tier="disk", bytes=1, demote=True), timeout=30).results
    assert disk.tier == "disk" and disk.blocks_removed == disk.blocks_demoted == 0 and "slowest" in disk.error


@pytest.fixture
def shared_worker(model_path, fresh_redis_server, s3_server):
    """A worker with the shared tiers too: Redis and an S3-compatible server (`--s3-url http://HOST:PORT/BUCKET`).
    Its own Redis, so the counts of a flush are this test's keys only."""
    redis_server = fresh_redis_server
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": s3_server.region}
    args = ["--model", model_path, "--transfer", "shm", "--worker-id", "prefill-shared", "--num-blocks", "64",
            "--block-size", str(BLOCK_SIZE), "--handoff-mib", "4", "--host-tier-mib", "4",
            "--redis-url", redis_server.url, "--s3-url", f"{s3_server.url}/worker-admin-test/kv"]
    with WorkerProcess("prefill", args, env=env) as w:
        yield w


@pytest.mark.timeout(300)
def test_shared_tiers_are_evicted_and_flushed_only_when_named(shared_worker, fingerprint):
    worker = shared_worker
    sub = ZmqEventSubscriber(worker.events_endpoint, worker.replay_endpoint, topic="kv-events", from_seq=0)
    try:
        prompt = make_prompt(6)
        hashes = hash_blocks(fingerprint, prompt, BLOCK_SIZE)
        prefill(worker, "shared-1", prompt)
        assert [t for t in tiers(worker)] == ["device", "host", "redis", "s3"]
        wait_for(lambda: tiers(worker)["redis"].blocks >= 3 and tiers(worker)["s3"].blocks >= 3)
        assert tiers(worker)["redis"].shared and tiers(worker)["s3"].shared

        local = worker.stub().FlushCache(common_pb2.FlushCacheRequest(), timeout=30).results
        assert [(r.tier, r.shared) for r in local] == [("device", False), ("host", False)]
        assert tiers(worker)["redis"].blocks >= 3 and tiers(worker)["s3"].blocks >= 3    # untouched

        (by_bytes,) = worker.stub().EvictCache(common_pb2.EvictCacheRequest(tier="redis", bytes=1),
                                               timeout=30).results
        assert "not supported" in by_bytes.error and by_bytes.blocks_removed == 0
        absent = [i.to_bytes(16, "big") for i in range(500)]   # counted as what S3 removed: only the one it held
        (one,) = worker.stub().EvictCache(common_pb2.EvictCacheRequest(tier="s3", block_hashes=hashes[:1] + absent),
                                          timeout=30).results
        assert (one.tier, one.shared, one.blocks_removed, one.error) == ("s3", True, 1, "")
        held = tiers(worker)["redis"].blocks
        (flushed,) = worker.stub().FlushCache(common_pb2.FlushCacheRequest(tier="redis"), timeout=30).results
        assert (flushed.tier, flushed.shared, flushed.blocks_removed, flushed.error) == ("redis", True, held, "")

        got = next_events(sub, lambda got: hashes[0] in removed(got, "s3")
                          and any(isinstance(e, AllBlocksCleared) for e in got))
        # the local flush names what left each local tier (the shared tiers still hold blocks: no AllBlocksCleared)
        assert set(hashes) <= removed(got, "device") and set(hashes) <= removed(got, "host")
        assert hashes[0] in removed(got, "s3")
        # the redis flush cannot list its keys: AllBlocksCleared (the router forgets; never a wrong hit)
        assert sum(isinstance(e, AllBlocksCleared) for e in got) == 1
        assert prefill(worker, "shared-2", prompt).cached_tokens == 0     # s3 lacks block 0: nothing leads
    finally:
        sub.close()
