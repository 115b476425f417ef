"""`strata cache evict|flush` on the shared tiers, through the real path: the operator CLI in its own process, the
router, two worker processes, a real redis-server and moto's S3 server.

A shared tier is one backend for every worker, so the router asks one worker: one result (`shared`, naming that
worker), counted once, as what the backend actually removed, within the CLI's deadline for thousands of hashes.
Local tiers still answer per worker. `cache stats --json` carries each tier's `dropped` writes and each worker's
`pending_writes`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvstore.tiers.redis import RedisTier
from kvstore.tiers.s3 import S3Tier
from strata.devservers import RedisServer, S3Server
from strata.launcher import REPO_ROOT, ServeConfig
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

BUCKET = "strata-admin-e2e"
WORKERS = {"prefill-0", "decode-0"}
NUM_HASHES, NUM_HELD = 2000, 1200


def make_hashes(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def run_cli(*args: str, stdin: str | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=timeout_s, cwd=REPO_ROOT)


def cli_json(*args: str, stdin: str | None = None):
    out = run_cli(*args, stdin=stdin)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def servers():
    with RedisServer() as redis_server, S3Server() as s3_server:
        yield redis_server, s3_server


@pytest.fixture(scope="module")
def cluster(servers):
    redis_server, s3_server = servers
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": s3_server.region}
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, redis_url=redis_server.url,
                         s3_url=f"{s3_server.url}/{BUCKET}", ready_timeout_s=240, **SMALL_WORKERS)
    with own_cluster(config, "shared-admin", env=env) as c:
        yield c


@pytest.fixture(scope="module")
def tiers(servers, cluster):
    """The workers' shared tiers, reached directly (same URL, prefix and namespace) to fill and inspect them."""
    redis_server, s3_server = servers
    redis_tier = RedisTier(url=redis_server.url)
    s3_tier = S3Tier(bucket=BUCKET, prefix="strata/kv/", **s3_server.client_options())
    yield {"redis": redis_tier, "s3": s3_tier}
    redis_tier.close(), s3_tier.close()


def fill(tier, hashes: list[bytes]) -> None:
    tier.put([(h, b"kv" * 32) for h in hashes])


def test_evicting_2000_hashes_from_redis_acts_once_and_counts_what_redis_removed(cluster, tiers):
    hashes = make_hashes(NUM_HASHES)
    fill(tiers["redis"], hashes[:NUM_HELD])
    args = [a for h in hashes for a in ("--hash", h.hex())]

    results = cli_json("cache", "evict", "--tier", "redis", *args, "--json", "--router", cluster.grpc_address)

    assert len(results) == 1, results
    (result,) = results
    assert result["worker_id"] in WORKERS and result["shared"] and result["tier"] == "redis"
    assert (result["blocks_removed"], result["error"]) == (NUM_HELD, "")
    assert not any(tiers["redis"].contains(hashes))


def test_evicting_2000_hashes_from_s3_acts_once_and_counts_what_s3_removed(cluster, tiers):
    hashes = make_hashes(NUM_HASHES)
    fill(tiers["s3"], hashes[:NUM_HELD])
    listed = "\n".join(h.hex() for h in hashes) + "\n"

    results = cli_json("cache", "evict", "--tier", "s3", "--hashes-from", "-", "--json",
                       "--router", cluster.grpc_address, stdin=listed)

    assert len(results) == 1, results
    (result,) = results
    assert result["worker_id"] in WORKERS and result["shared"] and result["tier"] == "s3"
    assert (result["blocks_removed"], result["error"]) == (NUM_HELD, "")
    assert not any(tiers["s3"].contains(hashes))


@pytest.mark.parametrize("tier, held", [("redis", 700), ("s3", 300)])
def test_flushing_a_shared_tier_empties_it_once_and_counts_its_objects(cluster, tiers, tier, held):
    fill(tiers[tier], make_hashes(held))

    results = cli_json("cache", "flush", "--tier", tier, "--yes", "--json", "--router", cluster.grpc_address)

    assert [(r["tier"], r["shared"], r["blocks_removed"], r["error"]) for r in results] == [(tier, True, held, "")]
    assert results[0]["worker_id"] in WORKERS


def test_local_tiers_still_answer_per_worker(cluster):
    results = cli_json("cache", "evict", "--tier", "host", "--bytes", "1", "--json", "--router", cluster.grpc_address)
    assert sorted((r["worker_id"], r["tier"], r["shared"], r["error"]) for r in results) == [
        ("decode-0", "host", False, ""), ("prefill-0", "host", False, "")]


def test_stats_json_carries_dropped_writes_per_tier_and_pending_writes_per_worker(cluster):
    data = cli_json("cache", "stats", "--json", "--router", cluster.grpc_address)
    assert {w["worker_id"] for w in data["workers"]} == WORKERS
    for worker in data["workers"]:
        assert isinstance(worker["pending_writes"], int) and worker["pending_writes"] >= 0
        assert [t["tier"] for t in worker["tiers"]] == ["device", "host", "disk", "redis", "s3"]
        assert all(isinstance(t["dropped"], int) and t["dropped"] >= 0 for t in worker["tiers"])
    assert "dropped" in data["totals"] and "pending_writes" in data["totals"]
    table = run_cli("cache", "stats", "--router", cluster.grpc_address)
    assert table.returncode == 0 and "dropped" in table.stdout and "pending background writes" in table.stdout
