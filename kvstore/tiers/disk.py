"""Disk tier (DESIGN §5, G3): one file per block under a directory, atomic writes, an LRU rebuilt on restart.

    <path>/<first two hex digits of the hash>/<hash hex>.kvb      a stored block (codec bytes)
    <path>/<shard>/.<hash hex>.<random>.tmp                       a write in progress (removed on restart)

A block becomes visible only by `os.replace` of a complete temp file, so no torn block is ever readable. A batch
is read from the page cache first, one block after another (`RWF_NOWAIT`: a read that would wait for the device
returns at once), and the blocks it lacks in a small thread pool, as are writes. A full disk (ENOSPC, EFBIG,
EDQUOT) is a counted error that marks the tier unhealthy; reads keep working.
"""
from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from kvstore.hashing import BlockHash
from kvstore.tiers.base import Tier, TierStats, register_tier

_SUFFIX, _TMP_SUFFIX = ".kvb", ".tmp"
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)   # Linux 4.14+; 0: every read goes to the pool
_COLD = object()                         # a block the page cache does not hold (all of it)


@register_tier("disk")
class DiskTier(Tier):
    """Files on a local directory with LRU eviction by bytes. `fsync=True` syncs file and directory per write.

    The LRU order survives a restart through file mtimes; a read refreshes a block's mtime at most once per
    `touch_interval_s` (a metadata write on the read path), so the order after a restart is that coarse.
    """

    def __init__(self, path: str, capacity_bytes: int, fsync: bool = False, io_threads: int = 4,
                 touch_interval_s: float = 30.0) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.path, self.capacity_bytes, self.fsync = path, capacity_bytes, fsync
        self.touch_interval_s = touch_interval_s
        self._root = os.path.join(path, "")
        self.healthy = True
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> size, least recent first
        self._used = 0
        self._touched: dict[bytes, float] = {}  # key -> when this process last refreshed the file's mtime
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="strata-disk")
        self._nowait = _NOWAIT
        self.reads_cached = self.reads_waited = 0   # blocks read from the page cache / through the pool
        self._tmp_ids = itertools.count()
        for shard in range(256):  # once, so a write never has to create its directory
            os.makedirs(os.path.join(path, f"{shard:02x}"), exist_ok=True)
        self._rebuild_index()

    # Index ----------------------------------------------------------------------------------------------------

    def _file(self, key: bytes) -> str:
        hexkey = key.hex()
        return f"{self._root}{hexkey[:2]}/{hexkey}{_SUFFIX}"  # hot path: cheaper than os.path.join

    def _rebuild_index(self) -> None:
        """Index every complete block file, oldest modification first; drop temp files of an interrupted write."""
        found: list[tuple[float, bytes, int]] = []
        for shard in os.scandir(self.path):
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    _unlink(entry.path)
                elif entry.name.endswith(_SUFFIX) and (key := _parse_name(entry.name)) is not None:
                    st = entry.stat()
                    found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._used += size
        self._make_room(0)

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used blocks until `incoming` more bytes fit. Caller holds the lock (or is init)."""
        while self._lru and self._used + incoming > self.capacity_bytes:
            key, size = self._lru.popitem(last=False)
            self._touched.pop(key, None)
            self._used -= size
            data = self._read_whole(key, size) if self.eviction_wants_data else None
            _unlink(self._file(key))
            self._evicted(BlockHash(key), data)

    def _read_whole(self, key: bytes, size: int) -> bytes | None:
        try:
            with open(self._file(key), "rb", buffering=0) as f:
                return f.read(size)
        except OSError:
            return None

    # Tier interface -------------------------------------------------------------------------------------------

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return [bytes(k) in self._lru for k in keys]

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        started = time.perf_counter()
        keys = [bytes(k) for k in keys]
        with self._lock:
            sizes = [self._lru.get(k) for k in keys]
            for key, size in zip(keys, sizes):
                if size is not None:
                    self._lru.move_to_end(key)
        hit_at = [i for i, size in enumerate(sizes) if size is not None]
        for i in hit_at:
            if sizes[i] > len(bufs[i]):
                raise ValueError(f"buffer holds {len(bufs[i])} bytes, block {keys[i].hex()} needs {sizes[i]}")
        out: list[int | None] = [None] * len(keys)
        # NOTE: page-cache hits in one thread, then the rest in the pool: 124 cached 64 KiB blocks took 1.5-1.9 ms
        # read one after another, 2.9-4.6 ms through the pool (thread hand-offs), and a cold read would block
        cold = hit_at
        if self._nowait:
            cold = []
            for i in hit_at:
                n = self._read_one(keys[i], bufs[i], sizes[i], nowait=True)
                if n is _COLD:
                    cold.append(i)
                else:
                    out[i] = n
        for i, n in zip(cold, self._run(self._read_one, [(keys[i], bufs[i], sizes[i]) for i in cold])):
            out[i] = n
        with self._lock:
            self.reads_cached += len(hit_at) - len(cold)
            self.reads_waited += len(cold)
        hits = sum(n is not None for n in out)
        self._observe("get", started, hits=hits, misses=len(out) - hits, bytes_read=sum(n or 0 for n in out))
        return out

    def _read_one(self, key: bytes, buf: memoryview, size: int, nowait: bool = False):
        """Bytes read into `buf`, None for a miss; with `nowait`, `_COLD` when the page cache lacks some of it."""
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except FileNotFoundError:  # removed behind our back: a miss
            self._forget(key)
            return None
        except OSError as exc:
            raise self._failed("read", exc) from exc
        try:
            try:
                n = os.preadv(fd, [memoryview(buf)[:size]], 0, self._nowait if nowait else 0)
            except BlockingIOError:
                return _COLD
            except OSError as exc:
                if not nowait or exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = 0            # this filesystem cannot: every read waits from now on
                return _COLD
            if nowait and n < size:         # partly cached: the rest would wait
                return _COLD
            now = time.monotonic()
            if now - self._touched.get(key, float("-inf")) >= self.touch_interval_s:
                os.utime(fd)  # a metadata write: only now and then, it only orders the LRU after a restart
                self._touched[key] = now
            return n
        except OSError as exc:
            raise self._failed("read", exc) from exc
        finally:
            os.close(fd)

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        started = time.perf_counter()
        jobs, out = self._reserve(items)
        errors: list[BaseException] = []
        written = self._run(self._write_one, jobs, errors)
        now = time.monotonic()
        with self._lock:
            for (key, data), ok in zip(jobs, written):
                self._used -= len(data)  # the reservation
                if ok and key not in self._lru:
                    self._lru[key] = len(data)
                    self._used += len(data)
                    self._touched[key] = now  # the write set the mtime
            self._make_room(0)  # a batch bigger than the free room also evicts its own oldest blocks
        stored = {key for (key, _), ok in zip(jobs, written) if ok}
        result = [ok or bytes(k) in stored for (k, _), ok in zip(items, out)]
        self._observe("put", started, bytes_written=sum(len(d) for (k, d), ok in zip(jobs, written) if ok))
        if errors:
            raise errors[0]
        self.healthy = True
        return result

    def _reserve(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]
                 ) -> tuple[list[tuple[bytes, memoryview]], list[bool]]:
        """Split a batch into already-present keys (True) and writes to do, making room for the writes."""
        jobs, present = [], []
        with self._lock:
            for key, data in items:
                key, data = bytes(key), memoryview(data).cast("B")
                if key in self._lru:
                    self._lru.move_to_end(key)
                    present.append(True)
                    continue
                present.append(False)
                if len(data) <= self.capacity_bytes:
                    self._make_room(len(data))
                    self._used += len(data)  # reserved until the write ends
                    jobs.append((key, data))
        return jobs, present

    def _write_one(self, key: bytes, data: memoryview) -> bool:
        final = self._file(key)
        tmp = os.path.join(os.path.dirname(final), f".{key.hex()}.{os.getpid()}-{next(self._tmp_ids)}{_TMP_SUFFIX}")
        try:
            fd = _create(tmp)
            try:
                _write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)  # the block appears whole or not at all
            if self.fsync:
                _fsync_dir(os.path.dirname(final))
            return True
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in _FULL_ERRNOS:
                self.healthy = False
            raise self._failed(f"write of {key.hex()}", exc) from exc

    def _run(self, fn: Callable, jobs: list[tuple], errors: list[BaseException] | None = None) -> list:
        """Run `fn(*job)` for each job, in the pool when there is more than one; failures become False/None."""
        if len(jobs) <= 1:
            futures = None
        else:
            futures = [self._pool.submit(fn, *job) for job in jobs]
        results = []
        for i, job in enumerate(jobs):
            try:
                results.append(fn(*job) if futures is None else futures[i].result())
            except Exception as exc:  # noqa: BLE001 - collected and re-raised by the caller after bookkeeping
                if errors is None:
                    raise
                errors.append(exc)
                results.append(False)
        return results

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            self._touched.pop(key, None)
            if size is not None:
                self._used -= size

    def delete(self, keys: Sequence[BlockHash]) -> int:
        removed = 0
        for key in keys:
            key = bytes(key)
            with self._lock:
                size = self._lru.pop(key, None)
                self._touched.pop(key, None)
                if size is None:
                    continue
                self._used -= size
            _unlink(self._file(key))
            removed += 1
        return removed

    def clear(self) -> None:
        with self._lock:
            keys = list(self._lru)
        self.delete([BlockHash(k) for k in keys])

    def keys_lru_order(self) -> list[BlockHash]:
        with self._lock:
            return [BlockHash(k) for k in self._lru]

    def check_integrity(self) -> None:
        with self._lock:
            assert self._used == sum(self._lru.values()), "used bytes != sum of indexed sizes"
            assert self._used <= self.capacity_bytes, "over capacity"

    def stats(self) -> TierStats:
        stats = super().stats()
        with self._lock:
            stats.capacity_bytes, stats.used_bytes, stats.blocks = self.capacity_bytes, self._used, len(self._lru)
        stats.healthy = self.healthy
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _parse_name(name: str) -> bytes | None:
    try:
        key = bytes.fromhex(name[:-len(_SUFFIX)])
    except ValueError:
        return None
    return key if len(key) == 16 else None


def _create(path: str) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:  # the shard directory was removed behind our back
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
