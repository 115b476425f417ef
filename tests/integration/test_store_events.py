"""The store's KV events over a real ZeroMQ publisher: what a router's subscriber sees per tier."""
from __future__ import annotations

import time

from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.events import BlockRemoved, BlockStored, ZmqEventPublisher, ZmqEventSubscriber
from kvstore.hashing import Namespace, hash_blocks
from kvstore.store import TieredStore

NS = Namespace("tiny@events", "bs4-l1-h1-d8", "float16")
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=1, head_dim=8)
TOKENS = list(range(50, 62))
HASHES = hash_blocks(NS, TOKENS, 4)


def make_item(i: int) -> tuple[bytes, bytes]:
    return HASHES[i], codec.encode(NS.fingerprint(), HASHES[i], LAYOUT, "float16", bytes([i]) * 128,
                                   tokens=TOKENS[4 * i:4 * i + 4], parent_hash=HASHES[i - 1] if i else None)


def receive_events(subscriber: ZmqEventSubscriber, count: int, timeout_s: float = 10.0) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        got = subscriber.recv(timeout_s=0.2)
        if got is not None:
            events.extend(got.batch.events)
    return events


def test_subscriber_sees_stores_evictions_and_demotions_per_tier(tmp_path):
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    subscriber = ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, from_seq=0)
    config = StoreConfig(host=HostTierConfig(capacity_bytes=2 * 4096, slot_bytes=4096),
                         disk=DiskTierConfig(str(tmp_path), capacity_bytes=1 << 20))
    try:
        with TieredStore(config, publisher) as store:
            store.put([make_item(0), make_item(1)])
            store.put([make_item(2)])  # evicts block 0 from host and demotes it to disk
            assert store.flush()
            events = receive_events(subscriber, 5)
    finally:
        subscriber.close()
        publisher.close()
    described = [(type(e).__name__, e.medium, [bytes(h) for h in e.block_hashes]) for e in events]
    assert described == [
        ("BlockStored", "host", [HASHES[0]]), ("BlockStored", "host", [HASHES[1]]),
        ("BlockRemoved", "host", [HASHES[0]]), ("BlockStored", "host", [HASHES[2]]),
        ("BlockStored", "disk", [HASHES[0]]),
    ]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[1].parent_block_hash == HASHES[0] and stored[1].token_ids == TOKENS[4:8]
    assert stored[3].token_ids == TOKENS[:4] and stored[3].block_size == 4  # demoted: still fully described
    assert any(isinstance(e, BlockRemoved) for e in events)
