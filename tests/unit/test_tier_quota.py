"""Per-namespace byte quotas of the shared tiers: config validation, and the S3 tier's accounting against an
in-process S3 (moto's `mock_aws`): per namespace, refused and counted past the quota, bytes given back when a
pack goes, seeded by another process's packs from the listing. (The Redis tier's counters live in Redis itself:
tests/integration/test_tier_quota.py runs them against a real redis-server.)"""
from __future__ import annotations

import pytest

from kvstore import codec
from kvstore.config import RedisTierConfig, S3TierConfig
from kvstore.hashing import hash_blocks
from kvstore.tiers.s3 import S3Tier, _pack_namespace
from tests.integration.store_factories import LAYOUT, NS, TOKENS

TENANT = NS.with_salt("tenant-a")  # its own namespace; NS itself is the public (salt-free) one


def make_blocks(namespace, n: int) -> list[tuple[bytes, bytes]]:
    fp, hashes = namespace.fingerprint(), hash_blocks(namespace, TOKENS, 4)[:n]
    return [(h, codec.encode(fp, h, LAYOUT, "float16", bytes([i + 1]) * LAYOUT.payload_bytes("float16")))
            for i, h in enumerate(hashes)]


BLOCK = len(make_blocks(NS, 1)[0][1])


@pytest.fixture
def s3(monkeypatch):
    moto = pytest.importorskip("moto")
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    with moto.mock_aws():
        yield lambda **kw: S3Tier("quota-test", region="us-east-1", create_bucket=True, index_refresh_s=0, **kw)


def test_quota_configs_validate_their_fields():
    with pytest.raises(ValueError, match="redis.quota_bytes must be >= 0"):
        RedisTierConfig(quota_bytes=-1)
    with pytest.raises(ValueError, match="cluster=False"):
        RedisTierConfig(quota_bytes=1, cluster=True)
    with pytest.raises(ValueError, match="layout='pack'"):
        S3TierConfig(bucket="abc", quota_bytes=1, layout="block")


def test_pack_names_carry_their_namespace_only_with_a_quota():
    assert _pack_namespace("p/ns/packs/abcd.0011-2-ff") == "abcd"
    assert _pack_namespace("p/ns/packs/0011-2-ff") == ""


def test_s3_refuses_and_counts_writes_past_a_namespaces_quota_per_namespace(s3):
    tier = s3(quota_bytes=3 * BLOCK)
    assert tier.put(make_blocks(NS, 5)) == [True, True, True, False, False]
    assert tier.put(make_blocks(TENANT, 2)) == [True, True]  # another namespace: its own quota
    assert tier.put(make_blocks(NS, 3)) == [True, True, True]  # already stored: no new bytes
    stats = tier.stats()
    assert stats.quota_refused == 2 and stats.blocks == 5


def test_s3_deleting_a_namespaces_packs_gives_its_bytes_back(s3):
    tier = s3(quota_bytes=2 * BLOCK)
    blocks = make_blocks(NS, 4)
    assert tier.put(blocks[:2]) == [True, True]
    assert tier.put(blocks[2:3]) == [False]
    assert tier.delete([h for h, _ in blocks[:2]]) == 2
    assert tier.put(blocks[2:4]) == [True, True]


def test_s3_quota_counts_another_processes_packs_after_a_refresh(s3):
    first, second = s3(quota_bytes=3 * BLOCK), s3(quota_bytes=3 * BLOCK)
    blocks = make_blocks(TENANT, 4)
    assert first.put(blocks[:3]) == [True] * 3
    second.refresh_index()
    assert second.put(blocks[3:]) == [False] and second.stats().quota_refused == 1
