"""The KV bridge in one process: blocks copied out of one engine's paged cache, encoded, verified and installed
into another engine's cache make that engine resume exactly where the first stopped (no sockets here; the
integration tests do the same across processes)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.sampling_params import SamplingParams
from kvstore import codec
from kvstore.hashing import hash_blocks
from worker_common.admission import admit
from worker_common.engine_loop import EngineLoop, Tracked
from worker_common.engine_setup import build_engine_from
from worker_common.kv_blocks import (encode_block, install_blocks, read_device_payloads, slot_bytes,
                                     verified_payload)
from worker_common.text_stream import TextStream

PROMPT = [5 + (i * 7) % 190 for i in range(41)]       # 2 full blocks of 16 + a 9-token tail
PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


def engine_of(model: str, text: bool = False):
    return build_engine_from(model, num_blocks=64, engine_text=text)


def prefill_and_export(bundle, prompt, params):
    """First token with max_tokens=1, then the encoded full blocks (what a prefill worker hands over)."""
    fp = bundle.fingerprint_for("")
    first = bundle.engine.generate([prompt], dataclasses.replace(params, max_tokens=1))[0].token_ids[0]
    hashes = hash_blocks(fp, prompt, bundle.block_size)
    pool = bundle.engine.block_manager.pool
    payloads = read_device_payloads(bundle, [pool.lookup(h) for h in hashes])
    encoded = []
    for i, (block_hash, payload) in enumerate(zip(hashes, payloads)):
        out = bytearray(slot_bytes(bundle))
        n = encode_block(memoryview(out), bundle, fp, block_hash, hashes[i - 1] if i else None,
                         prompt[i * 16:(i + 1) * 16], payload)
        encoded.append(memoryview(out)[:n])
    return first, hashes, encoded


def run_admitted(bundle, prompt, params, hashes, payloads, first_token):
    loop = EngineLoop(bundle)
    tracked = Tracked(None)
    installed = admit(loop, tracked, "r", prompt, params, bundle.fingerprint_for(""), hashes, payloads,
                      [first_token])
    outputs = []
    while bundle.engine.has_unfinished():
        outputs += bundle.engine.step()
    bundle.engine.block_manager.pool.release(tracked.pinned)
    return installed, outputs[-1]


def test_installed_blocks_resume_the_request_token_exactly(model):
    want = engine_of(model, text=True).engine.generate([PROMPT], PARAMS)[0]
    first, hashes, encoded = prefill_and_export(engine_of(model), PROMPT, PARAMS)
    decode = engine_of(model)
    payloads = [verified_payload(decode, view, decode.fingerprint_for(""), h) for h, view in zip(hashes, encoded)]
    installed, last = run_admitted(decode, PROMPT, PARAMS, hashes, payloads, first)
    assert installed.num_blocks == 2 and installed.num_written == 2
    assert last.num_cached_tokens == 32, "the request took both installed blocks as its prefix"
    assert last.token_ids == want.token_ids
    decode.engine.block_manager.check_integrity()


def test_install_stops_at_the_first_block_it_cannot_provide(model):
    bundle = engine_of(model)
    _, hashes, encoded = prefill_and_export(engine_of(model), PROMPT, PARAMS)
    payloads = [verified_payload(bundle, encoded[0], bundle.fingerprint_for(""), hashes[0]), None]
    result = install_blocks(bundle, hashes, payloads)
    assert (result.num_blocks, result.num_written) == (1, 1)
    pool = bundle.engine.block_manager.pool
    assert pool.lookup(hashes[0]) == result.pinned[0] and pool.lookup(hashes[1]) is None
    pool.release(result.pinned)
    bundle.engine.block_manager.check_integrity()


def test_a_block_of_another_namespace_fails_verification(model):
    bundle = engine_of(model)
    _, hashes, encoded = prefill_and_export(engine_of(model), PROMPT, PARAMS)
    with pytest.raises(codec.CorruptBlock, match="fingerprint"):
        verified_payload(bundle, encoded[0], bundle.fingerprint_for("tenant-2"), hashes[0])
    corrupt = bytearray(encoded[1])
    corrupt[-1] ^= 0xFF
    with pytest.raises(codec.CorruptBlock, match="payload_checksum"):
        verified_payload(bundle, memoryview(corrupt), bundle.fingerprint_for(""), hashes[1])


def test_text_split_at_the_first_token_equals_the_single_engine_text(model):
    reference = engine_of(model, text=True)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = reference.engine.generate([PROMPT], params)[0]
    tokenizer = reference.tokenizer
    prefill_side, decode_side = TextStream(tokenizer, PROMPT, params), TextStream(tokenizer, PROMPT, params)
    text = prefill_side.push(want.token_ids[:1], False).text
    decode_side.push(want.token_ids[:1], False)
    for i, token in enumerate(want.token_ids[1:], start=2):
        text += decode_side.push([token], i == len(want.token_ids)).text
    assert text == want.text


def test_finished_blocks_written_to_the_store_load_into_another_engine(model):
    from kvstore.config import HostTierConfig, StoreConfig
    from kvstore.store import TieredStore
    from worker_common.kv_blocks import store_computed_blocks
    from worker_common.prefix_load import load_prefix

    first = engine_of(model)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    out = first.engine.generate([PROMPT], params)[0]
    tokens = PROMPT + out.token_ids                      # 51 tokens: 50 computed, 3 full blocks
    fp = first.fingerprint_for("")
    with TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20))) as store:
        assert store_computed_blocks(first, store, tokens, fp) == 3
        assert store_computed_blocks(first, store, tokens, fp) == 0, "blocks the host tier holds are skipped"
        second = engine_of(model)
        hashes = hash_blocks(fp, tokens, 16)[:3]
        loaded = load_prefix(second, store, hashes, fp)
    payloads = loaded.payloads
    assert len(payloads) == 3 and all(p is not None for p in payloads) and loaded.by_tier == {"host": 3}
    installed = install_blocks(second, hashes, payloads)
    assert installed.num_written == 3
    first_ids = [first.engine.block_manager.pool.lookup(h) for h in hashes]
    assert torch.equal(second.runner.read_blocks(installed.pinned), first.runner.read_blocks(first_ids))


@pytest.mark.parametrize("order", ["stored in order", "stored in reverse"])
def test_a_host_hit_installs_from_the_host_tiers_own_slots(model, order):
    """Host holds every block: the payloads are its slots, lent (no staging copy) until `release`; blocks stored in
    order lie in consecutive slots (one strided view), in reverse they do not (one gather). Either way the installed
    KV equals the engine that computed it."""
    from kvstore.config import HostTierConfig, StoreConfig
    from kvstore.store import TieredStore
    from worker_common.prefix_load import LentPayloads, load_prefix

    first = engine_of(model)
    prompt = [5 + (i * 13) % 190 for i in range(16 * 6 + 3)]
    first.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    fp = first.fingerprint_for("")
    hashes = hash_blocks(fp, prompt, 16)
    _, _, encoded = prefill_and_export(first, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    items = list(zip(hashes, encoded))
    with TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20))) as store:
        store.put(items if order == "stored in order" else items[::-1])
        second = engine_of(model)
        loaded = load_prefix(second, store, hashes, fp)
        assert isinstance(loaded.payloads, LentPayloads) and loaded.by_tier == {"host": 6}
        probe = store.host.borrow(hashes)
        slots = probe.slots
        probe.release()
        consecutive = slots == list(range(slots[0], slots[0] + 6))
        assert consecutive == (order == "stored in order")
        installed = install_blocks(second, hashes, loaded.payloads)
        assert installed.num_written == 6
        first_ids = [first.engine.block_manager.pool.lookup(h) for h in hashes]
        assert torch.equal(second.runner.read_blocks(installed.pinned), first.runner.read_blocks(first_ids))
        assert bytes(loaded.payloads[1]) == bytes(codec.decode(encoded[1], fp, hashes[1]).span)
        loaded.release()


def test_the_routers_expected_blocks_bound_what_the_shared_tiers_are_asked(model, monkeypatch):
    """A request the router planned (`expected_cached_blocks` set, even to 0) asks the shared tiers about that many
    blocks after those on the device; one without a plan (no router) asks about every block."""
    from kvstore.config import HostTierConfig, StoreConfig
    from kvstore.store import TieredStore
    from strata.v1 import worker_pb2
    from worker_common.prefix_load import load_prefix

    bundle = engine_of(model)
    _, hashes, _ = prefill_and_export(bundle, PROMPT, PARAMS)   # both blocks on the device
    fp = bundle.fingerprint_for("")
    more = hash_blocks(fp, PROMPT + list(range(7, 7 + 48)), 16)  # 5 full blocks: 2 on the device, 3 nowhere
    calls = []
    with TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20))) as store:
        lookup = store.lookup
        monkeypatch.setattr(store, "lookup", lambda keys, **kw: calls.append((len(keys), kw)) or lookup(keys, **kw))
        for plan in (worker_pb2.PrefillRequest(expected_cached_blocks=4), worker_pb2.PrefillRequest(
                expected_cached_blocks=0), worker_pb2.PrefillRequest(), None):
            load_prefix(bundle, store, more, fp, plan).release()
    assert calls == [(3, {"expect": 2, "shared_upto": 2}), (3, {"expect": 0, "shared_upto": 0}),
                     (3, {"expect": 0, "shared_upto": None}), (3, {"expect": 0, "shared_upto": None})]


def test_a_corrupted_host_block_ends_the_lent_run_and_is_dropped(model):
    from kvstore.config import HostTierConfig, StoreConfig
    from kvstore.store import TieredStore
    from worker_common.prefix_load import load_prefix

    bundle = engine_of(model)
    _, hashes, encoded = prefill_and_export(bundle, PROMPT, PARAMS)
    with TieredStore(StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20))) as store:
        store.put(list(zip(hashes, encoded)))
        loan = store.host.borrow([hashes[1]])
        loan.views[0][-1] ^= 0xFF                      # a bit flip in the second block's payload, in place
        loan.release()
        loaded = load_prefix(engine_of(model), store, hashes, bundle.fingerprint_for(""))
        assert loaded.by_tier == {"host": 1} and len(loaded.payloads) == 1
        assert store.stats()["host"].checksum_failures == 1 and store.host.contains(hashes) == [True, False]
        loaded.release()
        store.host.check_integrity()


def test_staging_buffers_are_reused_only_after_release():
    from worker_common.staging import StagingPool

    pool = StagingPool(max_free=2)
    first = pool.acquire(4, 1000)
    second = pool.acquire(4, 1000)
    assert first.tensor.data_ptr() != second.tensor.data_ptr()  # both in use: never the same memory
    first.release()
    first.release()  # idempotent: the buffer is not handed out twice
    again = pool.acquire(2, 1000)
    assert again.tensor.data_ptr() == first.tensor.data_ptr() and tuple(again.tensor.shape) == (2, 1000)
    other = pool.acquire(2, 1000)
    assert other.tensor.data_ptr() not in (again.tensor.data_ptr(), second.tensor.data_ptr())
    for staging in (second, again, other):
        staging.release()
    assert pool.idle_bytes() <= 2 * (1 << 20)  # at most max_free buffers kept


def test_a_long_prefix_loads_in_chunks_installed_while_the_next_are_read(model, tmp_path):
    """Past CHUNK_BLOCKS blocks, every chunk is read at once and each verified chunk is installed on the engine
    thread, in order, as soon as it is read; the
    installed KV equals the engine that computed it, the admission finds every block on the device, and the chunks'
    own pins are dropped afterwards."""
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
    from kvstore.store import TieredStore
    from worker_common.kv_blocks import store_computed_blocks
    from worker_common.prefix_load import CHUNK_BLOCKS, ChunkInstaller, load_prefix

    prompt = [5 + (i * 11) % 190 for i in range(16 * (CHUNK_BLOCKS + 8) + 3)]  # 40 full blocks and a tail
    first = engine_of(model)
    first.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    fp = first.fingerprint_for("")
    hashes = hash_blocks(fp, prompt, 16)
    second = build_engine_from(model, num_blocks=96)
    loop = EngineLoop(second)
    loop.start()
    try:
        config = StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20),
                             disk=DiskTierConfig(str(tmp_path), capacity_bytes=64 << 20), write_through=("disk",))
        with TieredStore(config) as store:
            assert store_computed_blocks(first, store, prompt + [7], fp) == len(hashes)
            assert store.flush(30)
            from_host = ChunkInstaller(loop, hashes, prompt)
            loaded = load_prefix(second, store, hashes, fp, on_chunk=from_host)
            assert loaded.by_tier == {"host": len(hashes)} and from_host.handed == 0  # one install, by admission
            loaded.release()
            store.host.clear()  # the prefix is on disk only: worth pipelining (a host read is not)
            chunks = ChunkInstaller(loop, hashes, prompt)
            second_chunk_read, overlapped, real_get = threading.Event(), [], store.get

            def get(keys, *args, **kwargs):  # NOTE: the first chunk's read waits to see the second one start
                if keys[0] == hashes[CHUNK_BLOCKS]:
                    second_chunk_read.set()
                elif keys[0] == hashes[0]:
                    overlapped.append(second_chunk_read.wait(30))
                return real_get(keys, *args, **kwargs)

            store.get = get
            loaded = load_prefix(second, store, hashes, fp, on_chunk=chunks)
            assert overlapped == [True]  # both chunks were in flight at once
        installed = loop.post(lambda: install_blocks(second, hashes, loaded.payloads, prompt)).result()
        assert chunks.handed == 2
        assert [r.num_written for r in chunks.done()] == [CHUNK_BLOCKS, len(hashes) - CHUNK_BLOCKS]
        assert installed.num_blocks == len(hashes) and installed.num_written == 0  # all there already
        assert loaded.by_tier == {"disk": len(hashes)}
        first_ids = [first.engine.block_manager.pool.lookup(h) for h in hashes]
        device = loop.post(lambda: second.runner.read_blocks(installed.pinned)).result()
        assert torch.equal(device, first.runner.read_blocks(first_ids))
        chunks.finish()
        loaded.release()
        pool = second.engine.block_manager.pool
        loop.post(lambda: pool.release(installed.pinned)).result()
        assert loop.post(lambda: sum(pool.ref_counts)).result() == 0  # no pin left behind
    finally:
        loop.stop()
