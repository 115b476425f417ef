"""A real redis-server SIGKILLed and restarted on the same port while requests run through the store: no request
fails or returns wrong KV, the Redis tier is marked unhealthy and skipped while it is down, and healthy again (and
written to) once it is back. Waits are polls under generous deadlines, never fixed sleeps that a loaded machine
could outrun."""
from __future__ import annotations

import threading
import time

import redis

from kvstore.config import HostTierConfig, RedisTierConfig, StoreConfig
from kvstore.store import TieredStore
from tests.faults.test_bit_flips import HASHES, SIZE, make_block
from tests.integration.store_factories import FP

DEADLINE_S = 60.0


def wait_until(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s}s waiting until {what}")
        time.sleep(0.05)


class Requests(threading.Thread):
    """Requests as a worker makes them, in a loop: store new blocks, look up a prefix one block longer than what is
    stored (so Redis is asked every time), read the blocks back. Blocks 0..799 in turn; at the wrap the host tier
    is emptied (as if it evicted them), so the blocks owe Redis a write again."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(daemon=True)
        self.store, self.stop, self.done, self.failures = store, threading.Event(), 0, []
        self.next = 0

    def run(self) -> None:
        while not self.stop.wait(0.005):  # NOTE: paced, the machine is shared
            try:
                self.one()
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - a failed request is what this test looks for
                self.failures.append(repr(exc))

    def one(self) -> None:
        first, self.next = self.next, (self.next + 4) % 800
        if first == 0:
            self.store.host.clear()
        keys = HASHES[first:first + 4]
        self.store.put([(h, make_block(first + i)) for i, h in enumerate(keys)])
        found = self.store.lookup([*keys, HASHES[-1]])  # never stored: a miss in host, asked of Redis
        got = self.store.get(keys, [bytearray(SIZE) for _ in keys], FP, hint=found.tiers[:len(keys)])
        for i, block in enumerate(got.blocks):
            if block is None or bytes(block.payload) != bytes(codec_payload(first + i)):
                raise AssertionError(f"block {first + i}: {got.tiers[i]} returned no or wrong KV")


def codec_payload(i: int) -> memoryview:
    from kvstore import codec
    return codec.decode(make_block(i), FP, HASHES[i]).payload


def test_redis_killed_and_restarted_under_load_fails_no_request(fresh_redis_server):
    config = StoreConfig(host=HostTierConfig(capacity_bytes=4 << 20, slot_bytes=1024),
                         redis=RedisTierConfig(url=fresh_redis_server.url, socket_timeout_s=0.5),
                         write_through=("redis",), backoff_initial_s=0.2, backoff_max_s=1.0, lookup_timeout_s=2.0)
    with TieredStore(config) as store:
        requests = Requests(store)
        requests.start()
        try:
            wait_until(lambda: requests.done >= 5 and store.stats()["redis"].bytes_written > 0, "Redis is written")
            fresh_redis_server.kill()  # SIGKILL
            wait_until(lambda: not store.stats()["redis"].healthy, "the Redis tier is marked unhealthy")
            skipped = store.stats()["redis"].skipped
            wait_until(lambda: store.stats()["redis"].skipped > skipped, "calls to Redis are skipped")
            served_while_down = requests.done
            wait_until(lambda: requests.done >= served_while_down + 5, "requests go on while Redis is down")

            fresh_redis_server.start()  # the same port, empty (no persistence)
            wait_until(lambda: store.stats()["redis"].healthy, "the Redis tier is healthy again")
            written = store.stats()["redis"].bytes_written
            wait_until(lambda: store.stats()["redis"].bytes_written > written, "Redis is written again")
        finally:
            requests.stop.set()
            requests.join(DEADLINE_S)
        assert requests.failures == [] and requests.done > 10
        assert store.flush(30)
        stats = store.stats()["redis"]
        assert stats.healthy and stats.errors > 0 and stats.skipped > 0
        raw = redis.Redis.from_url(fresh_redis_server.url)
        try:
            assert raw.dbsize() > 0  # blocks written after the restart
        finally:
            raw.close()
