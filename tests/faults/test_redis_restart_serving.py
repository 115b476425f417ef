"""The shared Redis tier under a served cluster (issue 15: "Redis killed and restarted under load: zero failed
requests"), and its blocks sealed at rest.

Real processes (`strata serve`'s launcher, the bundled model): a router, one prefill and one decode worker with host
and disk tiers, a real `redis-server` started here on a free loopback port, and `--kv-encryption-key-file`, so the
disk and Redis tiers hold AES-GCM sealed objects (kvstore/sealing.py). One cluster for both tests (three model
processes take ~30 s to start on a loaded 2-core machine); the sealing test goes first, while Redis holds what the
cluster wrote, and the restart test leaves Redis restarted, empty, on the same port.

- sealed at rest: the Redis values and disk files of a served prompt's blocks are sealed (no plaintext codec header,
  no payload bytes), open with the key into the very codec blocks; with device, host and disk flushed on every
  worker, the same prompt is a hit from Redis and gives the same tokens.
- Redis SIGKILLed and restarted on the same port while 16 client streams send greedy requests (most sharing one of
  four prefixes, which the first pass reads back from Redis; some fresh, which write new blocks): no request fails,
  every repeated request's tokens are those of its run before the fault, the workers count Redis errors while it is
  down, and afterwards their Redis tier is healthy and written to again.

Waits are polls under generous deadlines, never fixed sleeps that a loaded machine could outrun; the load runs a few
seconds in each phase (kill, down, back), well under a minute in all on an idle machine.
"""
from __future__ import annotations

import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from kvstore import codec
from kvstore.config import RedisTierConfig
from kvstore.hashing import BlockHash, Namespace, hash_blocks
from kvstore.sealing import Sealer, is_sealed
from kvstore.tiers.redis import RedisTier
from strata.client import Completion, StrataClient
from strata.devservers import RedisServer
from strata.launcher import ServeConfig
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from tests.e2e.test_store_every_tier_e2e import computing_worker, wait_for_background_writes

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

KEY = bytes(range(100, 132))
STREAMS = 16
MAX_TOKENS = 8
PHASE_S = 3.0           # the least load time in each phase: before the kill, while Redis is down, once it is back
WAIT_S = 120.0          # generous: a loaded 2-core machine runs three model processes and a server here
LOCAL_TIERS = ("device", "host", "disk")


def make_tokens(num_tokens: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(20, 250), k=num_tokens)


PREFIXES = [make_tokens(48, seed=100 + g) for g in range(4)]        # 3 full blocks each


def make_request(i: int) -> list[int]:
    """Prompt i: one of the four shared prefixes, then tokens of its own: 8 (short enough to prefill on the decode
    worker) or 24 (on the prefill worker), so both workers read the prefixes and both write blocks."""
    return PREFIXES[i % 4] + make_tokens(8 if i % 2 else 24, seed=1000 + i)


REPEATED = [make_request(i) for i in range(32)]


def wait_until(condition, what: str, deadline_s: float = WAIT_S) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f}s waiting until {what}")
        time.sleep(0.2)


# ---- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def killable_redis():
    with RedisServer() as server:   # our own: the restart test kills it
        yield server


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-data")


@pytest.fixture(scope="module")
def cluster(killable_redis, data_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("kv-key") / "kv.key"
    key_file.write_text(KEY.hex())
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, local_prefill_max_tokens=16,
                         redis_url=killable_redis.url, kv_encryption_key_file=str(key_file), data_dir=str(data_dir),
                         ready_timeout_s=240, **SMALL_WORKERS)
    with own_cluster(config, "redis-restart") as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S) as c:
        yield c


def redis_tiers(client: StrataClient) -> dict:
    """Each worker's Redis tier counters, as the router's GetCacheStats reports them."""
    return {w.worker_id: next(t for t in w.tiers if t.tier == "redis") for w in client.cache_stats(tier="redis")
            if not w.error}


def total(client: StrataClient, counter: str) -> int:
    return sum(getattr(t, counter) for t in redis_tiers(client).values())


def flush_local_tiers(client: StrataClient) -> None:
    """Device, host and disk emptied on every worker: the shared Redis tier alone holds the prefixes."""
    for tier in LOCAL_TIERS:
        results = client.flush_cache(tier=tier)
        assert results and all(r.error == "" for r in results), (tier, results)


# ---- sealed at rest ------------------------------------------------------------------------------------------------

@dataclass
class Stored:
    """A served prompt's blocks as the backends hold them, looked up by the hashes the workers give them."""

    hashes: list[BlockHash]
    fingerprint: bytes
    in_redis: list[bytes | None]
    on_disk: list[bytes | None]


def stored_objects(client: StrataClient, redis_url: str, disk: Path, prompt: list[int]) -> Stored:
    (model,) = client.models()
    kv = model.kv
    namespace = Namespace(kv.model_fingerprint, kv.kv_layout, kv.kv_dtype)
    hashes = hash_blocks(namespace, prompt, kv.block_size)
    tier = RedisTier(url=redis_url, key_prefix=RedisTierConfig().key_prefix)  # only for `key()`: the workers' keys
    raw = redis.Redis.from_url(redis_url)
    try:
        in_redis = raw.mget([tier.key(h) for h in hashes])
    finally:
        tier.close(), raw.close()
    files = [disk / h.hex()[:2] / f"{h.hex()}.kvb" for h in hashes]  # DiskTier's layout: <shard>/<hex>.kvb
    on_disk = [f.read_bytes() if f.exists() else None for f in files]
    return Stored(hashes, namespace.fingerprint(), in_redis, on_disk)


def assert_sealed(objects: list[bytes | None], stored: Stored, where: str) -> None:
    """Each object is there, sealed (no plaintext codec header, no run of its payload in clear), and opens with the
    cluster's key into the codec block of its hash."""
    sealer = Sealer(KEY)
    assert all(o is not None for o in objects), f"{where}: missing blocks"
    for h, obj in zip(stored.hashes, objects):
        assert is_sealed(obj) and codec.MAGIC not in obj, where
        block = sealer.open(h, obj)
        assert block[:4] == codec.MAGIC and len(block) < len(obj), where
        payload = bytes(codec.decode(block, stored.fingerprint, h).payload)
        assert payload[:64] not in obj, f"{where}: payload bytes stored in clear"


@pytest.mark.timeout(900)
def test_a_served_prompt_is_sealed_in_redis_and_on_disk_and_read_back_from_redis(cluster, client, killable_redis,
                                                                                  data_dir):
    prompt = make_tokens(5 * 16 + 3, seed=7)  # 5 full blocks
    first = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, include_metrics=True)
    assert (first.finish_reason, first.usage.cached_tokens) == ("length", 0)
    wait_for_background_writes(client)

    stored = stored_objects(client, killable_redis.url, data_dir / computing_worker(first) / "disk", prompt)
    assert len(stored.hashes) == 5
    assert_sealed(stored.in_redis, stored, "redis")
    assert_sealed(stored.on_disk, stored, "disk")

    flush_local_tiers(client)
    again = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, include_metrics=True)

    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == 5 * 16
    assert dict(again.metrics.timings.blocks_by_tier) == {"redis": 5}
    sealed_size, plain_size = len(stored.in_redis[0]), len(Sealer(KEY).open(stored.hashes[0], stored.in_redis[0]))
    print(f"\nsealed at rest: 5 blocks sealed in Redis and on disk, {sealed_size} B per object for a {plain_size} B "
          f"block; read back from Redis alone: {again.usage.cached_tokens} cached tokens, same {MAX_TOKENS} tokens")


# ---- Redis killed and restarted under load -------------------------------------------------------------------------

@dataclass
class Load:
    """`STREAMS` client streams, each sending requests one after the other until `stop`: three of four repeat one of
    `REPEATED` (its tokens must be the reference's), one of four is a fresh prompt (new blocks for Redis to take)."""

    address: str
    reference: dict[int, list[int]]
    stop: threading.Event = field(default_factory=threading.Event)
    done: int = 0
    failures: list[str] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stream(self, s: int) -> None:
        with StrataClient(self.address, timeout_s=WAIT_S) as client:
            n = 0
            while not self.stop.is_set():
                self.one(client, s, n)
                n += 1

    def one(self, client: StrataClient, s: int, n: int) -> None:
        i = (s + STREAMS * n) % len(REPEATED)
        fresh = n % 4 == 3
        prompt = make_tokens(40, seed=10_000 * (s + 1) + n) if fresh else REPEATED[i]
        try:
            out = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        except Exception as exc:  # noqa: BLE001 - a failed request is what this test looks for
            with self.lock:
                self.failures.append(f"stream {s} request {n}: {exc!r}")
            return
        with self.lock:
            self.done += 1
            if len(out.token_ids) != MAX_TOKENS or (not fresh and out.token_ids != self.reference[i]):
                self.mismatches.append(i)


def run_reference(address: str) -> dict[int, list[int]]:
    def one(i: int) -> list[int]:
        with StrataClient(address, timeout_s=WAIT_S) as c:
            out: Completion = c.generate(REPEATED[i], max_tokens=MAX_TOKENS, ignore_eos=True)
            assert out.finish_reason == "length"
            return out.token_ids
    with ThreadPoolExecutor(STREAMS) as pool:
        return dict(enumerate(pool.map(one, range(len(REPEATED)))))


def load_on(load: Load, at_least: int, what: str) -> None:
    """At least PHASE_S seconds and `at_least` more finished requests of load."""
    started, done = time.monotonic(), load.done
    wait_until(lambda: time.monotonic() - started >= PHASE_S and load.done >= done + at_least, what)


@pytest.mark.timeout(900)
def test_redis_killed_and_restarted_under_serving_load_fails_no_request(cluster, client, killable_redis):
    reference = run_reference(cluster.grpc_address)
    wait_for_background_writes(client)
    flush_local_tiers(client)  # the first requests of the load read their prefixes back from Redis
    hits, errors = total(client, "hit_blocks"), total(client, "errors")

    load = Load(cluster.grpc_address, reference)
    threads = [threading.Thread(target=load.stream, args=(s,), daemon=True) for s in range(STREAMS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        load_on(load, STREAMS, "requests run before the fault")
        wait_until(lambda: total(client, "hit_blocks") > hits, "the workers read prefixes from Redis")

        killable_redis.kill()  # SIGKILL
        done_at_kill = load.done
        load_on(load, STREAMS, "requests run while Redis is down")
        wait_until(lambda: total(client, "errors") > errors, "the workers count Redis errors")

        killable_redis.start()  # the same port, empty (no persistence)
        back, done_at_restart = time.monotonic(), load.done
        wait_until(lambda: all(t.healthy for t in redis_tiers(client).values()), "the Redis tiers are healthy")
        healthy_after_s = time.monotonic() - back
        written = total(client, "bytes_written")
        wait_until(lambda: total(client, "bytes_written") > written, "the workers write to Redis again")
        written_after_s = time.monotonic() - back
        load_on(load, STREAMS, "requests run after the restart")
    finally:
        load.stop.set()
        for t in threads:
            t.join(WAIT_S)
        load_s = time.monotonic() - started

    assert load.failures == [], load.failures[:5]
    assert load.mismatches == [], f"{len(load.mismatches)} repeated requests gave other tokens: {load.mismatches[:10]}"
    assert not any(t.is_alive() for t in threads)
    tiers = redis_tiers(client)
    assert len(tiers) == 2 and all(t.healthy for t in tiers.values()), tiers
    raw = redis.Redis.from_url(killable_redis.url)
    try:
        assert raw.dbsize() > 0  # blocks written after the restart
    finally:
        raw.close()
    print(f"\nredis restart under load: {load.done} requests in {load_s:.1f}s ({done_at_kill} before the kill, "
          f"{done_at_restart - done_at_kill} while Redis was down, {load.done - done_at_restart} after), 0 failed, "
          f"0 mismatched; Redis hits {total(client, 'hit_blocks') - hits}, errors {total(client, 'errors') - errors}"
          f"; every worker's Redis tier healthy {healthy_after_s:.1f}s and written again {written_after_s:.1f}s "
          f"after the restart")
