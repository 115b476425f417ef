"""Encryption at rest (kvstore/sealing.py): seal/open, the key file, and `SealedTier` over a real disk tier and
inside a `TieredStore` (a copy that does not open is a counted, deleted miss; evicted bytes are demoted in clear)."""
from __future__ import annotations

import os

import pytest

from kvstore import sealing
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.sealing import OVERHEAD, SealedTier, Sealer, SealError, fingerprint_of, load_key
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from tests.integration.store_factories import FP, HASHES, SIZE, SLOT, items, make_block

KEY = bytes(range(32))


def make_sealed_disk(tmp_path, blocks: int = 16) -> SealedTier:
    return SealedTier(DiskTier(str(tmp_path / "disk"), capacity_bytes=blocks * (SIZE + OVERHEAD)), Sealer(KEY))


def disk_file(tier: SealedTier, i: int) -> str:
    return tier.inner._file(bytes(HASHES[i]))


# ------------------------------------------------------------------------------------------------ seal / open

def test_seal_then_open_round_trips_and_keeps_the_fingerprint_at_offset_12():
    sealed = Sealer(KEY).seal(HASHES[0], make_block(0))
    assert len(sealed) == SIZE + OVERHEAD and sealing.is_sealed(sealed)
    assert fingerprint_of(sealed) == fingerprint_of(make_block(0)) == FP
    assert Sealer(KEY).open(HASHES[0], sealed) == make_block(0)


def test_two_seals_of_one_block_use_different_nonces():
    a, b = Sealer(KEY).seal(HASHES[0], make_block(0)), Sealer(KEY).seal(HASHES[0], make_block(0))
    assert bytes(a) != bytes(b)


@pytest.mark.parametrize("case", ["other_hash", "other_key", "relabelled_namespace", "truncated", "plain_block"])
def test_open_refuses_what_does_not_authenticate(case):
    sealed = bytearray(Sealer(KEY).seal(HASHES[0], make_block(0)))
    key, block_hash = KEY, HASHES[0]
    if case == "other_hash":
        block_hash = HASHES[1]
    elif case == "other_key":
        key = bytes(32)
    elif case == "relabelled_namespace":
        sealed[12] ^= 1
    elif case == "truncated":
        sealed = sealed[:OVERHEAD - 1]
    else:
        sealed = bytearray(make_block(0))
    with pytest.raises(SealError):
        Sealer(key).open(block_hash, sealed)


def test_every_single_bit_flip_is_refused():
    sealed = bytes(Sealer(KEY).seal(HASHES[0], make_block(0)))
    for offset in range(0, len(sealed), 7):
        flipped = bytearray(sealed)
        flipped[offset] ^= 1 << (offset % 8)
        with pytest.raises(SealError):
            Sealer(KEY).open(HASHES[0], flipped)


def test_open_into_a_too_small_buffer_is_a_caller_error():
    sealed = Sealer(KEY).seal(HASHES[0], make_block(0))
    with pytest.raises(ValueError, match="too small"):
        Sealer(KEY).open_into(HASHES[0], sealed, memoryview(bytearray(SIZE - 1)))


@pytest.mark.parametrize("content", [KEY, KEY.hex().encode(), (KEY.hex() + "\n").encode()])
def test_load_key_reads_raw_or_hex(tmp_path, content):
    path = tmp_path / "kv.key"
    path.write_bytes(content)
    assert load_key(str(path)) == KEY


@pytest.mark.parametrize("content", [b"short", b"z" * 64, bytes(33)])
def test_load_key_refuses_anything_else_naming_the_file(tmp_path, content):
    path = tmp_path / "kv.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="32 raw bytes or 64 hex"):
        load_key(str(path))


def test_store_config_refuses_a_missing_key_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        StoreConfig(encryption_key_file=str(tmp_path / "missing.key"))


# ------------------------------------------------------------------------------------------------ SealedTier

def test_sealed_tier_writes_ciphertext_and_reads_plaintext(tmp_path):
    tier = make_sealed_disk(tmp_path)
    assert tier.put(items(0, 1)) == [True, True]
    on_disk = open(disk_file(tier, 0), "rb").read()
    assert sealing.is_sealed(on_disk) and make_block(0)[200:400] not in on_disk
    bufs = [bytearray(SIZE) for _ in range(3)]
    assert tier.get(HASHES[:3], [memoryview(b) for b in bufs]) == [SIZE, SIZE, None]
    assert bytes(bufs[0]) == make_block(0) and bytes(bufs[1]) == make_block(1)
    assert tier.keys_lru_order() == HASHES[:2]  # the inner tier's extras pass through


def test_sealed_tier_copy_that_does_not_open_is_a_counted_deleted_miss(tmp_path):
    tier, reported = make_sealed_disk(tmp_path), []
    tier.bad_copy_listener = reported.append
    tier.put(items(0, 1))
    raw = bytearray(open(disk_file(tier, 1), "rb").read())
    raw[len(raw) // 2] ^= 0x04
    open(disk_file(tier, 1), "wb").write(raw)
    bufs = [memoryview(bytearray(SIZE)) for _ in range(2)]
    assert tier.get(HASHES[:2], bufs) == [SIZE, None]
    assert tier.stats().checksum_failures == 1 and reported == [HASHES[1]]
    assert tier.contains(HASHES[:2]) == [True, False] and not os.path.exists(disk_file(tier, 1))


def test_sealed_tier_hands_evicted_blocks_to_the_listener_in_clear(tmp_path):
    tier, evicted = make_sealed_disk(tmp_path, blocks=2), []
    tier.eviction_wants_data = True
    tier.eviction_listener = lambda key, data: evicted.append((key, data))
    tier.put(items(0, 1, 2))
    assert evicted == [(HASHES[0], make_block(0))]


# ----------------------------------------------------------------------------------------------- in the store

def make_encrypted_store(tmp_path) -> TieredStore:
    key_file = tmp_path / "kv.key"
    key_file.write_bytes(KEY)
    config = StoreConfig(host=HostTierConfig(capacity_bytes=8 * SLOT, slot_bytes=SLOT),
                         disk=DiskTierConfig(str(tmp_path / "disk"), capacity_bytes=1 << 20),
                         write_through=("disk",), encryption_key_file=str(key_file))
    return TieredStore(config)


def test_store_seals_lower_tiers_only_and_serves_verified_plaintext(tmp_path):
    with make_encrypted_store(tmp_path) as store:
        assert isinstance(store.tier("disk"), SealedTier) and not isinstance(store.host, SealedTier)
        store.put(items(0, 1, 2))
        assert store.flush(10)
        store.host.clear()
        got = store.get(HASHES[:3], [bytearray(SIZE) for _ in range(3)], FP, hint=["disk"] * 3)
        assert got.tiers == ["disk"] * 3 and all(bytes(b.payload) == bytes([i + 1]) * len(b.payload)
                                                 for i, b in enumerate(got.blocks))
        assert sealing.is_sealed(open(store.tier("disk").inner._file(bytes(HASHES[0])), "rb").read())


def test_store_counts_a_copy_that_does_not_open_as_a_checksum_failure(tmp_path):
    with make_encrypted_store(tmp_path) as store:
        store.put(items(0, 1))
        assert store.flush(10)
        store.host.clear()
        path = store.tier("disk").inner._file(bytes(HASHES[0]))
        raw = bytearray(open(path, "rb").read())
        raw[-1] ^= 0x80
        open(path, "wb").write(raw)
        got = store.get(HASHES[:2], [bytearray(SIZE) for _ in range(2)], FP)
        assert got.tiers == [None, "disk"] and got.num_hit_blocks == 0
        assert store.stats()["disk"].checksum_failures == 1 and store.tier("disk").contains(HASHES[:1]) == [False]
