"""S3 faults in each layout (tests/integration/test_remote_faults.py covers the default one): a stopped server
makes every call raise `TierUnavailable` promptly and the tier recovers; a missing bucket is absent for lookups
and an error for reads and writes; an erroring server is retried a bounded number of times. Then what only the
pack layout does: a failed refresh suspends its index, so nothing is claimed and nothing is skipped."""
from __future__ import annotations

import time

import pytest

from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.base import TierUnavailable
from kvstore.tiers.s3 import S3Tier
from tests.integration.conftest import s3_client
from tests.integration.test_remote_faults import _ErroringS3, assert_all_ops_unavailable, within

NS = Namespace("tiny-llama:abc", "L2-H4-D16-B4", "float16")
PROMPT = 5.0


def make_hashes(n: int) -> list[bytes]:
    return hash_blocks(NS, list(range(n * 4)), 4)


def make_tier(server, bucket, **options) -> S3Tier:
    return S3Tier(bucket=bucket, namespace=NS, connect_timeout_s=0.5, read_timeout_s=1.0,
                  **server.client_options(), **options)


@pytest.mark.parametrize("layout", ["pack", "block"])
def test_stopped_server_raises_unavailable_promptly_then_recovers(fresh_s3_server, layout):
    tier = make_tier(fresh_s3_server, "strata-faults", create_bucket=True, layout=layout)
    hashes = make_hashes(3)
    tier.put([(h, b"v") for h in hashes])

    fresh_s3_server.kill()
    assert_all_ops_unavailable(tier, hashes)
    assert tier.stats().errors == 3 and not tier.stats().healthy

    fresh_s3_server.start()  # empty: moto keeps nothing across a restart
    s3_client(fresh_s3_server).create_bucket(Bucket="strata-faults")
    assert tier.contains(hashes) == [False] * 3
    tier.put([(hashes[0], b"v")])
    assert tier.contains(hashes[:1]) == [True] and tier.stats().healthy


@pytest.mark.parametrize("layout", ["pack", "block"])
def test_missing_bucket_is_absent_for_lookups_and_unavailable_for_reads_and_writes(s3_server, s3_bucket, layout):
    tier = make_tier(s3_server, s3_bucket, layout=layout)
    hashes = make_hashes(2)
    tier.put([(hashes[0], b"v")])
    client = s3_client(s3_server)
    client.delete_object(Bucket=s3_bucket, Key=tier.key(hashes[0]))
    client.delete_bucket(Bucket=s3_bucket)

    for op in (lambda: tier.put([(hashes[1], b"v")]), lambda: tier.get(hashes[:1], [memoryview(bytearray(8))])):
        with within(PROMPT), pytest.raises(TierUnavailable, match="NoSuchBucket"):
            op()
    assert tier.contains(hashes) == [False, False]


@pytest.mark.parametrize("layout", ["pack", "block"])
def test_erroring_server_is_unavailable_after_bounded_retries(layout):
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ErroringS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tier = S3Tier(bucket="strata-errors", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                      region="us-east-1", aws_access_key_id="k", aws_secret_access_key="s", max_attempts=2,
                      connect_timeout_s=0.5, read_timeout_s=1.0, layout=layout)
        _ErroringS3.calls = 0
        assert_all_ops_unavailable(tier, make_hashes(2))
        assert 3 <= _ErroringS3.calls <= 3 * 2 * 2
    finally:
        server.shutdown()
        server.server_close()


def test_pack_index_is_suspended_by_a_failed_refresh_until_one_succeeds(fresh_s3_server):
    """While S3 cannot be listed the index claims nothing, and a put writes (and fails loudly) instead of
    trusting what it knew: the server may have lost the packs, as this one does."""
    tier = make_tier(fresh_s3_server, "strata-suspend", create_bucket=True, index_refresh_s=3600)
    hashes = make_hashes(2)
    tier.put([(hashes[0], b"v")])
    assert tier.contains(hashes) == [True, False]

    fresh_s3_server.kill()
    with within(PROMPT), pytest.raises(TierUnavailable):
        tier.refresh_index()
    assert tier.stats().blocks == 1  # kept, so a recovered refresh need not read every pack again
    with within(PROMPT), pytest.raises(TierUnavailable):
        tier.contains(hashes)  # suspended: each lookup tries to refresh
    with within(PROMPT), pytest.raises(TierUnavailable):
        tier.put([(hashes[0], b"v")])  # not skipped as present

    fresh_s3_server.start()
    s3_client(fresh_s3_server).create_bucket(Bucket="strata-suspend")
    time.sleep(0.1)
    assert tier.contains(hashes) == [False, False]  # the refresh found the packs gone
    assert tier.put([(hashes[0], b"v")]) == [True] and tier.contains(hashes) == [True, False]
