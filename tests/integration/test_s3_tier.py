"""The S3 tier against a real S3-compatible HTTP server (moto's): round trips, multipart, lookups, clear."""
from __future__ import annotations

import os

import pytest

from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.base import TIER_REGISTRY
from kvstore.tiers.s3 import S3Tier, _part_ranges
from tests.integration.conftest import s3_client

NS = Namespace("tiny-llama:abc", "L2-H4-D16-B4", "float16")
MiB = 1 << 20


def make_hashes(n: int, salt: str = "") -> list[bytes]:
    return hash_blocks(NS.with_salt(salt), list(range(n * 4)), 4)


def make_tier(server, bucket, **options) -> S3Tier:
    return S3Tier(bucket=bucket, namespace=NS, **server.client_options(), **options)


@pytest.fixture
def tier(s3_server, s3_bucket):
    t = make_tier(s3_server, s3_bucket)
    yield t
    t.close()


def test_round_trip_streams_into_caller_buffers(tier):
    hashes = make_hashes(3)
    blocks = [os.urandom(4096 + i) for i in range(3)]
    assert tier.put(list(zip(hashes, blocks))) == [True] * 3

    bufs = [memoryview(bytearray(8192)) for _ in hashes]
    assert tier.get(hashes, bufs) == [4096, 4097, 4098]
    assert [bytes(b[:len(blk)]) for b, blk in zip(bufs, blocks)] == blocks
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_written, stats.blocks) == (3, 0, 3 * 4096 + 3, 3)


def test_get_of_missing_key_is_none(tier):
    hashes = make_hashes(2)
    tier.put([(hashes[0], b"v")])
    assert tier.get(hashes, [memoryview(bytearray(4)) for _ in hashes]) == [1, None]
    assert tier.stats().misses == 1


def test_put_above_threshold_is_a_multipart_upload(s3_server, s3_bucket):
    tier = make_tier(s3_server, s3_bucket, multipart_threshold_bytes=6 * MiB, multipart_part_bytes=5 * MiB)
    h, small_h = make_hashes(2)
    big = os.urandom(12 * MiB + 123)  # parts: 5 MiB, 7 MiB + 123
    tier.put([(h, memoryview(big)), (small_h, b"small")])

    etag = s3_client(s3_server).head_object(Bucket=s3_bucket, Key=tier.key(h))["ETag"]
    assert etag.strip('"').endswith("-2")  # S3 marks a multipart object's ETag with its part count
    buf = memoryview(bytearray(13 * MiB))
    assert tier.get([h], [buf]) == [len(big)]
    assert bytes(buf[:len(big)]) == big


def test_part_ranges_cover_the_object_with_a_larger_last_part():
    assert _part_ranges(12 * MiB + 123, 5 * MiB) == [(1, 0, 5 * MiB), (2, 5 * MiB, 12 * MiB + 123)]
    assert _part_ranges(3, 5 * MiB) == [(1, 0, 3)]


@pytest.mark.parametrize("lookup", ["head", "index"])
def test_contains_is_batched_and_longest_prefix_stops_at_first_gap(s3_server, s3_bucket, lookup):
    tier = make_tier(s3_server, s3_bucket, lookup=lookup)
    hashes = make_hashes(40)
    tier.put([(h, b"v") for i, h in enumerate(hashes) if i != 25])
    assert tier.contains(hashes) == [i != 25 for i in range(40)]
    assert tier.longest_prefix(hashes) == 25


def test_index_lookup_sees_other_writers_after_refresh(s3_server, s3_bucket):
    reader = make_tier(s3_server, s3_bucket, lookup="index", index_refresh_s=3600)
    writer = make_tier(s3_server, s3_bucket)
    h = make_hashes(1)[0]
    assert reader.contains([h]) == [False]  # builds the index

    writer.put([(h, b"v")])
    assert reader.contains([h]) == [False]  # stale until the next refresh: a lost reuse, never a wrong block
    reader.refresh_index()
    assert reader.contains([h]) == [True]


def test_clear_removes_only_its_own_prefix_and_namespace(s3_server, s3_bucket):
    tier = make_tier(s3_server, s3_bucket)
    other = S3Tier(bucket=s3_bucket, namespace="other", **s3_server.client_options())
    client = s3_client(s3_server)
    client.put_object(Bucket=s3_bucket, Key="unrelated/object", Body=b"keep")
    hashes = make_hashes(5)
    tier.put([(h, b"v") for h in hashes])
    other.put([(h, b"v") for h in hashes])

    tier.clear()

    assert tier.contains(hashes) == [False] * 5
    assert other.contains(hashes) == [True] * 5
    assert client.get_object(Bucket=s3_bucket, Key="unrelated/object")["Body"].read() == b"keep"


def test_delete_counts_present_keys(tier):
    hashes = make_hashes(3)
    tier.put([(hashes[0], b"v"), (hashes[2], b"v")])
    assert tier.delete(hashes) == 2
    assert tier.contains(hashes) == [False] * 3


def test_create_bucket_makes_a_missing_bucket_and_accepts_an_existing_one(s3_server, s3_bucket):
    name = s3_bucket[:50] + "-new"
    tier = S3Tier(bucket=name, create_bucket=True, **s3_server.client_options())
    tier.put([(make_hashes(1)[0], b"v")])
    S3Tier(bucket=name, create_bucket=True, **s3_server.client_options())  # already ours: fine
    tier.clear()
    s3_client(s3_server).delete_bucket(Bucket=name)


def test_buffer_too_small_is_a_value_error(tier):
    h = make_hashes(1)[0]
    tier.put([(h, b"x" * 100)])
    with pytest.raises(ValueError, match="too small"):
        tier.get([h], [memoryview(bytearray(10))])


def test_registered_under_its_config_name_and_takes_config_options(s3_server, s3_bucket, monkeypatch):
    from dataclasses import asdict

    from kvstore.config import S3TierConfig

    opts = s3_server.client_options()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["aws_access_key_id"])  # credentials from the usual places
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["aws_secret_access_key"])
    config = S3TierConfig(bucket=s3_bucket, endpoint_url=opts["endpoint_url"], region=opts["region"])
    tier = TIER_REGISTRY["s3"](**asdict(config))
    h = make_hashes(1)[0]
    tier.put([(h, b"v")])
    assert tier.contains([h]) == [True]


@pytest.mark.parametrize("bad, match", [({"bucket": "x"}, "bucket"), ({"lookup": "scan"}, "lookup"),
                                        ({"multipart_part_bytes": MiB}, "multipart_part_bytes")])
def test_bad_options_are_rejected_with_what_is_allowed(bad, match):
    options = {"bucket": "strata-test", **bad}
    with pytest.raises(ValueError, match=match):
        S3Tier(**options)
