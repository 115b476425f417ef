"""Factories for the TieredStore tests: blocks of one tiny namespace, a store over real host and disk tiers, and an
in-memory tier standing in for a remote one where a test must control failures and latency exactly (the Redis and
S3 fault tests use the real servers)."""
from __future__ import annotations

import threading
import time

from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, StoreConfig
from kvstore.hashing import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

NS = Namespace("tiny@store-test", "bs4-l1-h2-d8", "float16")
FP = NS.fingerprint()
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=2, head_dim=8)
TOKENS = list(range(1000, 1000 + 4 * 64))
HASHES = hash_blocks(NS, TOKENS, 4)
SLOT = 4096


def make_block(i: int) -> bytes:
    return codec.encode(FP, HASHES[i], LAYOUT, "float16", bytes([i + 1]) * LAYOUT.payload_bytes("float16"),
                        tokens=TOKENS[4 * i:4 * i + 4], parent_hash=HASHES[i - 1] if i else None)


SIZE = len(make_block(0))


def items(*indices: int) -> list[tuple[bytes, bytes]]:
    return [(HASHES[i], make_block(i)) for i in indices]


class MemoryTier(Tier):
    """A dict-backed tier whose failures (`down`) and latency (`delay_s`) a test switches."""

    name = "remote"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[bytes, bytes] = {}
        self.down, self.delay_s, self.calls = False, 0.0, 0

    def _enter(self, op: str) -> None:
        self.calls += 1
        time.sleep(self.delay_s)
        if self.down:
            raise self._failed(op, ConnectionError("connection refused"))

    def contains(self, keys):
        self._enter("contains")
        return [bytes(k) in self.data for k in keys]

    def get(self, keys, bufs):
        self._enter("get")
        out = []
        for key, buf in zip(keys, bufs):
            blob = self.data.get(bytes(key))
            if blob is not None:
                buf[:len(blob)] = blob
            out.append(None if blob is None else len(blob))
        self._count(hits=sum(n is not None for n in out), misses=sum(n is None for n in out))
        return out

    def put(self, items):
        self._enter("put")
        for key, data in items:
            self.data[bytes(key)] = bytes(data)
        return [True] * len(items)

    def delete(self, keys):
        return sum(self.data.pop(bytes(k), None) is not None for k in keys)

    def clear(self):
        self.data.clear()


class Recorder:
    """An event publisher that keeps what it was given."""

    def __init__(self) -> None:
        self.events, self._lock = [], threading.Lock()

    def publish(self, events) -> None:
        with self._lock:
            self.events.extend(events)

    def of(self, kind: str, medium: str) -> list:
        return [e for e in self.events if type(e).__name__ == kind and e.medium == medium]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(tmp_path, host_slots: int = 8, disk_blocks: int = 100, remote: MemoryTier | None = None,
               publisher=None, clock=time.monotonic, **policy) -> TieredStore:
    """`remote` stands in as tier "remote"; as "redis" (a shared tier the config may write through to) when
    `write_through` names it."""
    shared = "redis" in policy.get("write_through", ())
    config = StoreConfig(host=HostTierConfig(capacity_bytes=host_slots * SLOT, slot_bytes=SLOT),
                         disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=disk_blocks * SIZE),
                         redis=RedisTierConfig() if shared else None, **policy)
    tiers = {"host": HostTier(**config.tier_options("host")), "disk": DiskTier(**config.tier_options("disk"))}
    if remote is not None:
        tiers["redis" if shared else "remote"] = remote
    return TieredStore(config, publisher, tiers=tiers, clock=clock)


def get(store: TieredStore, *indices: int):
    bufs = [bytearray(SIZE) for _ in indices]
    return store.get([HASHES[i] for i in indices], bufs, FP)
