"""Snapshots on a replay gap (DESIGN §6, issue 15 item 4), over real ZeroMQ sockets.

A relay between the publisher and the router's feed drops a run of live batches longer than the publisher's replay
buffer, so the feed's subscriber meets a gap replay cannot fill: it loads the publisher's snapshot, and the router's
index then equals what the publisher holds; later batches apply on top. A publisher that serves no snapshots (an
older Strata one, or vLLM's, which answers the request with its end-of-replay marker) leaves the old behaviour: the
gap is reported as lost."""
from __future__ import annotations

import threading
import time

import zmq

from kvstore.events import (AllBlocksCleared, BlockRemoved, BlockStored, Holdings, ZmqEventPublisher,
                            ZmqEventSubscriber, worker_topic)
from kvstore.events.wire import END_OF_REPLAY, decode_seq
from router.events_feed import EventsFeed, SharedIndex
from router.index import TIERS, normalize_medium
from router.registry import ModelFacts, WorkerRecord

LOOPBACK = "tcp://127.0.0.1:*"
WORKER = "worker-snap"


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(ids: range | list[int], medium: str) -> BlockStored:
    ids = list(ids)
    return BlockStored(block_hashes=[h(i) for i in ids], parent_block_hash=None, token_ids=[1] * 2 * len(ids),
                       block_size=2, medium=medium)


def removed(ids: range | list[int], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h(i) for i in ids], medium=medium)


def expected_index(book: Holdings) -> dict[bytes, tuple[str, ...]]:
    """What `PrefixIndex.blocks_of` reports for a worker holding `book`: hash -> tiers, fastest first."""
    tiers: dict[bytes, set[str]] = {}
    for medium, hashes in book.items():
        for block in hashes:
            tiers.setdefault(block, set()).add(normalize_medium(medium))
    return {block: tuple(t for t in TIERS if t in ts) for block, ts in tiers.items()}


class Relay:
    """SUB on the publisher, PUB for the feed: forwards the live stream, except the batches told to drop."""

    def __init__(self, upstream: str) -> None:
        ctx = zmq.Context.instance()
        self.sub, self.pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.next_seq = 0

    def pump(self, until_seq: int, drop: bool = False, timeout_s: float = 10.0) -> None:
        """Forward (or drop) every batch up to `until_seq` as it arrives from the publisher."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq <= until_seq:
            assert self.sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), "the relay got nothing"
            frames = self.sub.recv_multipart()
            self.next_seq = decode_seq(frames[1]) + 1
            if not drop:
                self.pub.send_multipart(frames)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.pub.close(linger=0)


def wait_for(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def publish(pub: ZmqEventPublisher, book: Holdings, *events) -> int:
    """Publish one batch and mirror it in the test's own book; its sequence number."""
    seq = pub.next_seq
    pub.publish(list(events))
    book.apply(events)
    assert pub.flush()
    return seq


def test_router_index_equals_the_workers_holdings_after_a_gap_past_the_replay_buffer():
    pub = ZmqEventPublisher(LOOPBACK, LOOPBACK, topic=worker_topic(WORKER), buffer_steps=4)
    relay = Relay(pub.endpoint)
    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=2.0)
    book = Holdings()
    try:
        time.sleep(0.3)  # the relay's SUB must be connected before the first batch (it does not replay)
        feed.subscribe(WorkerRecord(WORKER, "decode", "127.0.0.1:1", ModelFacts("m"),
                                    kv_events_endpoint=relay.endpoint, kv_replay_endpoint=pub.replay_endpoint))
        for i in range(3):
            relay.pump(publish(pub, book, stored(range(10 * i, 10 * i + 4), "device")))
        wait_for(lambda: index.num_blocks(WORKER) == 12)  # (the feed's own catch-up covers a slow SUB)
        assert feed.stats()[WORKER].snapshots == 0

        # 20 batches the feed never sees (the buffer keeps 4): stores, removals, a one-tier clear.
        for i in range(20):
            events = [stored(range(100 + 3 * i, 103 + 3 * i), "host"), removed([100 + 3 * i - 2], "host")]
            if i == 5:
                events.append(AllBlocksCleared(medium="device"))
            if i == 12:
                events.append(stored([0, 1], "disk"))
            relay.pump(publish(pub, book, *events), drop=True)
        relay.pump(publish(pub, book, removed([161], "host"), stored([7], "device")))  # reveals the gap

        wait_for(lambda: feed.stats()[WORKER].snapshots >= 1)
        wait_for(lambda: index.num_blocks(WORKER) == len(expected_index(book)))
        with index._lock:  # the feed thread writes under this lock
            assert index._index.blocks_of(WORKER) == expected_index(book)

        # Batches after the snapshot apply on top of it.
        relay.pump(publish(pub, book, removed([0, 1], "disk"), stored([500, 501], "redis")))
        wait_for(lambda: index.match([h(500), h(501)]).pooled_blocks == 2)
        with index._lock:
            assert index._index.blocks_of(WORKER) == expected_index(book)
            assert index._index.expected_seq(WORKER) == pub.next_seq
        index.check_integrity()
    finally:
        feed.close()
        relay.close()
        pub.close()


def test_a_late_subscriber_loads_a_snapshot_instead_of_reporting_loss():
    pub = ZmqEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3)
    book = Holdings()
    publish(pub, book, stored([0], "host"))
    for i in range(1, 10):
        publish(pub, book, stored([i], "host"), removed([i - 1], "host"))
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, from_seq=0, snapshots=True)
    try:
        assert sub.catch_up() == 1
        item = sub.recv(timeout_s=1.0)
        assert item.snapshot is not None and item.seq == 9 and item.lost_before == 0
        assert item.snapshot.tiers == (("host", (h(9),)),) and item.snapshot.next_seq == 10
        assert (sub.snapshots_loaded, sub.batches_lost, sub.last_seq) == (1, 0, 9)
        publish(pub, book, stored([11], "disk"))
        item = sub.recv(timeout_s=5.0) or (sub.catch_up(), sub.recv(timeout_s=1.0))[1]
        assert (item.seq, item.snapshot, item.batch.events) == (10, None, [stored([11], "disk")])
    finally:
        sub.close()
        pub.close()


def test_a_publisher_without_snapshots_leaves_the_gap_reported_as_lost():
    """An older Strata publisher ignores the request: it times out, and the gap is lost as before."""
    pub = ZmqEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3, snapshots=False)
    for i in range(10):
        pub.publish([stored([i], "host")])
    assert pub.flush()
    sub = ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, from_seq=0, snapshots=True, replay_timeout_s=0.3)
    try:
        sub.catch_up()
        got = [sub.recv(timeout_s=1.0) for _ in range(3)]
        assert [(r.seq, r.lost_before, r.snapshot) for r in got] == [(7, 7, None), (8, 0, None), (9, 0, None)]
        assert (sub.snapshots_loaded, sub.snapshots_refused) == (0, 1)
    finally:
        sub.close()
        pub.close()


def vllm_replay_server(sock: zmq.Socket, buffer: list[tuple[int, bytes]], stop: threading.Event) -> None:
    """vLLM's `ZmqEventPublisher._service_replay`, as it reads a request: three frames, the third a big-endian
    start seq of any length, every buffered batch from it, then the end marker."""
    while not stop.is_set():
        if not sock.poll(20):
            continue
        frames = sock.recv_multipart()
        if len(frames) != 3:
            continue
        client, _, start = frames
        for seq, payload in buffer:
            if seq >= int.from_bytes(start, "big"):
                sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", END_OF_REPLAY, b""))


def test_a_vllm_publisher_refuses_a_snapshot_request_with_its_end_of_replay_marker():
    pub = ZmqEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3)  # its live stream; replays come from the fake
    for i in range(6):
        pub.publish([stored([i], "host")])
    assert pub.flush()
    ctx = zmq.Context.instance()
    replay = ctx.socket(zmq.ROUTER)
    port = replay.bind_to_random_port("tcp://127.0.0.1")
    from kvstore.events import KVEventBatch, encode_batch
    buffer = [(s, encode_batch(KVEventBatch(0.0, [stored([s], "host")]))) for s in (4, 5)]
    stop = threading.Event()
    server = threading.Thread(target=vllm_replay_server, args=(replay, buffer, stop), daemon=True)
    server.start()
    sub = ZmqEventSubscriber(pub.endpoint, f"tcp://127.0.0.1:{port}", from_seq=0, snapshots=True,
                             replay_timeout_s=5.0)
    try:
        started = time.monotonic()
        assert sub.catch_up() == 2
        assert time.monotonic() - started < 2.0  # refused at once, not after the replay timeout
        assert [(r.seq, r.lost_before) for r in (sub.recv(1.0), sub.recv(1.0))] == [(4, 4), (5, 0)]
        assert sub.snapshots_refused == 1
    finally:
        stop.set()
        server.join(2)
        sub.close()
        replay.close(linger=0)
        pub.close()
