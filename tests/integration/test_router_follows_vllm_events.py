"""The router's prefix index follows a vLLM worker's KV-event stream (issue 5 item 3): a publisher written only from
vLLM's published schema and wire format (msgspec array-like structs, `[topic, 8-byte big-endian seq, payload]` on a
ZeroMQ PUB socket, 32-byte block hashes, medium "GPU" / "CPU") feeds Strata's `EventsFeed` through a real socket."""
from __future__ import annotations

import hashlib
import time

import pytest

msgspec = pytest.importorskip("msgspec", reason="msgspec is a test dependency: pip install msgspec")
zmq = pytest.importorskip("zmq")

from router.events_feed import EventsFeed, SharedIndex  # noqa: E402
from router.registry import ModelFacts, WorkerRecord  # noqa: E402
from tests.integration.test_events_vllm_compat import (  # noqa: E402
    ArrayAllBlocksCleared, ArrayBlockRemoved, ArrayBlockStored, ArrayKVEventBatch)


class VllmStylePublisher:
    """What vLLM's ZmqEventPublisher puts on the wire, without its replay socket."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, *events) -> None:
        payload = self.encoder.encode(ArrayKVEventBatch(ts=time.time(), events=list(events)))
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def vllm_hashes(n: int) -> list[bytes]:
    """Chained 32-byte hashes, the shape of vLLM's sha256 block hashes (the router needs no knowledge of how)."""
    out, parent = [], b"root"
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def wait_for(condition, timeout_s: float = 10.0, publish=None) -> None:
    """PUB/SUB drops what is sent before the subscription lands: re-send the first batch until it does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the router's index never reflected the vLLM worker's events"
        if publish is not None:
            publish()
        time.sleep(0.05)


def test_router_index_follows_a_vllm_worker_event_stream():
    pub = VllmStylePublisher()
    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=0.5)
    record = WorkerRecord("vllm-0", "decode", "127.0.0.1:1", ModelFacts("m"),
                          kv_events_endpoint=f"tcp://127.0.0.1:{pub.port}")
    hashes = vllm_hashes(6)
    stored = ArrayBlockStored(block_hashes=hashes[:4], parent_block_hash=None, token_ids=list(range(64)),
                              block_size=16, lora_id=None, medium="GPU", lora_name=None)
    try:
        feed.subscribe(record)
        # Until the subscription lands, every publish is a new vLLM batch (seq 0, 1, ...) of the same blocks.
        wait_for(lambda: index.num_blocks("vllm-0") == 4, publish=lambda: pub.publish(stored))
        match = index.match(hashes).for_worker("vllm-0")
        assert match.tier_run("device") == 4

        pub.publish(ArrayBlockStored(block_hashes=hashes[4:], parent_block_hash=hashes[3], token_ids=list(range(32)),
                                     block_size=16, lora_id=None, medium="CPU", lora_name=None),
                    ArrayBlockRemoved(block_hashes=[hashes[3]], medium="GPU"))
        wait_for(lambda: index.match(hashes).for_worker("vllm-0").tier_run("device") == 3)
        assert index.num_blocks("vllm-0") == 5  # 0-2 on GPU (device), 4-5 on CPU (host); 3 is gone
        assert index.match(hashes[4:]).for_worker("vllm-0").tier_run("host") == 2

        pub.publish(ArrayAllBlocksCleared())
        wait_for(lambda: index.num_blocks("vllm-0") == 0)
        assert feed.stats()["vllm-0"].batches >= 3
        index.check_integrity()
    finally:
        feed.close()
        pub.close()
