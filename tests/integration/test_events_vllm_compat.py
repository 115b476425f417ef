"""Strata's KV-event stream against vLLM's own code (issue 18): the `kv_events` module from vLLM's published wheel
(`tests/vllm_wheel.py`; nothing of it is copied here) decodes what Strata publishes, live and replayed, and Strata's
bytes and replay frames are the ones vLLM's own `ZmqEventPublisher` sends for the same batch.

- a real Strata worker process: every batch it publishes (prefills, an eviction, a flush) decodes with vLLM's
  `msgspec.msgpack.Decoder(type=KVEventBatch)`, from the live stream and from a replay;
- the same batch through vLLM's publisher and Strata's: identical live and replay frames, byte for byte;
- Strata's decoder reads every field vLLM writes;
- the older shapes stay available as options: `WireOptions.preset("vllm-0.25")` (bare replay framing) and
  `"vllm-0.23"` (array events). vLLM's wheel no longer ships the array-like structs, so those are checked against
  a msgspec schema declared here from the vLLM 0.23 source.
"""
from __future__ import annotations

import random
import time
from typing import Any, Optional, Union

import pytest

msgspec = pytest.importorskip("msgspec", reason="msgspec is a test dependency: pip install -e .[test]")
zmq = pytest.importorskip("zmq")

from kvstore.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeStats,
    KVEventBatch,
    WireOptions,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
)
from kvstore.hashing import Namespace, hash_blocks  # noqa: E402
from tests.vllm_wheel import vllm  # noqa: E402,F401  (the session fixture)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
NS = Namespace("m", "L1", "float16")


def make_events() -> list:
    hashes = hash_blocks(NS, list(range(8)), 4)
    return [BlockStored(hashes, None, list(range(8)), 4, None, "host"),
            BlockStored(hashes[1:], hashes[0], list(range(4, 8)), 4, 7, "redis", lora_name="sql", group_idx=1,
                        extra_keys=[["sql", "salt"]]),
            BlockRemoved(hashes, "disk", group_idx=1),
            AllBlocksCleared()]


def as_vllm(kv, events: list, int_hashes: bool = False) -> list:
    """The same events as vLLM's own structs."""
    fold = (lambda h: int.from_bytes(h[-8:], "big")) if int_hashes else (lambda h: h)
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(kv.BlockStored(
                block_hashes=[fold(h) for h in e.block_hashes],
                parent_block_hash=None if e.parent_block_hash is None else fold(e.parent_block_hash),
                token_ids=e.token_ids, block_size=e.block_size, lora_id=e.lora_id, medium=e.medium,
                lora_name=e.lora_name, extra_keys=None if e.extra_keys is None else [tuple(k) for k in e.extra_keys],
                group_idx=e.group_idx))
        elif isinstance(e, BlockRemoved):
            out.append(kv.BlockRemoved(block_hashes=[fold(h) for h in e.block_hashes], medium=e.medium,
                                       group_idx=e.group_idx))
        else:
            out.append(kv.AllBlocksCleared())
    return out


def check_same(decoded, events: list) -> None:
    """vLLM's decoding of Strata's batch says what Strata meant: every field both sides declare is equal."""
    assert [type(e).__name__ for e in decoded.events] == [type(e).__name__ for e in events]
    for theirs, ours in zip(decoded.events, events):
        for name in ours.__dataclass_fields__:
            if name not in type(theirs).__struct_fields__:
                continue  # AllBlocksCleared.medium: Strata's addition, which vLLM's decoder ignores
            value = getattr(ours, name)
            if name == "extra_keys" and value is not None:
                value = [None if k is None else tuple(k) for k in value]
            assert getattr(theirs, name) == value, name


def recv_all(sock, n: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        got.append(sock.recv_multipart())
    return got


def replay(endpoint: str, start: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """A replay as vLLM's subscribers ask for it (REQ-style: empty delimiter + 8-byte start), every reply up to and
    including the end marker, as a DEALER receives them."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    try:
        while dealer.poll(int(timeout_s * 1000)):
            replies.append(dealer.recv_multipart())
            if END_SEQ in replies[-1]:
                break
    finally:
        dealer.close(linger=0)
    return replies


# ------------------------------------------------------------------------------------- a real Strata worker

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def worker_pair(tiny_checkpoint):
    from worker_common.launch import WorkerProcess

    base = ["--model", str(tiny_checkpoint("llama").path), "--transfer", "shm", "--num-blocks", "64",
            "--max-num-batched-tokens", "256", "--handoff-mib", "8", "--host-tier-mib", "8",
            "--block-size", str(BLOCK_SIZE)]
    prefill = WorkerProcess("prefill", [*base, "--worker-id", "prefill-vllm-compat"], wait=False)
    decode = WorkerProcess("decode", [*base, "--worker-id", "decode-vllm-compat"], wait=False)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllms_decoder_reads_every_batch_a_strata_worker_publishes_live_and_replayed(vllm, worker_pair):
    from engine.sampling_params import SamplingParams
    from strata.v1 import common_pb2
    from worker_common.client import disaggregated

    prefill, decode = worker_pair
    kv = vllm.kv_events
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")  # vLLM's default topic: every topic
    sub.connect(prefill.events_endpoint)
    time.sleep(0.5)  # ZeroMQ's slow joiner
    rng = random.Random(3)
    for i in range(3):  # device and host stores (the engine's blocks, the store's write-through)
        prompt = [rng.randrange(3, 203) for _ in range(2 * BLOCK_SIZE + 5)]
        disaggregated(prefill.stub(), decode.stub(), f"compat-{i}", prompt, SamplingParams(max_tokens=2))
    stub = prefill.stub()
    stub.EvictCache(common_pb2.EvictCacheRequest(tier="host", bytes=1 << 20), timeout=30)  # removals
    stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30)  # every tier: AllBlocksCleared

    live = recv_all(sub, 100, timeout_s=5.0)
    sub.close(linger=0)
    assert live, "the worker published nothing"
    kinds = set()
    for topic, seq, payload in live:
        assert topic == b"kv-events/prefill-vllm-compat" and len(seq) == 8
        batch = decoder.decode(payload)  # raises on anything vLLM's schema does not accept
        check_same(batch, decode_batch(payload).events)
        kinds |= {type(e).__name__ for e in batch.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}

    replies = replay(prefill.replay_endpoint, 0)
    assert replies[-1] == [b"", b"", END_SEQ, b""]  # vLLM >= 0.26's end of replay
    seqs = []
    for empty, topic, seq, payload in replies[:-1]:
        assert (empty, topic) == (b"", b"kv-events/prefill-vllm-compat")
        seqs.append(int.from_bytes(seq, "big"))
        check_same(decoder.decode(payload), decode_batch(payload).events)
    assert seqs == list(range(len(seqs))) and len(seqs) >= len(live)


# ------------------------------------------------------------------------------- vLLM's publisher, side by side

@pytest.mark.parametrize("int_hashes", [False, True])
def test_payload_is_byte_identical_to_vllms_encoding_of_the_same_batch(vllm, int_hashes):
    kv = vllm.kv_events
    events = make_events()
    theirs = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.25, events=as_vllm(kv, events, int_hashes),
                                                    data_parallel_rank=0))
    ours = encode_batch(KVEventBatch(1.25, events, 0), WireOptions(hash_encoding="int" if int_hashes else "bytes"))
    assert ours == theirs


def test_live_and_replay_frames_equal_vllms_publishers(vllm):
    """The same batch through vLLM's ZmqEventPublisher and Strata's: the same three live frames, the same replay
    replies and end marker, byte for byte."""
    kv = vllm.kv_events
    events = make_events()
    topic = "kv-events/w0"
    theirs = kv.ZmqEventPublisher(0, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=topic)
    ours = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=topic)
    subs = []
    try:
        for endpoint in (_bound(theirs._pub), ours.endpoint):
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt_string(zmq.SUBSCRIBE, "")
            sub.connect(endpoint)
            subs.append(sub)
        time.sleep(0.5)
        for _ in range(3):
            theirs.publish(kv.KVEventBatch(ts=2.5, events=as_vllm(kv, events)))
            ours.publish_batch(KVEventBatch(2.5, events))
        assert ours.flush()
        live = [recv_all(sub, 3) for sub in subs]
        assert live[0] == live[1] and len(live[0]) == 3
        replays = [replay(_bound(theirs._replay), 1), replay(ours.replay_endpoint, 1)]
        assert replays[0] == replays[1]
        assert [len(r) for r in replays[0]] == [4, 4, 4]
    finally:
        for sub in subs:
            sub.close(linger=0)
        theirs.shutdown()
        ours.close()


def _bound(sock) -> str:
    """Where a socket of vLLM's publisher is bound (it keeps the `tcp://127.0.0.1:*` it was given)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_strata_decodes_every_field_vllm_writes(vllm):
    kv = vllm.kv_events
    stored = kv.BlockStored(block_hashes=[2**64 - 1, 5], parent_block_hash=9, token_ids=[1, 2, 3, 4], block_size=2,
                            lora_id=3, medium="STORAGE", lora_name="sql", extra_keys=[("sql", "salt"), None],
                            group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
                            locality="LOCAL", ownership="tier-2", session_id="s-1",
                            lookahead_token_ids=[[5], [6]])
    removed = kv.BlockRemoved(block_hashes=[5], medium="CPU", group_idx=1, locality="REMOTE", ownership="o")
    payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=2.0, data_parallel_rank=1,
                                                     events=[stored, removed, kv.AllBlocksCleared()]))
    stats = DecodeStats()
    batch = decode_batch(payload, stats)
    assert batch == KVEventBatch(ts=2.0, data_parallel_rank=1, events=[
        BlockStored([2**64 - 1, 5], 9, [1, 2, 3, 4], 2, 3, "STORAGE", "sql", [["sql", "salt"], None], 1),
        BlockRemoved([5], "CPU", 1), AllBlocksCleared()])
    assert stats.total == 0, "every field vLLM writes is one Strata knows"


def test_one_tier_clear_reads_as_vllms_all_blocks_cleared(vllm):
    """Strata's `AllBlocksCleared(medium=...)` adds a key vLLM's decoder ignores: it reads a clear of the
    publisher's every tier (an under-estimate, never a wrong hit); Strata's own decoder keeps the medium."""
    payload = encode_batch(KVEventBatch(3.0, [AllBlocksCleared(medium="redis")], 0))
    decoded = msgspec.msgpack.Decoder(type=vllm.kv_events.KVEventBatch).decode(payload)
    assert [type(e).__name__ for e in decoded.events] == ["AllBlocksCleared"]
    assert decode_batch(payload).events == [AllBlocksCleared(medium="redis")]


# ------------------------------------------------------------------------------------------- the older shapes

def test_vllm_0_25_preset_frames_replays_without_the_topic(vllm):
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="t", wire=WireOptions.preset("vllm-0.25"))
    try:
        for _ in range(3):
            pub.publish(make_events())
        assert pub.flush()
        replies = replay(pub.replay_endpoint, 1)
    finally:
        pub.close()
    assert [len(r) for r in replies] == [3, 3, 3] and replies[-1] == [b"", END_SEQ, b""]
    decoder = msgspec.msgpack.Decoder(type=vllm.kv_events.KVEventBatch)  # map events, as 0.24 - 0.25 read them
    for _, seq, payload in replies[:-1]:
        check_same(decoder.decode(payload), make_events())


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):  # vLLM 0.23's, declared from its source
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def test_vllm_0_23_preset_is_the_array_like_encoding():
    """Array events, cut after the last field that is set: shorter arrays decode under every array-era schema
    (msgspec fills the later, defaulted fields and ignores trailing elements it does not declare)."""
    events = make_events()
    payload = encode_batch(KVEventBatch(1.0, events, 0), WireOptions.preset("vllm-0.23"))
    decoded = msgspec.msgpack.Decoder(type=_ArrayBatch).decode(payload)
    assert decoded.data_parallel_rank == 0
    for theirs, ours in zip(decoded.events, events):
        for name in theirs.__struct_fields__:
            value = getattr(ours, name)
            assert getattr(theirs, name) == (value if name != "extra_keys" or value is None
                                             else [tuple(k) for k in value]), name
    assert decode_batch(payload) == KVEventBatch(1.0, events, 0)
