"""A prompt's full blocks reach every tier of the store: host, disk, Redis and S3, whatever the request's length.

Real processes (`strata serve`'s launcher): a router, one prefill and one decode worker on a tiny Llama checkpoint
built here whose positions reach past 4,096 tokens (the bundled models stop at 2,048), with host and disk tiers, a
real `redis-server` and moto's S3 server, both started here on free loopback ports. After a request finishes, the
test waits until no worker owes a background write, then looks for each block, by the hash the workers give it
(`kvstore.hashing.hash_blocks` under the namespace the router reports in `ListModels`), in each backend directly:

    host    the worker's own EvictCache by hash: it deletes the hashes its host tier holds and counts them
            (so this check goes last)
    disk    a `DiskTier` over the worker's disk folder (`<data_dir>/<worker id>/disk`), which indexes its files
    redis   EXISTS on each block's key (as a `RedisTier` configured like the workers' names it)
    s3      an `S3Tier` with the workers' bucket, prefix and namespace, its index refreshed from LIST

Host and disk are the worker's that computed the prompt (the prefill worker; the decode worker when it prefilled
the prompt itself); Redis and S3 are shared by both. The router's HTTP port is on only for its /metrics, where the
S3 test reads how many KV-event batches the router applied before it routes.
"""
from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvstore.config import RedisTierConfig
from kvstore.hashing import BlockHash, Namespace, hash_blocks
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.s3 import S3Tier
from strata.client import Completion, StrataClient
from strata.devservers import RedisServer, S3Server
from strata.launcher import ServeConfig
from tests.conftest import TINY_COMMON, build_checkpoint_of, write_tokenizer
from tests.e2e.own_cluster import own_cluster
from tests.e2e.test_routing_cached_prefix_e2e import wait_until_the_router_follows
from worker_common.store_setup import s3_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

BLOCK = 16
MAX_MODEL_LEN = 4352            # room for 4,000 prompt tokens and a few more
VOCAB = TINY_COMMON["vocab_size"]
BUCKET = "strata-every-tier-e2e"
TIERS = ("host", "disk", "redis", "s3")
WAIT_S = 300.0                  # generous: a loaded 2-core machine runs three model processes and two servers here


def make_prompt(num_tokens: int, seed: int) -> list[int]:
    """Token ids past the special ones (0-2: unk, bos, eos), so nothing in the prompt ends it."""
    return random.Random(seed).choices(range(3, VOCAB), k=num_tokens)


@dataclass
class Backends:
    """The store's backends, reached directly, and the facts needed to find a prompt's blocks in them."""

    client: StrataClient
    namespace: Namespace
    block_size: int
    data_dir: Path
    redis_client: redis.Redis
    redis_tier: RedisTier        # only for `key()`: the key format the workers' Redis tier uses
    s3_tier: S3Tier

    def hashes(self, prompt: list[int]) -> list[BlockHash]:
        """Every full block of `prompt`, hashed as the workers and the router hash it."""
        return hash_blocks(self.namespace, prompt, self.block_size)

    def held(self, worker_id: str, hashes: list[BlockHash]) -> dict[str, int]:
        """How many of `hashes` each tier holds: `worker_id`'s host and disk, the shared Redis and S3."""
        below = {"disk": self.on_disk(worker_id, hashes), "redis": self.in_redis(hashes), "s3": self.in_s3(hashes)}
        return {"host": self.in_host(worker_id, hashes), **below}  # NOTE: host last: its check deletes what it counts

    def in_host(self, worker_id: str, hashes: list[BlockHash]) -> int:
        """The host tier lives in the worker's memory: its EvictCache by hash deletes the hashes the tier holds and
        counts exactly those."""
        results = self.client.evict_cache(worker_id=worker_id, tier="host", block_hashes=hashes)
        assert [(r.worker_id, r.tier, r.error) for r in results] == [(worker_id, "host", "")], results
        return results[0].blocks_removed

    def on_disk(self, worker_id: str, hashes: list[BlockHash]) -> int:
        # NOTE: a second DiskTier over a live worker's folder is safe once no write is pending: building its index
        # deletes only temporary files of writes in progress, and there are none.
        tier = DiskTier(str(self.data_dir / worker_id / "disk"), capacity_bytes=1 << 40, io_threads=1)
        try:
            return sum(tier.contains(hashes))
        finally:
            tier.close()

    def in_redis(self, hashes: list[BlockHash]) -> int:
        pipe = self.redis_client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self.redis_tier.key(h))
        return sum(pipe.execute())

    def in_s3(self, hashes: list[BlockHash]) -> int:
        self.s3_tier.refresh_index()
        return sum(self.s3_tier.contains(hashes))


# ---- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama whose positions reach MAX_MODEL_LEN, with a tokenizer that names every one of its ids."""
    folder = tmp_path_factory.mktemp("long-llama")
    build_checkpoint_of("LlamaConfig", {"max_position_embeddings": MAX_MODEL_LEN}, folder, seed=3)
    write_tokenizer(folder, [f"w{i}" for i in range(VOCAB - 3)])  # 3 special tokens + the rest: every id decodes
    return folder


@pytest.fixture(scope="module")
def servers():
    with RedisServer() as redis_server, S3Server() as s3_server:
        yield redis_server, s3_server


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-data")


@pytest.fixture(scope="module")
def cluster(checkpoint, servers, data_dir):
    redis_server, s3_server = servers
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": s3_server.region}
    length = ("--max-model-len", str(MAX_MODEL_LEN))
    config = ServeConfig(model=str(checkpoint), prefill=1, decode=1, grpc_port=0, http_port=0,
                         local_prefill_max_tokens=64, num_blocks=640, host_tier_mib=64, handoff_mib=32,
                         data_dir=str(data_dir), redis_url=redis_server.url, s3_url=f"{s3_server.url}/{BUCKET}",
                         worker_args=length, router_args=length, ready_timeout_s=240)
    with own_cluster(config, "every-tier", env=env) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S) as c:
        yield c


@pytest.fixture(scope="module")
def backends(client, servers, data_dir):
    redis_server, s3_server = servers
    (model,) = client.models()
    kv = model.kv
    s3 = s3_config(f"{s3_server.url}/{BUCKET}")  # the bucket and prefix the workers derive from --s3-url
    redis_client = redis.Redis.from_url(redis_server.url)
    redis_tier = RedisTier(url=redis_server.url, key_prefix=RedisTierConfig().key_prefix)
    # NOTE: a long refresh budget: on a loaded machine, reading every pack's index may take more than the default 2 s
    s3_tier = S3Tier(bucket=s3.bucket, prefix=s3.prefix, refresh_budget_s=WAIT_S, **s3_server.client_options())
    yield Backends(client, Namespace(kv.model_fingerprint, kv.kv_layout, kv.kv_dtype), kv.block_size, data_dir,
                   redis_client, redis_tier, s3_tier)
    s3_tier.close(), redis_tier.close(), redis_client.close()


# ---- helpers -------------------------------------------------------------------------------------------------------

def wait_for_background_writes(client: StrataClient, timeout_s: float = WAIT_S) -> None:
    """Until no worker owes a background write (each block reached every lower tier, or was counted dropped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.cache_stats()
        pending = {w.worker_id: (w.pending_writes, w.error) for w in stats}
        if len(stats) == 2 and all(p == (0, "") for p in pending.values()):
            return
        assert time.monotonic() < deadline, f"background writes still pending after {timeout_s:.0f}s: {pending}"
        time.sleep(0.2)


def dropped_writes(client: StrataClient) -> dict[tuple[str, str], int]:
    return {(w.worker_id, t.tier): t.dropped for w in client.cache_stats() for t in w.tiers if t.dropped}


def computing_worker(out: Completion) -> str:
    """The worker that computed the prompt: the prefill worker, or the decode worker when it prefilled it itself."""
    return out.metrics.prefill_worker_id or out.metrics.decode_worker_id


def serve_and_settle(client: StrataClient, prompt: list[int], max_tokens: int) -> Completion:
    out = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, include_metrics=True)
    assert (out.finish_reason, len(out.token_ids)) == ("length", max_tokens)
    assert (out.usage.prompt_tokens, out.usage.cached_tokens) == (len(prompt), 0)  # a fresh prompt: all computed
    wait_for_background_writes(client)
    return out


def assert_in_every_tier(backends: Backends, worker_id: str, prompt: list[int], num_blocks: int) -> None:
    hashes = backends.hashes(prompt)
    assert len(hashes) == num_blocks
    held = backends.held(worker_id, hashes)
    assert held == dict.fromkeys(TIERS, num_blocks), (
        f"of the prompt's {num_blocks} full blocks, {worker_id}'s tiers and the shared ones hold {held}; "
        f"writes counted dropped: {dropped_writes(backends.client)}")


# ---- tests ---------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(1200)
def test_a_4000_token_prompt_reaches_every_tier(cluster, client, backends):
    assert backends.block_size == BLOCK
    prompt = make_prompt(4000, seed=1)

    out = serve_and_settle(client, prompt, max_tokens=4)

    assert_in_every_tier(backends, computing_worker(out), prompt, num_blocks=250)


@pytest.mark.timeout(1200)
def test_a_max_tokens_1_request_stores_its_blocks_below_the_device(cluster, client, backends):
    """The first token ends the request on the worker that prefilled it: no KV is handed to a decode worker, yet the
    prompt's blocks still go to the store, every tier of it."""
    prompt = make_prompt(1000, seed=2)

    out = serve_and_settle(client, prompt, max_tokens=1)

    assert_in_every_tier(backends, computing_worker(out), prompt, num_blocks=62)


@pytest.mark.timeout(1200)
def test_a_prefix_in_s3_only_is_found_by_the_other_worker(cluster, client, backends):
    """Once device, host, disk and Redis are flushed on every worker, S3 alone holds the prefix: the worker that
    serves the prompt next reads every full block from there. The prompt comes back with one more token, so all of
    its 250 full blocks can be taken from a cache (a request's last token is always computed); with one token left to
    compute, the router prefills it on the decode worker (conditional disaggregation), which never computed it."""
    prompt = make_prompt(4000, seed=3)
    first = serve_and_settle(client, prompt, max_tokens=2)
    assert backends.in_s3(backends.hashes(prompt)) == 250
    for tier in ("device", "host", "disk", "redis"):
        results = client.flush_cache(tier=tier)
        assert results and all(r.error == "" for r in results), (tier, results)
    for worker in ("prefill-0", "decode-0"):  # the router knows what S3 holds and what left the other tiers
        wait_until_the_router_follows(cluster, client, worker)

    again = client.generate(prompt + [7], max_tokens=2, ignore_eos=True, include_metrics=True)

    assert again.finish_reason == "length"
    assert again.usage.cached_tokens == 250 * BLOCK
    assert dict(again.metrics.timings.blocks_by_tier) == {"s3": 250}
    assert (computing_worker(first), computing_worker(again)) == ("prefill-0", "decode-0")
