"""Per-tenant Redis quotas under serving load (issue 15: "per-tenant quotas hold under load, end to end").

Real processes (`strata serve`'s launcher, the bundled model): a router with two tenants' API keys, one prefill and
one decode worker, a real `redis-server` started here on a free loopback port as their shared tier, and
`tier_quota_bytes` = `QUOTA_BLOCKS` blocks' worth per namespace. Every request of a tenant is salted into the
tenant's own namespace (`router.validation.effective_salt`), so each tenant has its own counter in Redis
(`kvstore/tiers/redis_quota.py`).

Tenant "alpha" runs `A_STREAMS` concurrent streams of distinct 5-block prompts, far more new blocks than its quota;
tenant "beta" runs `B_STREAMS` streams meanwhile, fewer blocks than its quota. Afterwards:
- alpha's bytes in Redis (its counter, and the sum of its keys' sizes read back) are at most the quota, and the
  router's cache stats (`GetCacheStats`, tier "redis") count refused writes;
- no request failed (a refused write is a cache miss later, never an error);
- every one of beta's blocks is in Redis and its counter is exactly their bytes: alpha's refusals cost beta nothing.

Waits are polls under generous deadlines; nothing depends on how fast a loaded machine runs.
"""
from __future__ import annotations

import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import redis

from kvstore.config import RedisTierConfig
from kvstore.hashing import BlockHash, Namespace, hash_blocks
from kvstore.tiers import redis_quota
from kvstore.tiers.redis import RedisTier
from router.validation import effective_salt
from strata.client import StrataClient
from strata.devservers import RedisServer
from strata.launcher import ServeConfig
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from tests.e2e.test_store_every_tier_e2e import dropped_writes, wait_for_background_writes

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

BLOCK_BYTES = 66_000      # an upper bound of one encoded block of the bundled model (~65.7 KB)
QUOTA_BLOCKS = 12
QUOTA = QUOTA_BLOCKS * BLOCK_BYTES
KEYS = {"alpha": "key-alpha-0123456789", "beta": "key-beta-9876543210"}
A_STREAMS, A_REQUESTS, A_BLOCKS = 4, 5, 5     # 100 new blocks: ~8x the quota
B_STREAMS, B_REQUESTS, B_BLOCKS = 2, 2, 2     # 8 new blocks: under the quota
MAX_TOKENS = 4
WAIT_S = 120.0


def make_prompt(tenant: str, stream: int, n: int, blocks: int) -> list[int]:
    """Distinct per (tenant, stream, n): `blocks` full blocks and 3 tokens more (no block completes in decode)."""
    return random.Random(f"{tenant}/{stream}/{n}").choices(range(20, 250), k=blocks * 16 + 3)


# ---- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(own_redis, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("api-keys") / "keys.txt"
    keys_file.write_text("".join(f"{tenant}:{key}\n" for tenant, key in KEYS.items()))
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, local_prefill_max_tokens=16,
                         redis_url=own_redis.url, tier_quota_bytes=QUOTA, api_keys_file=str(keys_file),
                         ready_timeout_s=240, **SMALL_WORKERS)
    with own_cluster(config, "tenant-quota") as c:
        yield c


# ---- what Redis holds ----------------------------------------------------------------------------------------------

@dataclass
class Tenants:
    """Each tenant's namespace as the workers key it: the model's, salted from the tenant (`tenant:<name>`)."""

    namespaces: dict[str, Namespace]
    block_size: int

    @classmethod
    def of(cls, client: StrataClient) -> "Tenants":
        (model,) = client.models()
        kv = model.kv
        public = Namespace(kv.model_fingerprint, kv.kv_layout, kv.kv_dtype)
        return cls({t: public.with_salt(effective_salt("", f"tenant:{t}", isolated=True)) for t in KEYS},
                   kv.block_size)

    def hashes(self, tenant: str, prompt: list[int]) -> list[BlockHash]:
        return hash_blocks(self.namespaces[tenant], prompt, self.block_size)


def redis_view(url: str) -> tuple[RedisTier, redis.Redis]:
    """A tier for its key names only (the workers' prefix and namespace) and a raw client."""
    return RedisTier(url=url, key_prefix=RedisTierConfig().key_prefix), redis.Redis.from_url(url)


def bytes_by_namespace(url: str) -> dict[bytes, tuple[int, int]]:
    """(blocks, bytes) of every namespace's keys, read back from Redis (SCAN, the fingerprint at offset 12)."""
    tier, raw = redis_view(url)
    try:
        counters = (tier.key_base + redis_quota.QUOTA_TAG).encode()
        names = [k for k in raw.scan_iter(match=f"{tier.key_base}*", count=1000) if not k.startswith(counters)]
        with raw.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.getrange(name, *redis_quota.FINGERPRINT_RANGE)
                pipe.strlen(name)
            replies = pipe.execute()
    finally:
        tier.close(), raw.close()
    usage: dict[bytes, tuple[int, int]] = {}
    for fingerprint, size in zip(replies[::2], replies[1::2]):
        blocks, total = usage.get(fingerprint, (0, 0))
        usage[fingerprint] = (blocks + 1, total + size)
    return usage


def counter(url: str, namespace: Namespace) -> int:
    tier, raw = redis_view(url)
    try:
        return tier.namespace_usage(namespace.fingerprint())
    finally:
        tier.close(), raw.close()


def blocks_present(url: str, hashes: list[BlockHash]) -> int:
    tier, raw = redis_view(url)
    try:
        return int(raw.exists(*[tier.key(h) for h in hashes])) if hashes else 0
    finally:
        tier.close(), raw.close()


def quota_refused(client: StrataClient) -> int:
    """The Redis tiers' refused writes, summed over the workers, as the router reports them."""
    stats = client.cache_stats(tier="redis")
    assert stats and all(w.error == "" for w in stats), stats
    return sum(t.quota_refused for w in stats for t in w.tiers if t.tier == "redis")


# ---- load ----------------------------------------------------------------------------------------------------------

@dataclass
class TenantLoad:
    """`streams` concurrent streams of one tenant, each sending `requests` distinct prompts one after the other."""

    address: str
    tenant: str
    streams: int
    requests: int
    blocks: int
    prompts: list[list[int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stream(self, s: int) -> None:
        with StrataClient(self.address, timeout_s=WAIT_S, api_key=KEYS[self.tenant]) as client:
            for n in range(self.requests):
                prompt = make_prompt(self.tenant, s, n, self.blocks)
                try:
                    out = client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                    assert len(out.token_ids) == MAX_TOKENS, out
                except Exception as exc:  # noqa: BLE001 - a failed request is what this test looks for
                    with self.lock:
                        self.failures.append(f"{self.tenant} stream {s} request {n}: {exc!r}")
                    continue
                with self.lock:
                    self.prompts.append(prompt)


def run_loads(*loads: TenantLoad) -> None:
    """Every stream of every load at once, until all have sent their requests."""
    jobs = [(load, s) for load in loads for s in range(load.streams)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(load.stream, s) for load, s in jobs]:
            future.result(timeout=600)


# ---- test ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(900)
def test_a_tenant_past_its_quota_under_load_is_capped_fails_nothing_and_costs_the_other_tenant_nothing(
        cluster, own_redis):
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S, api_key=KEYS["alpha"]) as admin:
        tenants = Tenants.of(admin)
        refused_before = quota_refused(admin)
        alpha = TenantLoad(cluster.grpc_address, "alpha", A_STREAMS, A_REQUESTS, A_BLOCKS)
        beta = TenantLoad(cluster.grpc_address, "beta", B_STREAMS, B_REQUESTS, B_BLOCKS)
        run_loads(alpha, beta)
        wait_for_background_writes(admin)
        refused = quota_refused(admin) - refused_before

    assert alpha.failures == [] and beta.failures == [], (alpha.failures + beta.failures)[:5]
    assert len(alpha.prompts) == A_STREAMS * A_REQUESTS and len(beta.prompts) == B_STREAMS * B_REQUESTS
    usage = bytes_by_namespace(own_redis.url)
    a_ns, b_ns = tenants.namespaces["alpha"], tenants.namespaces["beta"]
    assert set(usage) <= {a_ns.fingerprint(), b_ns.fingerprint()}, f"namespaces in Redis: {sorted(usage)}"
    a_blocks, a_bytes = usage.get(a_ns.fingerprint(), (0, 0))
    b_blocks, b_bytes = usage.get(b_ns.fingerprint(), (0, 0))

    # alpha: capped at its quota, the rest refused and counted
    a_written = A_STREAMS * A_REQUESTS * A_BLOCKS
    assert 0 < a_bytes <= QUOTA and counter(own_redis.url, a_ns) == a_bytes
    assert a_blocks < a_written and refused > 0

    # beta: every block stored, counted exactly
    b_hashes = [h for p in beta.prompts for h in tenants.hashes("beta", p)]
    assert len(b_hashes) == B_STREAMS * B_REQUESTS * B_BLOCKS
    assert blocks_present(own_redis.url, b_hashes) == b_blocks == len(b_hashes), dropped_writes(admin)
    assert counter(own_redis.url, b_ns) == b_bytes <= QUOTA
    block_bytes = b_bytes // b_blocks
    print(f"\ntenant quota under load: quota {QUOTA} B ({QUOTA_BLOCKS} x {BLOCK_BYTES} B; a block is {block_bytes} B);"
          f" alpha sent {A_STREAMS * A_REQUESTS} requests on {A_STREAMS} streams = {a_written} new blocks "
          f"({a_written * block_bytes} B): {a_blocks} blocks / {a_bytes} B stored, {refused} writes refused; "
          f"beta sent {B_STREAMS * B_REQUESTS} requests on {B_STREAMS} streams: all {b_blocks} blocks / {b_bytes} B "
          f"stored; 0 requests failed")
