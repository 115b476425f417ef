"""One bit flipped in every stored object, behind the store's back, in each backing store (disk files, a real
redis-server, moto's S3 packs), in clear and sealed: every read is a miss, each tier's corruption counter rises by
exactly the number of flipped blocks it held, the bad copies are deleted, and nothing wrong is ever returned.
Then through the engine: a prefix whose middle block was flipped on disk is loaded up to the bad block, the rest
is recomputed, and the tokens are the reference tokens."""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine.sampling_params import SamplingParams
from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, S3TierConfig, StoreConfig
from kvstore.hashing import hash_blocks
from kvstore.store import TieredStore
from tests.integration.conftest import s3_client
from tests.integration.store_factories import FP, LAYOUT, NS

TIERS = ("disk", "redis", "s3")
NUM_BLOCKS = 1000
HASHES = hash_blocks(NS, [random.Random(7).randrange(1 << 20) for _ in range(4 * NUM_BLOCKS)], 4)
SIZE = codec.encoded_size(LAYOUT.payload_bytes("float16"))
KEY = bytes(range(32))


def make_block(i: int) -> bytes:
    payload = random.Random(i).randbytes(LAYOUT.payload_bytes("float16"))
    return codec.encode(FP, HASHES[i], LAYOUT, "float16", payload, parent_hash=HASHES[i - 1] if i else None)


def flip(data: bytes | bytearray, rng: random.Random, start: int = 0, length: int | None = None) -> bytearray:
    """`data` with one random bit of [start, start + length) flipped."""
    out = bytearray(data)
    at = start + rng.randrange(len(out) - start if length is None else length)
    out[at] ^= 1 << rng.randrange(8)
    return out


def make_store(tmp_path, request, monkeypatch, encrypted: bool) -> TieredStore:
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    key_file = tmp_path / "kv.key"
    key_file.write_text(KEY.hex())
    return TieredStore(StoreConfig(
        host=HostTierConfig(capacity_bytes=1 << 20, slot_bytes=1024),
        disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=64 << 20),
        redis=RedisTierConfig(url=request.getfixturevalue("redis_server").url,
                              key_prefix=request.getfixturevalue("redis_key_prefix")),
        s3=S3TierConfig(bucket=bucket, endpoint_url=server.url, region=server.region),
        encryption_key_file=str(key_file) if encrypted else ""))


# ------------------------------------------------------------------------------------------- flips per backend

def flip_disk(store: TieredStore, hashes: list[bytes], rng: random.Random) -> None:
    tier = store.tier("disk")
    for h in hashes:
        path = tier._file(bytes(h))  # NOTE: through a SealedTier this is the inner disk tier's
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(flip(data, rng))


def flip_redis(store: TieredStore, hashes: list[bytes], rng: random.Random, server) -> None:
    import redis
    tier, raw = store.tier("redis"), redis.Redis.from_url(server.url)
    try:
        for h in hashes:
            raw.set(tier.key(h), bytes(flip(raw.get(tier.key(h)), rng)))
    finally:
        raw.close()


def flip_s3(store: TieredStore, hashes: list[bytes], rng: random.Random, server, bucket: str) -> None:
    """One bit in each block's span of its pack (the pack's own index and footer stay intact)."""
    tier, client = store.tier("s3"), s3_client(server)
    entries = [tier._packs.find(bytes(h)) for h in hashes]
    for pack in {e.pack for e in entries}:
        body = bytearray(client.get_object(Bucket=bucket, Key=pack)["Body"].read())
        for e in (e for e in entries if e.pack == pack):
            body = flip(body, rng, e.offset, e.length)
        client.put_object(Bucket=bucket, Key=pack, Body=bytes(body))


# ------------------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "sealed"])
def test_a_flipped_bit_in_every_stored_object_is_a_counted_deleted_miss(tmp_path, request, monkeypatch, encrypted):
    rng = random.Random(1 if encrypted else 0)
    share = {name: list(range(i, NUM_BLOCKS, len(TIERS))) for i, name in enumerate(TIERS)}  # 334 / 333 / 333
    with make_store(tmp_path, request, monkeypatch, encrypted) as store:
        for name, indices in share.items():
            assert store.tier(name).put([(HASHES[i], make_block(i)) for i in indices]) == [True] * len(indices)
        flip_disk(store, [HASHES[i] for i in share["disk"]], rng)
        flip_redis(store, [HASHES[i] for i in share["redis"]], rng, request.getfixturevalue("redis_server"))
        flip_s3(store, [HASHES[i] for i in share["s3"]], rng, request.getfixturevalue("s3_server"),
                request.getfixturevalue("s3_bucket"))
        before = {n: s.checksum_failures for n, s in store.stats().items()}
        for _ in range(2):  # the second read finds nothing left to reject
            bufs = [bytearray(SIZE + 64) for _ in range(NUM_BLOCKS)]
            got = store.get(HASHES[:NUM_BLOCKS], bufs, FP)
            assert got.tiers == [None] * NUM_BLOCKS and got.blocks == [None] * NUM_BLOCKS
            assert got.num_hit_blocks == 0
        stats = store.stats()
        for name, indices in share.items():
            assert stats[name].checksum_failures - before[name] == len(indices), name
            assert not any(store.tier(name).contains([HASHES[i] for i in indices])), name
        assert stats["host"].blocks == 0  # nothing was promoted
        assert store.lookup(HASHES[:NUM_BLOCKS]).num_hit_blocks == 0


# ------------------------------------------------------------------------------------------- through the engine

BS = 16
PROMPT = [random.Random(12).randrange(3, 200) for _ in range(4 * BS + 5)]   # 4 full blocks + a 5-token tail
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "sealed"])
def test_a_corrupted_prefix_block_is_recomputed_and_the_tokens_are_exact(tiny_checkpoint, tmp_path, encrypted):
    from worker_common.admission import admit
    from worker_common.engine_loop import EngineLoop, Tracked
    from worker_common.engine_setup import build_engine_from
    from worker_common.kv_blocks import encode_block, read_device_payloads, slot_bytes
    from worker_common.prefix_load import load_from_store

    model = str(tiny_checkpoint("llama").path)
    make_bundle = lambda: build_engine_from(model, block_size=BS, num_blocks=64)  # noqa: E731
    reference = make_bundle().engine.generate([PROMPT], PARAMS)[0].token_ids

    prefill = make_bundle()
    fp = prefill.fingerprint_for("")
    request = prefill.engine.add_request("prefill", PROMPT, dataclasses.replace(PARAMS, max_tokens=1))
    while not request.is_finished:
        prefill.engine.step()
    hashes = hash_blocks(fp, PROMPT, BS)
    spans = read_device_payloads(prefill, [prefill.engine.block_manager.pool.lookup(h) for h in hashes])
    items = []
    for i, span in enumerate(spans):
        out = bytearray(slot_bytes(prefill))
        n = encode_block(memoryview(out), prefill, fp, hashes[i], hashes[i - 1] if i else None,
                         PROMPT[i * BS:(i + 1) * BS], span)
        items.append((hashes[i], bytes(out[:n])))

    key_file = tmp_path / "kv.key"
    key_file.write_bytes(KEY)
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, slot_bytes=slot_bytes(prefill)),
                         disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=16 << 20), write_through=("disk",),
                         encryption_key_file=str(key_file) if encrypted else "")
    with TieredStore(config) as store:
        store.put(items)
        assert store.flush(30)
        store.host.clear()  # the blocks can only come from disk
        flip_disk(store, [hashes[2]], random.Random(3))

        decode = make_bundle()
        loaded = load_from_store(decode, store, hashes, fp)
        assert loaded.by_tier == {"disk": 2}  # the leading run up to the bad block
        assert store.stats()["disk"].checksum_failures == 1
        loop, tracked = EngineLoop(decode), Tracked(None)
        admit(loop, tracked, "decode", PROMPT, PARAMS, fp, hashes[:2], list(loaded.payloads)[:2], [request.
              output_token_ids[0]])
        outputs = []
        while decode.engine.has_unfinished():
            outputs += decode.engine.step()
        decode.engine.block_manager.pool.release(tracked.pinned)
        decode.engine.block_manager.check_integrity()
    assert outputs[-1].token_ids == reference
