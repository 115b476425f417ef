"""Strata's KV-event stream, read by subscribers written only from vLLM's published event schema.

The structs below are vLLM's (vllm/distributed/kv_events.py) as it has published them, declared with msgspec the
way vLLM declares them; nothing here imports Strata's codec. Each subscriber reads real ZeroMQ frames from a
Strata publisher and decodes them with msgspec, as Dynamo, llm-d and vLLM's own example subscriber do.

- `legacy`: vLLM 0.9-0.10 (examples/online_serving/kv_events_subscriber.py): array-like, int hashes, no
  data_parallel_rank, no lora_name. Readable with `hash_encoding="int"` (the schema says `list[int]`).
- `array`: the last array-like schema (through vLLM 0.23): `ExternalBlockHash = bytes | int`, `lora_name`, and the
  defaulted trailing fields added since (extra_keys, group_idx, kv_cache_spec_*).
- `map`: vLLM after PR #42892: events are tagged maps; the outer batch stays array-like.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Union

import pytest

msgspec = pytest.importorskip("msgspec", reason="msgspec is a test dependency: pip install msgspec")
zmq = pytest.importorskip("zmq")

from kvstore.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireOptions,
    ZmqEventPublisher,
    encode_batch,
)
from kvstore.hashing import Namespace, hash_blocks  # noqa: E402

ExternalBlockHash = Union[bytes, int]


# ---------------------------------------------------------------------------------- vLLM 0.9-0.10: "legacy"
class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(LegacyEventBatch):
    events: list[Union[LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared]]


# ------------------------------------------------------------------------ vLLM through 0.23: "array"
class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(ArrayEventBatch):
    events: list[Union[ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared]]


# --------------------------------------------------------------------- vLLM after PR #42892: "map"
class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(ArrayEventBatch):
    events: list[Union[MapBlockStored, MapBlockRemoved, MapAllBlocksCleared]]


SCHEMAS = {
    "legacy": (WireOptions("array", "int"), LegacyKVEventBatch),
    "array": (WireOptions("array", "bytes"), ArrayKVEventBatch),
    "map": (WireOptions("map", "bytes"), MapKVEventBatch),
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker


def make_events() -> list:
    hashes = hash_blocks(Namespace("m", "L1", "float16"), list(range(8)), 4)
    return [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                        lora_id=None, medium="host"),
            BlockStored(block_hashes=hashes[1:], parent_block_hash=hashes[0], token_ids=list(range(4, 8)),
                        block_size=4, lora_id=7, medium="redis"),
            BlockRemoved(block_hashes=hashes, medium="disk"),
            AllBlocksCleared()]


def wire_hash(h: bytes, opts: WireOptions):
    return int.from_bytes(h[-8:], "big") if opts.hash_encoding == "int" else h


def check_decoded(vllm_batch, events: list, opts: WireOptions) -> None:
    stored, chained, removed, cleared = vllm_batch.events
    assert type(stored).__name__.endswith("BlockStored") and type(cleared).__name__.endswith("AllBlocksCleared")
    assert stored.block_hashes == [wire_hash(h, opts) for h in events[0].block_hashes]
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (None, list(range(8)), 4)
    assert (stored.lora_id, stored.medium) == (None, "host")
    assert chained.parent_block_hash == wire_hash(events[1].parent_block_hash, opts)
    assert (chained.lora_id, chained.medium) == (7, "redis")
    assert removed.block_hashes == [wire_hash(h, opts) for h in events[2].block_hashes]
    assert removed.medium == "disk"


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_vllm_schema_subscriber_decodes_the_live_stream(schema):
    opts, batch_type = SCHEMAS[schema]
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv-events/worker-7",
                            data_parallel_rank=3, wire=opts)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")  # vLLM's default topic, as vLLM's subscriber sets it
    sub.connect(pub.endpoint)
    time.sleep(0.5)  # ZeroMQ's slow joiner: what is published before the subscription lands is not delivered
    decoder = msgspec.msgpack.Decoder(type=batch_type)
    events = make_events()
    pub.publish(events)
    pub.publish([AllBlocksCleared()])

    frames = [sub.recv_multipart() for _ in range(2)] if sub.poll(5000) else []
    assert [len(f) for f in frames] == [3, 3]
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1]
    assert frames[0][0] == b"kv-events/worker-7"
    batch = decoder.decode(frames[0][2])
    check_decoded(batch, events, opts)
    if schema != "legacy":
        assert batch.data_parallel_rank == 3
    sub.close(linger=0), pub.close()


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_vllm_replay_protocol_returns_buffered_batches_and_end_marker(schema):
    """A REQ-style replay request (empty delimiter + 8-byte start seq) gets [seq, payload]... then [-1, b""]."""
    opts, batch_type = SCHEMAS[schema]
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", wire=opts)
    for _ in range(5):
        pub.publish(make_events())
    assert pub.flush()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])

    replies = []
    while dealer.poll(5000):
        empty, seq, payload = dealer.recv_multipart()
        replies.append((seq, payload))
        if seq == END_SEQ:
            break
    assert [int.from_bytes(s, "big") for s, _ in replies[:-1]] == [2, 3, 4]
    assert replies[-1] == (END_SEQ, b"")
    decoder = msgspec.msgpack.Decoder(type=batch_type)
    for _, payload in replies[:-1]:
        check_decoded(decoder.decode(payload), make_events(), opts)
    dealer.close(linger=0), pub.close()


def test_vllm_req_socket_replay_gets_the_first_batch():
    """vLLM's example subscriber uses a REQ socket for replay; the ROUTER must answer it."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    pub.publish(make_events())
    assert pub.flush()
    req = zmq.Context.instance().socket(zmq.REQ)
    req.connect(pub.replay_endpoint)
    req.send((0).to_bytes(8, "big"))
    assert req.poll(5000)
    seq, payload = req.recv_multipart()
    assert int.from_bytes(seq, "big") == 0
    check_decoded(msgspec.msgpack.Decoder(type=ArrayKVEventBatch).decode(payload), make_events(),
                  WireOptions())
    req.close(linger=0), pub.close()


def test_map_payload_is_byte_identical_to_msgspec_encoding_of_the_same_batch():
    """msgspec writes the map schema's defaulted fields only when set, so our bytes must equal its bytes."""
    events = make_events()
    ours = encode_batch(KVEventBatch(ts=1.25, events=events, data_parallel_rank=0), WireOptions("map"))
    theirs = msgspec.msgpack.encode(MapKVEventBatch(ts=1.25, data_parallel_rank=0, events=[
        MapBlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                       token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id, medium=e.medium,
                       lora_name=None) for e in events[:2]] + [
        MapBlockRemoved(block_hashes=list(events[2].block_hashes), medium="disk"), MapAllBlocksCleared()]))
    assert ours == theirs


def test_strata_decodes_what_vllm_publishes():
    """The other direction: Strata's router can index vLLM workers, in either event shape and with int hashes."""
    from kvstore.events import decode_batch

    for batch_type, stored_type, removed_type, cleared_type in [
        (ArrayKVEventBatch, ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared),
        (MapKVEventBatch, MapBlockStored, MapBlockRemoved, MapAllBlocksCleared),
    ]:
        payload = msgspec.msgpack.encode(batch_type(ts=2.0, data_parallel_rank=1, events=[
            stored_type(block_hashes=[2**64 - 1, 5], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                        kv_cache_spec_kind="full_attention"),
            removed_type(block_hashes=[5], medium="GPU", group_idx=0), cleared_type()]))
        batch = decode_batch(payload)
        assert batch == KVEventBatch(ts=2.0, data_parallel_rank=1, events=[
            BlockStored([2**64 - 1, 5], None, [1, 2, 3, 4], 2, None, "GPU"), BlockRemoved([5], "GPU"),
            AllBlocksCleared()])


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_one_tier_clear_decodes_as_vllms_all_blocks_cleared(schema):
    """Strata's `AllBlocksCleared(medium=...)` (a flush of one tier) adds one trailing element or key that vLLM's
    decoders ignore: they read a clear of the publisher's every tier (an under-estimate, never a wrong hit), while
    Strata's own decoder keeps the medium. Without a medium the bytes are vLLM's own."""
    from kvstore.events import decode_batch

    opts, batch_type = SCHEMAS[schema]
    one_tier = KVEventBatch(ts=3.0, events=[AllBlocksCleared(medium="redis")], data_parallel_rank=0)
    payload = encode_batch(one_tier, opts)
    decoded = msgspec.msgpack.Decoder(type=batch_type).decode(payload)
    assert [type(e).__name__.removeprefix(schema.capitalize()) for e in decoded.events] == ["AllBlocksCleared"]
    assert decode_batch(payload).events == [AllBlocksCleared(medium="redis")]
    every_tier = KVEventBatch(ts=3.0, events=[AllBlocksCleared()], data_parallel_rank=0)
    cleared_type = {"legacy": LegacyAllBlocksCleared, "array": ArrayAllBlocksCleared, "map": MapAllBlocksCleared}
    theirs = msgspec.msgpack.encode(batch_type(ts=3.0, events=[cleared_type[schema]()], **(
        {} if schema == "legacy" else {"data_parallel_rank": 0})))
    if schema != "legacy":  # the legacy batch has no data_parallel_rank: its bytes differ in that element
        assert encode_batch(every_tier, opts) == theirs
    assert decode_batch(encode_batch(every_tier, opts)).events == [AllBlocksCleared()]
