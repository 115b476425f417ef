"""The router's prefix index follows vLLM's own publisher (issue 18): `ZmqEventPublisher` from vLLM's published
wheel (`tests/vllm_wheel.py`), with block hashes from vLLM's own `hash_block_tokens`, feeds Strata's `EventsFeed`
through real sockets, live and replayed; every medium vLLM has emitted is survived, unknown ones are counted; a
hybrid model's per-group removals are honoured; and the router's own hashes of the prompt find the blocks."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("msgspec", reason="msgspec is a test dependency: pip install -e .[test]")
zmq = pytest.importorskip("zmq")

from kvstore.events import ZmqEventSubscriber  # noqa: E402
from router.events_feed import EventsFeed, SharedIndex  # noqa: E402
from router.registry import ModelFacts, WorkerRecord  # noqa: E402
from router.vllm_hashing import VllmHashConfig, event_key, vllm_block_keys  # noqa: E402
from tests.vllm_wheel import vllm  # noqa: E402,F401  (the session fixture)

BLOCK = 16
CONFIG = VllmHashConfig(BLOCK, "sha256")
# Every medium vLLM has published: GPU, CPU and STORAGE (0.33+), FS and OBJ (0.26-0.32); and one no release has.
MEDIA = {"GPU": "device", "CPU": "host", "STORAGE": "disk", "FS": "disk", "OBJ": "disk"}


class VllmWorker:
    """vLLM's own publisher, and its hashing of prompts (NONE_HASH set as its engine sets it at start)."""

    def __init__(self, vllm, buffer_steps: int = 10_000) -> None:
        self.kv, self.utils = vllm.kv_events, vllm.kv_cache_utils
        self.hash_fn = vllm.hashing.get_hash_fn_by_name(CONFIG.hash_algo)
        self.utils.init_none_hash(self.hash_fn)
        self.pub = self.kv.ZmqEventPublisher(0, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=buffer_steps)
        self.endpoint = self.pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # it keeps the `*` it was given
        self.replay_endpoint = self.pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def hashes(self, tokens: list[int]) -> list[bytes]:
        out, parent = [], None
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = self.utils.hash_block_tokens(self.hash_fn, parent, tokens[start:start + BLOCK])
            out.append(parent)
        return out

    def stored(self, tokens: list[int], medium: str = "GPU", group: int = 0, as_ints: bool = True):
        fold = self.utils.maybe_convert_block_hash if as_ints else (lambda h: h)
        return self.kv.BlockStored(block_hashes=[fold(h) for h in self.hashes(tokens)], parent_block_hash=None,
                                   token_ids=tokens, block_size=BLOCK, lora_id=None, medium=medium, lora_name=None,
                                   group_idx=group)

    def removed(self, tokens: list[int], medium: str = "GPU", group: int = 0):
        fold = self.utils.maybe_convert_block_hash
        return self.kv.BlockRemoved(block_hashes=[fold(h) for h in self.hashes(tokens)], medium=medium,
                                    group_idx=group)

    def publish(self, *events) -> None:
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=list(events)))

    def close(self) -> None:
        self.pub.shutdown()


def prompt(seed: int, blocks: int = 4) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(blocks * BLOCK)]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the router's index never reflected the vLLM worker's events"
        time.sleep(0.05)


def run_on(index: SharedIndex, worker_id: str, tokens: list[int], tier: str) -> int:
    """The leading run of `tokens` the router finds on the worker in `tier`, hashing the prompt itself."""
    return index.match(vllm_block_keys(CONFIG, tokens)).for_worker(worker_id).tier_run(tier)


@pytest.fixture
def worker(vllm):
    w = VllmWorker(vllm)
    yield w
    w.close()


def follow(worker: VllmWorker, feed: EventsFeed, worker_id: str = "vllm-0") -> None:
    feed.subscribe(WorkerRecord(worker_id, "both", "http://127.0.0.1:1", ModelFacts("m"),
                                kv_events_endpoint=worker.endpoint, kv_replay_endpoint=worker.replay_endpoint),
                   key=event_key)


def test_router_indexes_vllms_publisher_replayed_then_live(worker):
    """Batches published before the router subscribed arrive by replay (vLLM >= 0.26's framing); later ones live."""
    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=1.0)
    early, late = prompt(1), prompt(2)
    worker.publish(worker.stored(early))
    worker.publish(worker.stored(early[:2 * BLOCK], medium="CPU"))
    try:
        follow(worker, feed)
        wait_for(lambda: run_on(index, "vllm-0", early, "device") == 4)  # only a replay can have brought it
        assert run_on(index, "vllm-0", early, "host") == 2
        time.sleep(0.3)
        worker.publish(worker.stored(late, as_ints=False))  # a publisher sending digests is keyed the same
        wait_for(lambda: run_on(index, "vllm-0", late, "device") == 4)
        worker.publish(worker.removed(early[:BLOCK]))
        wait_for(lambda: run_on(index, "vllm-0", early, "device") == 0)
        stats = feed.stats()["vllm-0"]
        assert stats.batches == 4 and stats.resyncs == 0 and stats.last_seq == 3
        index.check_integrity()
    finally:
        feed.close()


def test_every_medium_vllm_emits_is_survived_and_an_unknown_one_counted(worker):
    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=1.0)
    try:
        follow(worker, feed)
        time.sleep(0.3)
        for i, medium in enumerate([*MEDIA, "NVME_X"]):
            worker.publish(worker.stored(prompt(10 + i), medium=medium))
        worker.publish(worker.stored(prompt(99)))  # the feed is still there after the unknown medium
        wait_for(lambda: run_on(index, "vllm-0", prompt(99), "device") == 4)
        for i, (medium, tier) in enumerate(MEDIA.items()):
            assert run_on(index, "vllm-0", prompt(10 + i), tier) == 4, medium
        assert run_on(index, "vllm-0", prompt(10 + len(MEDIA)), "device") == 0
        stats = feed.stats()["vllm-0"]
        assert (stats.unknown_media, stats.resyncs, stats.connected) == (1, 0, True)
    finally:
        feed.close()


def test_a_removal_in_one_kv_cache_group_keeps_the_block_another_group_holds(worker):
    """A hybrid model stores a block once per KV-cache group; a sliding-window group's eviction must not drop the
    hash the full-attention group still holds."""
    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=1.0)
    tokens = prompt(5)
    try:
        follow(worker, feed)
        time.sleep(0.3)
        worker.publish(worker.stored(tokens, group=0), worker.stored(tokens, group=1))
        worker.publish(worker.removed(tokens[:2 * BLOCK], group=1))
        worker.publish(worker.stored(prompt(6)))
        wait_for(lambda: run_on(index, "vllm-0", prompt(6), "device") == 4)
        assert run_on(index, "vllm-0", tokens, "device") == 4
        worker.publish(worker.removed(tokens[:2 * BLOCK], group=0))
        wait_for(lambda: run_on(index, "vllm-0", tokens, "device") == 0)
        index.check_integrity()
    finally:
        feed.close()


def test_a_gap_past_vllms_buffer_is_refused_a_snapshot_at_once_and_reported_lost(vllm):
    """vLLM's publisher answers Strata's snapshot request with its (4-frame) end marker: the subscriber reads the
    refusal at once, not after a timeout, and reports the hole."""
    worker = VllmWorker(vllm, buffer_steps=2)
    try:
        for i in range(5):
            worker.publish(worker.stored(prompt(20 + i)))
        time.sleep(0.3)
        sub = ZmqEventSubscriber(worker.endpoint, worker.replay_endpoint, topic="", from_seq=0, snapshots=True,
                                 replay_timeout_s=5.0)
        started = time.monotonic()
        assert sub.catch_up() == 2
        assert time.monotonic() - started < 2.0
        first, second = sub.recv(0), sub.recv(0)
        assert (first.seq, first.lost_before, first.replayed, second.seq) == (3, 3, True, 4)
        assert sub.snapshots_refused == 1
        sub.close()
    finally:
        worker.close()


def test_a_batch_that_fails_to_apply_resyncs_the_worker_and_the_feed_goes_on():
    """A hash the index cannot key (here an array) fails that batch: the worker's entries are dropped, as for a lost
    batch, and the next batches apply; the feed never stops."""
    import msgpack

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = SharedIndex()
    feed = EventsFeed(index, replay_timeout_s=0.2)

    def stored(hashes) -> bytes:
        return msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                                     "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU",
                                     "lora_name": None}], 0])
    try:
        feed.subscribe(WorkerRecord("odd", "both", "http://127.0.0.1:1", ModelFacts("m"),
                                    kv_events_endpoint=f"tcp://127.0.0.1:{port}"))
        time.sleep(0.5)
        for seq, payload in enumerate([stored([1, 2]), stored([[3, 4]]), stored([5])]):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        wait_for(lambda: feed.stats()["odd"].last_seq == 2)
        stats = feed.stats()["odd"]
        assert (stats.apply_errors, stats.resyncs, stats.connected) == (1, 1, True)
        assert index.num_blocks("odd") == 1  # 1 and 2 went with the resync; 5 came after it
    finally:
        feed.close()
        pub.close(linger=0)
