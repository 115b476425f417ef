"""The Redis tier (DESIGN §5, G4): blocks shared across workers and hosts through a Redis server or cluster.

Keys are `<key_prefix>:<namespace>:<block hash hex>` (namespace: a fingerprint's hex, "shared" by default), so
several deployments or models can share one Redis and `clear()` removes only its own keys. Every call is one
batched round trip per `batch_size` keys (and per ~`batch_bytes` of values): pipelined EXISTS for `contains`, MGET
received straight into the caller's buffers (`resp.py`; pipelined GET through redis-py on a cluster, where MGET
cannot cross slots, and over TLS) for `get`, pipelined SET NX [PX ttl] for `put`.
Every socket operation has a timeout and redis-py retries a failed command at most `retries` times, so a dead
server costs about `connect_timeout_s` (refused: far less) and a frozen one about `socket_timeout_s`, never a
hang. Any Redis failure raises `TierUnavailable`; a Redis that is out of memory (maxmemory with noeviction)
refuses a put with `TierFull`.

`quota_bytes` > 0 caps the bytes of each namespace (the fingerprint in every object's header) under this key base,
counted in Redis itself by Lua scripts so several workers share one quota (redis_quota.py, with its limits).

Used bytes are what this process has seen: the sizes of keys it stored or read, forgotten when it sees them gone.
Redis itself may hold more (other workers' blocks) or less (TTL expiry, Redis eviction); `scan_usage()` walks the
key space for the true figure when an operator asks.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvstore.hashing import BlockHash, Namespace
from kvstore.sealing import fingerprint_of
from kvstore.tiers import redis_quota
from kvstore.tiers.base import Tier, TierFull, TierStats, TierUnavailable, register_tier
from kvstore.tiers.resp import BufferTooSmall, RespConnectionError, RespPool, RespReplyError

_SCAN_COUNT = 1000
_UNLINK_BATCH = 500


def namespace_tag(namespace: Namespace | bytes | str | None) -> str:
    """The namespace part of a key: a fingerprint's hex, or the given string."""
    if namespace is None or namespace == "":
        return "shared"
    if isinstance(namespace, Namespace):
        return namespace.fingerprint().hex()
    if isinstance(namespace, (bytes, bytearray)):
        return bytes(namespace).hex()
    if ":" in namespace or "*" in namespace:
        raise ValueError(f"namespace must not contain ':' or '*', got {namespace!r}")
    return namespace


@register_tier("redis")
class RedisTier(Tier):
    """Blocks in Redis. `url`: redis://[user:pass@]host:port/db, rediss:// for TLS, unix:// for a socket;
    `cluster=True` talks to a Redis Cluster through any of its nodes. `ttl_s=0` keeps keys until Redis evicts them.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float = 0,
        key_prefix: str = "strata:kv",
        *,
        namespace: Namespace | bytes | str | None = None,
        cluster: bool = False,
        capacity_bytes: int = 0,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        retries: int = 1,
        max_connections: int = 32,
        batch_size: int = 128,
        batch_bytes: int = 64 << 20,
        quota_bytes: int = 0,
    ) -> None:
        super().__init__()
        if quota_bytes < 0 or (quota_bytes and cluster):
            raise ValueError(f"quota_bytes must be >= 0 (0 = none) and needs cluster=False, got {quota_bytes}")
        self._check_args(url, ttl_s, socket_timeout_s, connect_timeout_s, retries, batch_size, capacity_bytes)
        # One round trip carries at most batch_size keys and (for get/put) about batch_bytes of values, so a
        # batch of large blocks never becomes one giant reply buffered whole in both processes.
        self.url, self.cluster, self.batch_size, self.batch_bytes = url, cluster, batch_size, batch_bytes
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.key_base = f"{key_prefix.rstrip(':')}:{namespace_tag(namespace)}:"
        self.quota_bytes = quota_bytes  # per namespace fingerprint (redis_quota.py); 0 = none
        self._sizes: dict[bytes, int] = {}  # block hash -> object size, for the blocks this process has seen
        self._sizes_lock = threading.Lock()
        self._stats.capacity_bytes = capacity_bytes
        options = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                       retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), retries), decode_responses=False,
                       health_check_interval=30)
        self._direct: RespPool | None = None
        if cluster:
            self._client = RedisCluster.from_url(url, **options)
        else:
            self._client = redis.Redis.from_url(url, max_connections=max_connections, **options)
            if not url.startswith("rediss://"):
                self._direct = _direct_pool(url, socket_timeout_s, connect_timeout_s)

    @staticmethod
    def _check_args(url: str, ttl_s: float, socket_timeout_s: float, connect_timeout_s: float, retries: int,
                    batch_size: int, capacity_bytes: int) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {url!r}")
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0 (0 = no expiry), got {ttl_s}")
        if socket_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got socket {socket_timeout_s}, connect {connect_timeout_s}")
        if not 0 <= retries <= 10:
            raise ValueError(f"retries must be in [0, 10], got {retries}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = whatever Redis holds), got {capacity_bytes}")

    def key(self, block_hash: BlockHash) -> bytes:
        return (self.key_base + block_hash.hex()).encode()

    # ------------------------------------------------------------------------------------------------ Tier API

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        found: list[bool] = []
        for chunk in _chunks(keys, self.batch_size):
            replies = self._pipeline("contains", [("EXISTS", self.key(k)) for k in chunk])
            found.extend(bool(r) for r in replies)
        self._forget([k for k, present in zip(keys, found) if not present])
        return found

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(bufs):
            raise ValueError(f"get needs one buffer per key, got {len(keys)} keys and {len(bufs)} buffers")
        started = time.perf_counter()
        if self._direct is not None:
            flat = [_flat(b) for b in bufs]
            written: list[int | None] = []
            start = 0
            for chunk in _chunks(keys, self.batch_size, [len(b) for b in flat], self.batch_bytes):
                written.extend(self._fetch_into(chunk, flat[start:start + len(chunk)]))
                start += len(chunk)
        else:
            values: list[bytes | None] = []
            for chunk in _chunks(keys, self.batch_size, [len(b) for b in bufs], self.batch_bytes):
                values.extend(self._fetch(chunk))
            written = [_copy_into(k, v, b) for k, v, b in zip(keys, values, bufs)]
        self._track_sizes(keys, written)
        hits = [n for n in written if n is not None]
        self._observe("get", started, hits=len(hits), misses=len(written) - len(hits), bytes_read=sum(hits))
        return written

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        started = time.perf_counter()
        stored: list[bool] = []
        for chunk in _chunks(items, self.batch_size, [len(d) for _, d in items], self.batch_bytes):
            stored.extend(self._store(chunk))
        with self._sizes_lock:
            for (k, data), ok in zip(items, stored):
                if ok:
                    self._sizes[bytes(k)] = len(data)
        self._observe("put", started, bytes_written=sum(len(d) for (_, d), ok in zip(items, stored) if ok),
                      quota_refused=len(stored) - sum(stored))
        return stored

    def delete(self, keys: Sequence[BlockHash]) -> int:
        """UNLINK `keys`, one round trip per `_UNLINK_BATCH` keys; how many Redis actually held (a key another
        worker removed first, or that expired, is not counted)."""
        removed = 0
        unlink = self._unlink_counted if self.quota_bytes else self._unlink
        for chunk in _chunks(keys, _UNLINK_BATCH):
            removed += unlink("delete", [self.key(k) for k in chunk])
        self._forget(keys)
        return removed

    def namespace_usage(self, fingerprint: bytes) -> int:
        """Bytes the quota counter in Redis charges to `fingerprint`'s namespace (0 when it has none)."""
        (used,) = self._pipeline("usage", [("GET", redis_quota.usage_key(self.key_base, fingerprint))])
        return int(used or 0)

    def clear(self) -> int:
        """UNLINK every key under this tier's prefix and namespace (SCAN, never KEYS or FLUSHDB), one round trip per
        `_UNLINK_BATCH` keys; how many were removed."""
        removed = 0
        try:
            batch: list[bytes] = []
            for key in self._scan():
                batch.append(key)
                if len(batch) >= _UNLINK_BATCH:
                    removed, batch = removed + self._unlink("clear", batch), []
        except redis.RedisError as exc:
            raise self._unavailable("clear", exc) from exc
        if batch:
            removed += self._unlink("clear", batch)
        with self._sizes_lock:
            self._sizes.clear()
        return removed

    def _unlink_counted(self, what: str, names: list[bytes]) -> int:
        """UNLINK with quota: read each block's namespace (GETRANGE), then unlink and give its bytes back
        atomically (redis_quota.DELETE_SCRIPT); two round trips."""
        if not names:
            return 0
        fingerprints = self._pipeline(what, [("GETRANGE", n, *redis_quota.FINGERPRINT_RANGE) for n in names])
        todo = [(n, fp) for n, fp in zip(names, fingerprints) if len(fp) == 16]
        commands = [redis_quota.delete_command(n, redis_quota.usage_key(self.key_base, fp), fp) for n, fp in todo]
        return sum(self._pipeline(what, commands)) if commands else 0

    def _unlink(self, what: str, names: list[bytes]) -> int:
        """One round trip: a multi-key UNLINK on one server; on a cluster, where a command cannot cross slots, a
        pipeline of one UNLINK per key."""
        if not names:
            return 0
        if self.cluster:
            return sum(self._pipeline(what, [("UNLINK", n) for n in names]))
        return self._pipeline(what, [("UNLINK", *names)])[0]

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        self._client.close()

    def stats(self) -> TierStats:
        stats = super().stats()
        with self._sizes_lock:
            stats.blocks, stats.used_bytes = len(self._sizes), sum(self._sizes.values())
        return stats

    def scan_usage(self) -> tuple[int, int]:
        """(blocks, bytes) actually under this prefix and namespace in Redis, by SCAN + pipelined STRLEN."""
        try:
            counters = (self.key_base + redis_quota.QUOTA_TAG).encode()
            keys = [k for k in self._scan() if not k.startswith(counters)]
        except redis.RedisError as exc:
            raise self._unavailable("scan", exc) from exc
        sizes = []
        for chunk in _chunks(keys, self.batch_size):
            sizes.extend(self._pipeline("scan", [("STRLEN", k) for k in chunk]))
        return len(keys), sum(sizes)

    # ------------------------------------------------------------------------------------------------- internals

    def _pipeline(self, what: str, commands: list[tuple]) -> list:
        try:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = pipe.execute()
        except redis.ResponseError as exc:
            if str(exc).startswith("OOM"):  # maxmemory reached under a noeviction policy: full, not down
                raise TierFull(f"redis tier: {what}: {exc}") from exc
            raise self._unavailable(what, exc) from exc
        except redis.RedisError as exc:
            raise self._unavailable(what, exc) from exc
        self._mark_healthy()
        return replies

    def _fetch(self, chunk: Sequence[BlockHash]) -> list[bytes | None]:
        if not self.cluster:
            names = [self.key(k) for k in chunk]
            return self._pipeline("get", [("MGET", *names)])[0]
        return self._pipeline("get", [("GET", self.key(k)) for k in chunk])  # MGET cannot cross cluster slots

    def _fetch_into(self, chunk: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        """MGET received straight into `bufs` (plain and unix-socket servers; see `resp.py`)."""
        try:
            lengths = self._direct.mget_into([self.key(k) for k in chunk], bufs)
        except BufferTooSmall as exc:
            raise ValueError(f"buffer of {exc.have} bytes is too small for block {chunk[exc.index].hex()} of "
                             f"{exc.needed} bytes") from None
        except (RespConnectionError, RespReplyError) as exc:
            raise self._unavailable("get", exc) from exc
        self._mark_healthy()
        return lengths

    def _store(self, chunk: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        """One pipelined round trip; which blocks are stored (False: refused by the namespace's quota)."""
        if self.quota_bytes:
            replies = self._pipeline("put", [redis_quota.put_command(
                self.key(k), redis_quota.usage_key(self.key_base, fingerprint_of(d)), d, self.quota_bytes,
                self.ttl_ms) for k, d in chunk])
            return [bool(r) for r in replies]
        expiry = ("PX", self.ttl_ms) if self.ttl_ms else ()
        # NOTE: redis-py sends a large bytes/memoryview argument as its own buffer, without copying it.
        stored = self._pipeline("put", [("SET", self.key(k), d, "NX", *expiry) for k, d in chunk])
        if self.ttl_ms:
            # NOTE: a block stored again is still hot: give it a full TTL again rather than let it expire early.
            again = [k for (k, _), ok in zip(chunk, stored) if not ok]
            if again:
                self._pipeline("put", [("PEXPIRE", self.key(k), self.ttl_ms) for k in again])
        return [True] * len(chunk)

    def _scan(self) -> Iterator[bytes]:
        return self._client.scan_iter(match=self.key_base.encode() + b"*", count=_SCAN_COUNT)

    def _track_sizes(self, keys: Sequence[BlockHash], written: list[int | None]) -> None:
        with self._sizes_lock:
            for k, n in zip(keys, written):
                if n is None:
                    self._sizes.pop(bytes(k), None)
                else:
                    self._sizes[bytes(k)] = n

    def _forget(self, keys: Sequence[BlockHash]) -> None:
        with self._sizes_lock:
            for k in keys:
                self._sizes.pop(bytes(k), None)

    def _unavailable(self, what: str, exc: BaseException) -> TierUnavailable:
        with self._stats_lock:
            self._stats.healthy = False
        return self._failed(what, exc)

    def _mark_healthy(self) -> None:
        if not self._stats.healthy:  # NOTE: racy read is fine: at worst one extra locked write
            with self._stats_lock:
                self._stats.healthy = True


def _chunks(seq: Sequence, size: int, weights: Sequence[int] | None = None,
            max_weight: int = 0) -> Iterator[Sequence]:
    """Slices of at most `size` items and (when `weights` is given) at most `max_weight` summed weight, but never
    empty: one item heavier than the bound goes alone."""
    start = 0
    while start < len(seq):
        end, total = start, 0
        while end < len(seq) and end - start < size:
            w = weights[end] if weights is not None else 0
            if end > start and weights is not None and total + w > max_weight:
                break
            total, end = total + w, end + 1
        yield seq[start:end]
        start = end


def _direct_pool(url: str, socket_timeout_s: float, connect_timeout_s: float) -> RespPool:
    parts = redis.connection.parse_url(url)
    address = parts["path"] if "path" in parts else (parts.get("host", "localhost"), parts.get("port", 6379))
    return RespPool(address, username=parts.get("username"), password=parts.get("password"),
                    db=int(parts.get("db") or 0), socket_timeout_s=socket_timeout_s,
                    connect_timeout_s=connect_timeout_s)


def _flat(buf: memoryview) -> memoryview:
    if not isinstance(buf, memoryview):
        buf = memoryview(buf)
    if buf.readonly:
        raise ValueError("get needs writable buffers")
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def _copy_into(key: BlockHash, value: bytes | None, buf: memoryview) -> int | None:
    if value is None:
        return None
    buf = _flat(buf)
    if len(value) > len(buf):
        raise ValueError(f"buffer of {len(buf)} bytes is too small for block {key.hex()} of {len(value)} bytes")
    buf[:len(value)] = value
    return len(value)
