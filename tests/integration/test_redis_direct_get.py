"""The Redis tier's direct get path (`kvstore/tiers/resp.py`: MGET received straight into the caller's buffers)
against a real redis-server: exact bytes at every size, replies split across reads, auth and db from the URL, a
unix socket, a restarted server, a dead one."""
from __future__ import annotations

import os
import random

import pytest
import redis
import torch

from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.base import TierUnavailable
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.resp import BufferTooSmall, RespConnectionError, RespPool, RespReplyError
from strata.devservers import RedisServer

NS = Namespace("tiny-llama:abc", "L2-H4-D16-B4", "float16")


def hashes(n: int) -> list[bytes]:
    return hash_blocks(NS, list(range(n * 4)), 4)


def test_values_of_every_size_arrive_exactly_including_empty_and_missing(redis_server, redis_key_prefix):
    rng = random.Random(7)
    sizes = [0, 1, 2, 3, 100, 65_534, 65_536, 65_537, 300_000, 4 << 20] + [rng.randrange(1, 5000) for _ in range(40)]
    keys = hashes(len(sizes) + 1)
    blocks = [os.urandom(n) for n in sizes]
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS)
    try:
        assert tier._direct is not None  # a plain redis:// server takes the direct path
        tier.put(list(zip(keys, blocks)))
        # the missing key sits in the middle: its $-1 shares a read with the values around it
        order = keys[:25] + [keys[-1]] + keys[25:-1]
        want = blocks[:25] + [None] + blocks[25:]
        bufs = [memoryview(bytearray((len(b) if b is not None else 0) + 3)) for b in want]
        got = tier.get(order, bufs)
        assert got == [None if b is None else len(b) for b in want]
        for buf, block in zip(bufs, want):
            if block is not None:
                assert bytes(buf[:len(block)]) == block
    finally:
        tier.clear()
        tier.close()


def test_many_small_values_batched_and_typed_buffers(redis_server, redis_key_prefix):
    keys = hashes(300)
    blocks = [os.urandom(64 + 4 * i) for i in range(300)]
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS, batch_size=128)
    try:
        tier.put(list(zip(keys, blocks)))
        # float32 tensors as destinations: the tier casts each to a flat byte view
        dsts = [torch.zeros((len(b) + 3) // 4, dtype=torch.float32) for b in blocks]
        got = tier.get(keys, [memoryview(d.numpy()) for d in dsts])
        assert got == [len(b) for b in blocks]
        assert all(d.numpy().tobytes()[:len(b)] == b for d, b in zip(dsts, blocks))
    finally:
        tier.clear()
        tier.close()


def test_too_small_buffer_is_a_value_error_and_the_connection_stays_in_sync(redis_server, redis_key_prefix):
    keys = hashes(3)
    blocks = [b"a" * 10, b"b" * 100, b"c" * 10]
    tier = RedisTier(url=redis_server.url, key_prefix=redis_key_prefix, namespace=NS)
    try:
        tier.put(list(zip(keys, blocks)))
        with pytest.raises(ValueError, match="too small"):
            tier.get(keys, [memoryview(bytearray(10)) for _ in keys])
        bufs = [memoryview(bytearray(100)) for _ in keys]
        assert tier.get(keys, bufs) == [10, 100, 10]  # the same pooled connection, reply fully drained
        assert [bytes(b[:n]) for b, n in zip(bufs, (10, 100, 10))] == blocks
    finally:
        tier.clear()
        tier.close()


def test_password_and_db_come_from_the_url_and_a_wrong_password_is_an_error():
    with RedisServer(extra_args=("--requirepass", "s3cret")) as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        tier = RedisTier(url=url, namespace=NS)
        try:
            keys = hashes(2)
            tier.put([(keys[0], b"in db 3")])
            buf = memoryview(bytearray(16))
            assert tier.get(keys, [buf, memoryview(bytearray(16))]) == [7, None]
            assert bytes(buf[:7]) == b"in db 3"
            other = redis.Redis(host="127.0.0.1", port=server.port, password="s3cret", db=0)
            assert other.dbsize() == 0  # the block went to db 3, not db 0
        finally:
            tier.close()
        pool = RespPool(("127.0.0.1", server.port), password="wrong")
        with pytest.raises(RespReplyError):
            pool.mget_into([b"k"], [memoryview(bytearray(1))])
        bad = RedisTier(url=f"redis://:wrong@127.0.0.1:{server.port}/0", namespace=NS)
        with pytest.raises(TierUnavailable):
            bad.get(hashes(1), [memoryview(bytearray(1))])
        bad.close()


def test_unix_socket_url(tmp_path):
    path = tmp_path / "redis.sock"
    with RedisServer(extra_args=("--unixsocket", str(path), "--unixsocketperm", "700")):
        tier = RedisTier(url=f"unix://{path}?db=1", namespace=NS)
        try:
            key = hashes(1)
            tier.put([(key[0], b"over a unix socket")])
            buf = memoryview(bytearray(32))
            assert tier.get(key, [buf]) == [18] and bytes(buf[:18]) == b"over a unix socket"
        finally:
            tier.close()


def test_restarted_server_is_reconnected_and_a_dead_one_is_unavailable(fresh_redis_server):
    tier = RedisTier(url=fresh_redis_server.url, namespace=NS, connect_timeout_s=0.5, socket_timeout_s=0.5)
    try:
        key = hashes(1)
        tier.put([(key[0], b"before")])
        assert tier.get(key, [memoryview(bytearray(8))]) == [6]
        fresh_redis_server.stop()
        with pytest.raises(TierUnavailable):
            tier.get(key, [memoryview(bytearray(8))])
        assert tier.stats().healthy is False
        fresh_redis_server.start()  # same port, empty (no persistence)
        assert tier.get(key, [memoryview(bytearray(8))]) == [None]
        assert tier.stats().healthy is True
        tier.put([(key[0], b"after")])
        buf = memoryview(bytearray(8))
        assert tier.get(key, [buf]) == [5] and bytes(buf[:5]) == b"after"
    finally:
        tier.close()


def test_a_pooled_connection_the_server_closed_is_retried_once_on_a_fresh_one(redis_server):
    pool = RespPool(("127.0.0.1", redis_server.port))
    client = redis.Redis.from_url(redis_server.url)
    client.set(b"direct-retry", b"value")
    buf = memoryview(bytearray(8))
    assert pool.mget_into([b"direct-retry"], [buf]) == [5]
    host, port = pool._idle[0]._sock.getsockname()[:2]
    assert client.client_kill(f"{host}:{port}")  # the server drops the pool's idle connection
    assert pool.mget_into([b"direct-retry"], [buf]) == [5] and bytes(buf[:5]) == b"value"
    pool.close()
    client.delete(b"direct-retry")


def test_nothing_listening_is_a_connection_error():
    from strata.devservers import free_port

    pool = RespPool(("127.0.0.1", free_port()), connect_timeout_s=0.5)
    with pytest.raises(RespConnectionError):
        pool.mget_into([b"k"], [memoryview(bytearray(1))])


def test_buffer_too_small_carries_the_index_and_sizes(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set(b"direct-small", b"x" * 50)
    pool = RespPool(("127.0.0.1", redis_server.port))
    with pytest.raises(BufferTooSmall) as info:
        pool.mget_into([b"direct-missing", b"direct-small"], [memoryview(bytearray(4)), memoryview(bytearray(4))])
    assert (info.value.index, info.value.needed, info.value.have) == (1, 50, 4)
    pool.close()
    client.delete(b"direct-small")
