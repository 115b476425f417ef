"""Faults in the remote tiers against real servers: a killed or frozen redis-server, a stopped or erroring S3
server, a deleted bucket, a flipped bit. The tiers must fail fast with `TierUnavailable` (never hang, never
return a library error), recover when the server does, and return stored bytes as they are (verification is the
store's job; the last tests show the store rejecting the flipped copy)."""
from __future__ import annotations

import http.server
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import redis

from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.base import TierUnavailable
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.s3 import S3Tier
from tests.integration.conftest import s3_client

NS = Namespace("tiny-llama:abc", "L2-H4-D16-B4", "float16")
PROMPT = 5.0  # seconds: any failure must surface well within this


def make_hashes(n: int) -> list[bytes]:
    return hash_blocks(NS, list(range(n * 4)), 4)


@contextmanager
def within(seconds: float):
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    assert elapsed < seconds, f"took {elapsed:.2f}s, expected under {seconds}s"


def assert_all_ops_unavailable(tier, hashes) -> None:
    for op in (lambda: tier.contains(hashes), lambda: tier.put([(hashes[0], b"v")]),
               lambda: tier.get(hashes[:1], [memoryview(bytearray(8))])):
        with within(PROMPT), pytest.raises(TierUnavailable):
            op()


# -------------------------------------------------------------------------------------------------- Redis

def test_redis_killed_mid_run_raises_unavailable_promptly_then_recovers(fresh_redis_server):
    tier = RedisTier(url=fresh_redis_server.url, namespace=NS, connect_timeout_s=0.5, socket_timeout_s=0.5)
    hashes = make_hashes(4)
    tier.put([(h, b"v") for h in hashes])
    assert tier.contains(hashes) == [True] * 4

    fresh_redis_server.kill()
    assert_all_ops_unavailable(tier, hashes)
    stats = tier.stats()
    assert stats.errors == 3 and not stats.healthy

    fresh_redis_server.start()  # same port, empty (no persistence)
    assert tier.contains(hashes) == [False] * 4
    assert tier.put([(hashes[0], b"again")]) == [True]
    assert tier.contains(hashes[:1]) == [True] and tier.stats().healthy


def test_redis_frozen_server_times_out_instead_of_hanging(fresh_redis_server):
    """SIGSTOP: the kernel still accepts connections but nothing answers; only the socket timeout saves us."""
    tier = RedisTier(url=fresh_redis_server.url, namespace=NS, connect_timeout_s=0.5, socket_timeout_s=0.5,
                     retries=0)
    h = make_hashes(1)
    tier.put([(h[0], b"v")])
    os.kill(fresh_redis_server.pid, signal.SIGSTOP)
    try:
        with within(3.0), pytest.raises(TierUnavailable):
            tier.contains(h)
    finally:
        os.kill(fresh_redis_server.pid, signal.SIGCONT)
    time.sleep(0.1)
    assert tier.contains(h) == [True]


def test_redis_never_started_is_unavailable_not_an_error_at_construction():
    from strata.devservers import free_port

    tier = RedisTier(url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5)
    with within(PROMPT), pytest.raises(TierUnavailable):
        tier.contains(make_hashes(1))


def test_redis_bit_flip_is_returned_as_is_by_the_tier(redis_server, redis_key_prefix):
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS)
    h = make_hashes(1)[0]
    original = bytes(range(256)) * 4
    tier.put([(h, original)])
    raw = redis.Redis.from_url(redis_server.url)
    flipped = bytearray(original)
    flipped[100] ^= 0x10
    raw.setrange(tier.key(h), 100, bytes(flipped[100:101]))

    buf = memoryview(bytearray(len(original)))
    assert tier.get([h], [buf]) == [len(original)]
    assert bytes(buf) == bytes(flipped)


# ----------------------------------------------------------------------------------------------------- S3

def make_s3_tier(server, bucket, **options) -> S3Tier:
    return S3Tier(bucket=bucket, namespace=NS, connect_timeout_s=0.5, read_timeout_s=1.0,
                  **server.client_options(), **options)


def test_s3_server_stopped_raises_unavailable_promptly_then_recovers(fresh_s3_server):
    tier = make_s3_tier(fresh_s3_server, "strata-faults", create_bucket=True)
    hashes = make_hashes(3)
    tier.put([(h, b"v") for h in hashes])

    fresh_s3_server.kill()
    assert_all_ops_unavailable(tier, hashes)
    assert tier.stats().errors == 3 and not tier.stats().healthy

    fresh_s3_server.start()  # same port; moto keeps nothing across a restart, so the bucket is gone too
    s3_client(fresh_s3_server).create_bucket(Bucket="strata-faults")
    assert tier.contains(hashes) == [False] * 3
    tier.put([(hashes[0], b"v")])
    assert tier.contains(hashes[:1]) == [True] and tier.stats().healthy


class _ErroringS3(http.server.BaseHTTPRequestHandler):
    """An HTTP server that answers every S3 request with 503 SlowDown, as an overloaded store does."""

    calls = 0

    def _fail(self) -> None:
        type(self).calls += 1
        body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _fail

    def log_message(self, *args) -> None:
        pass


def test_s3_server_returning_errors_is_unavailable_after_bounded_retries():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ErroringS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tier = S3Tier(bucket="strata-errors", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                      region="us-east-1", aws_access_key_id="k", aws_secret_access_key="s", max_attempts=2,
                      connect_timeout_s=0.5, read_timeout_s=1.0)
        hashes = make_hashes(2)
        _ErroringS3.calls = 0
        assert_all_ops_unavailable(tier, hashes)
        assert 3 <= _ErroringS3.calls <= 3 * 2 * len(hashes)  # retried, but a bounded number of times
    finally:
        server.shutdown()
        server.server_close()


def test_s3_bit_flip_is_returned_as_is_by_the_tier(s3_server, s3_bucket):
    tier = make_s3_tier(s3_server, s3_bucket)
    h = make_hashes(1)[0]
    original = bytes(range(256)) * 4
    tier.put([(h, original)])
    flipped = bytearray(original)
    flipped[100] ^= 0x10
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key=tier.key(h), Body=bytes(flipped))

    buf = memoryview(bytearray(len(original)))
    assert tier.get([h], [buf]) == [len(original)]
    assert bytes(buf) == bytes(flipped)


# ------------------------------------------------------------------------ the store rejects the bad copy

store_mod = pytest.importorskip("kvstore.store")
codec = pytest.importorskip("kvstore.codec")


def encoded_block(index: int):
    layout = codec.BlockLayout(num_layers=2, block_size=4, kv_heads=2, head_dim=8)
    tokens = [index * 4 + t for t in range(4)]
    h = hash_blocks(NS, tokens, 4)[0]
    payload = os.urandom(layout.payload_bytes("float16"))
    return h, codec.encode(NS.fingerprint(), h, layout, "float16", payload, tokens=tokens)


def flip_bit(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize("remote", ["redis", "s3"])
def test_store_rejects_a_flipped_bit_from_a_remote_tier_counts_it_and_deletes_the_copy(
        remote, redis_server, redis_key_prefix, s3_server, s3_bucket, monkeypatch):
    from kvstore.config import HostTierConfig, RedisTierConfig, S3TierConfig, StoreConfig
    from kvstore.events import BlockRemoved, ZmqEventPublisher, ZmqEventSubscriber

    opts = s3_server.client_options()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["aws_secret_access_key"])
    remote_config = {"redis": RedisTierConfig(url=redis_server.url, key_prefix=redis_key_prefix),
                     "s3": S3TierConfig(bucket=s3_bucket, endpoint_url=opts["endpoint_url"], region=opts["region"])}
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20), **{remote: remote_config[remote]})
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    subscriber = ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, from_seq=0)
    store = store_mod.TieredStore(config, publisher)
    try:
        h, block = encoded_block(1)
        tier = store.tier(remote)
        tier.put([(h, flip_bit(block, len(block) - 7))])  # a bit flipped in the payload, behind the store's back

        buf = bytearray(len(block))
        result = store.get([h], [buf], NS.fingerprint())

        assert result.num_hit_blocks == 0 and result.tiers == [None]  # a miss, never wrong KV
        assert store.stats()[remote].checksum_failures == 1
        assert tier.contains([h]) == [False]  # the bad copy is gone
        publisher.publish([])  # nothing; the store's own BlockRemoved must be what arrives
        assert publisher.flush()
        got = subscriber.recv(timeout_s=5.0) or subscriber.catch_up() and subscriber.recv(timeout_s=1.0)
        assert got and got.batch.events == [BlockRemoved(block_hashes=[h], medium=remote)]
    finally:
        store.close(), subscriber.close(), publisher.close()
