"""Quantized (fp8 / int8) KV blocks through the real store tiers and transfer backends (issue 12, item 3).

A block of an fp8 engine is its span `scales | values` (engine/kv_cache.py); encoded, the scales ride in the codec's
scales section right before the payload. Here such blocks go through every tier (host, disk, a real redis-server,
moto's S3) and over every transfer backend (shm, tcp) byte for byte, are installed into another fp8 engine and
continue the request token-exactly like one engine alone. A block of another KV dtype, or with a scales section
of the wrong length, is a counted miss (`CorruptBlock`) and is never installed.

(NIXL: the disaggregated P/D tests run it between worker processes; its adapter moves the same encoded bytes.)
"""
from __future__ import annotations

import dataclasses
import random
import struct

import numpy as np
import pytest
import xxhash

from engine.sampling_params import SamplingParams
from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, S3TierConfig, StoreConfig
from kvstore.hashing import hash_blocks
from kvstore.store import TieredStore
from kvstore.transfer import TransferConfig, create_agent
from decode_worker.kv_pull import KvPuller
from prefill_worker.kv_export import KvExporter
from worker_common.admission import admit
from worker_common.engine_loop import EngineLoop, Tracked
from worker_common.engine_setup import EngineBundle, build_engine_from
from worker_common.handoff_pool import HandoffPool
from worker_common.kv_blocks import encode_block, read_device_payloads, slot_bytes, verified_payload
from worker_common.leases import LeaseTable
from worker_common.prefix_load import load_from_store

BS = 16
PROMPT = [random.Random(12).randrange(3, 200) for _ in range(3 * BS + 7)]   # 3 full blocks + a 7-token tail
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


# ---------------------------------------------------------------------------------------------------- factories
@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


def make_bundle(model: str, kv_cache_dtype: str = "fp8") -> EngineBundle:
    return build_engine_from(model, block_size=BS, num_blocks=64, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    """The tokens one fp8 engine alone generates for PROMPT."""
    return make_bundle(model).engine.generate([PROMPT], PARAMS)[0].token_ids


class Exported:
    """A prefill: the first token, and the full blocks' hashes, device spans and encoded bytes."""

    def __init__(self, bundle: EngineBundle, prompt: list[int] = PROMPT) -> None:
        self.bundle, self.fp = bundle, bundle.fingerprint_for("")
        request = bundle.engine.add_request("prefill", prompt, dataclasses.replace(PARAMS, max_tokens=1))
        while not request.is_finished:
            bundle.engine.step()
        self.request, self.first = request, request.output_token_ids[0]
        self.hashes = hash_blocks(self.fp, prompt, BS)
        self.block_ids = [bundle.engine.block_manager.pool.lookup(h) for h in self.hashes]
        self.spans = read_device_payloads(bundle, self.block_ids)                     # uint8 [n, span]
        self.encoded = [self._encode(i, span) for i, span in enumerate(self.spans)]

    def _encode(self, i: int, span: np.ndarray) -> bytes:
        out = bytearray(slot_bytes(self.bundle))
        n = encode_block(memoryview(out), self.bundle, self.fp, self.hashes[i], self.hashes[i - 1] if i else None,
                         PROMPT[i * BS:(i + 1) * BS], span)
        return bytes(out[:n])

    def items(self) -> list[tuple[bytes, bytes]]:
        return list(zip(self.hashes, self.encoded))


def run_admitted(bundle: EngineBundle, hashes, payloads, first: int, tail=None) -> tuple[list[int], list[int]]:
    """Admit PROMPT with the given blocks (and tail) and run it to the end: (tokens, installed device block ids)."""
    loop, tracked = EngineLoop(bundle), Tracked(None)
    installed = admit(loop, tracked, "decode", PROMPT, PARAMS, bundle.fingerprint_for(""), hashes, payloads, [first],
                      tail)
    outputs = []
    while bundle.engine.has_unfinished():
        outputs += bundle.engine.step()
    bundle.engine.block_manager.pool.release(tracked.pinned)
    bundle.engine.block_manager.check_integrity()
    return outputs[-1].token_ids, installed.pinned


def assert_scales_section_is_the_span_head(exported: Exported, data: bytes | memoryview, i: int) -> None:
    block = codec.decode(data, exported.fp, exported.hashes[i], exported.bundle.layout)
    layout, cache = exported.bundle.layout, exported.bundle.runner.cache
    assert block.header.dtype == exported.bundle.kv_dtype and block.header.scales_len == layout.scale_bytes(
        exported.bundle.kv_dtype) == layout.num_layers * 2 * layout.kv_heads * 4
    scales = np.frombuffer(block.scales, dtype=np.float32).reshape(layout.num_layers, 2, layout.kv_heads)
    block_id = exported.block_ids[i]
    for layer, views in enumerate(cache.layers):
        assert scales[layer, 0].tolist() == views.k_scale[block_id].tolist()
        assert scales[layer, 1].tolist() == views.v_scale[block_id].tolist()
    assert (scales > 0).all(), "every head of a written block has a scale"
    assert bytes(block.span) == exported.spans[i].tobytes()


def reseal(buf: bytearray) -> bytearray:
    body = codec.HEADER_SIZE - 8
    buf[body:codec.HEADER_SIZE] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:body])))
    return buf


# -------------------------------------------------------------------------------------------------------- tiers
def store_config(tier: str, tmp_path, request) -> StoreConfig:
    host = HostTierConfig(capacity_bytes=64 << 10, slot_bytes=4 << 10)
    if tier == "host":
        return StoreConfig(host=host)
    if tier == "disk":
        return StoreConfig(host=host, disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=1 << 20),
                           write_through=("disk",))
    if tier == "redis":
        server = request.getfixturevalue("redis_server")
        prefix = request.getfixturevalue("redis_key_prefix")
        return StoreConfig(host=host, redis=RedisTierConfig(url=server.url, key_prefix=prefix),
                           write_through=("redis",))
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    return StoreConfig(host=host, s3=S3TierConfig(bucket=bucket, endpoint_url=server.url, region=server.region),
                       write_through=("s3",))


@pytest.mark.parametrize("tier, kv_cache_dtype", [("host", "fp8"), ("disk", "fp8"), ("redis", "fp8"),
                                                  ("s3", "fp8"), ("disk", "int8")])
def test_quantized_blocks_round_trip_every_tier_byte_exactly_and_resume_token_exactly(
        model, tier, kv_cache_dtype, tmp_path, request):
    exported = Exported(make_bundle(model, kv_cache_dtype))
    with TieredStore(store_config(tier, tmp_path, request)) as store:
        store.put(exported.items())
        assert store.flush(30)
        if tier != "host":
            store.tier("host").clear()      # so the blocks can only come from `tier`
        bufs = [bytearray(slot_bytes(exported.bundle)) for _ in exported.hashes]
        got = store.get(exported.hashes, bufs, exported.fp, hint=[tier] * len(exported.hashes))
        assert got.tiers == [tier] * 3
        for i, block in enumerate(got.blocks):
            assert bytes(bufs[i][:block.header.encoded_len]) == exported.encoded[i]
            assert_scales_section_is_the_span_head(exported, bufs[i], i)
        if tier != "host":
            store.tier("host").clear()      # the get promoted them
        decode = make_bundle(model, kv_cache_dtype)
        loaded = load_from_store(decode, store, exported.hashes, exported.fp)
        assert loaded.by_tier == {tier: 3}
        tokens, installed = run_admitted(decode, exported.hashes, loaded.payloads, exported.first)
    want = make_bundle(model, kv_cache_dtype).engine.generate([PROMPT], PARAMS)[0].token_ids
    assert tokens == want
    assert (decode.runner.read_blocks(installed).numpy() == exported.spans).all()


# ---------------------------------------------------------------------------------------------------- transfers
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_quantized_hand_off_over_a_transfer_backend_is_byte_and_token_exact(model, reference, backend):
    """The prefill side exports (KvExporter: blocks and the zero-padded tail block, scales included), the decode
    side reads them one-sided (KvPuller) and installs them: every block and the tail came over the transfer."""
    prefill, decode = make_bundle(model), make_bundle(model)
    exported = Exported(prefill)
    owner, reader = create_agent(TransferConfig(backend=backend)), create_agent(TransferConfig(backend=backend))
    stores = [TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=64 << 10, slot_bytes=4 << 10)))
              for _ in range(2)]
    pool = HandoffPool(owner, slot_bytes(prefill), 1 << 20)
    leases = LeaseTable(owner, pool)
    try:
        exporter = KvExporter(prefill, stores[0], owner, pool, leases, "prefill-0")
        handle = exporter.export(PROMPT, exported.hashes, exported.fp, 30.0, exported.request.freed_block_ids).handle
        assert len(handle.blocks) == 3 and handle.tail_tokens == 7
        for i, location in enumerate(handle.blocks):
            assert location.length == len(exported.encoded[i])       # header + tokens + scales + payload
        pulled = KvPuller(decode, stores[1], reader, deadline_s=10.0).pull(handle, 3, PROMPT)
        assert (pulled.transferred, pulled.from_store, pulled.reason) == (3, 0, "")
        assert [bytes(p) for p in pulled.payloads] == [span.tobytes() for span in exported.spans]
        tail = np.frombuffer(pulled.tail, dtype=np.uint8)
        values = tail[prefill.layout.scale_bytes(prefill.kv_dtype):].reshape(2, 2, BS, -1)
        assert values[:, :, :7].any() and not values[:, :, 7:].any(), "the tail's unused slots are zeros"
        tokens, _ = run_admitted(decode, exported.hashes, pulled.payloads, exported.first, pulled.tail)
        assert tokens == reference
    finally:
        leases.close()
        pool.close()
        for store in stores:
            store.close()
        reader.close()
        owner.close()


# ------------------------------------------------------------------------------------------ never the wrong KV
@pytest.mark.parametrize("other", ["int8", "auto"])
def test_a_block_of_another_kv_dtype_is_refused_and_never_installed(model, other):
    """A block of another KV dtype under this worker's own namespace and hash (a namespace bug, or a forged
    block) fails verification naming the dtype, and a store holding it serves nothing to install."""
    fp8 = make_bundle(model)
    foreign = Exported(make_bundle(model, other))
    fp = fp8.fingerprint_for("")
    hashes = hash_blocks(fp, PROMPT, BS)
    blocks = []
    for i, span in enumerate(foreign.spans):
        out = bytearray(slot_bytes(foreign.bundle))
        n = encode_block(memoryview(out), foreign.bundle, fp, hashes[i], None, PROMPT[i * BS:(i + 1) * BS], span)
        blocks.append(bytes(out[:n]))
    with pytest.raises(codec.CorruptBlock) as info:
        verified_payload(fp8, memoryview(blocks[0]), fp, hashes[0])
    assert info.value.reason == "dtype"
    with TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=64 << 10, slot_bytes=8 << 10))) as store:
        store.put(list(zip(hashes, blocks)))
        loaded = load_from_store(fp8, store, hashes, fp)
    assert list(loaded.payloads) == [] and loaded.by_tier == {}
    assert all(fp8.engine.block_manager.pool.lookup(h) is None for h in hashes)


def test_a_block_with_a_wrong_scales_length_is_a_counted_miss(model):
    """The header's scales length must be the dtype's: a block that says otherwise (here 4 bytes short, so the
    payload starts 4 bytes early) is a `CorruptBlock("length")`, counted and deleted by the store, never used."""
    exported = Exported(make_bundle(model))
    bad = bytearray(exported.encoded[0])
    scales_len_at = 80                     # header field offset (kvstore/codec.py _BODY)
    struct.pack_into("<I", bad, scales_len_at, exported.bundle.layout.scale_bytes("float8_e4m3fn") - 4)
    bad = reseal(bad)
    with pytest.raises(codec.CorruptBlock) as info:
        verified_payload(exported.bundle, memoryview(bad), exported.fp, exported.hashes[0])
    assert info.value.reason == "length"
    decode = make_bundle(model)
    with TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=64 << 10, slot_bytes=4 << 10))) as store:
        store.put([(exported.hashes[0], bytes(bad))] + exported.items()[1:])
        loaded = load_from_store(decode, store, exported.hashes, exported.fp)
        assert list(loaded.payloads) == [] and store.stats()["host"].checksum_failures == 1
        assert store.tier("host").contains(exported.hashes[:1]) == [False], "the bad copy was deleted"
    assert decode.engine.block_manager.pool.lookup(exported.hashes[0]) is None
