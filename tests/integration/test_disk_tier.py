"""Disk tier: atomic files, LRU by bytes, restart, corruption and a really full disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvstore import codec
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.hashing import Namespace, hash_blocks
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier

NS = Namespace("tiny@disk-test", "bs4-l1-h2-d8", "float16")
FP = NS.fingerprint()
LAYOUT = codec.BlockLayout(num_layers=1, block_size=4, kv_heads=2, head_dim=8)


def make_blocks(n: int, layout: codec.BlockLayout = LAYOUT) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(7, 7 + 4 * n))
    hashes = hash_blocks(NS, tokens, 4)
    blocks = [codec.encode(FP, h, layout, "float16", bytes([i % 250 + 1]) * layout.payload_bytes("float16"),
                           tokens=tokens[4 * i:4 * i + 4]) for i, h in enumerate(hashes)]
    return hashes, blocks


SIZE = len(make_blocks(1)[1][0])


def read(tier, keys) -> list[bytes | None]:
    bufs = [bytearray(SIZE) for _ in keys]
    sizes = tier.get(keys, [memoryview(b) for b in bufs])
    return [None if n is None else bytes(b[:n]) for b, n in zip(bufs, sizes)]


def block_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


def test_round_trip_single_and_batched(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=100 * SIZE)
    hashes, blocks = make_blocks(6)
    assert tier.put(list(zip(hashes, blocks))) == [True] * 6
    assert read(tier, hashes[:1]) == blocks[:1]
    assert read(tier, hashes + [b"\x00" * 16]) == blocks + [None]
    files = block_files(tmp_path)
    assert len(files) == 6 and all(f.endswith(".kvb") for f in files)
    assert os.path.basename(os.path.dirname(files[0])) == os.path.basename(files[0])[:2]  # sharded by hash
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.blocks, stats.used_bytes) == (7, 1, 6, 6 * SIZE)
    tier.check_integrity()
    tier.close()


def test_lru_eviction_by_bytes(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=3 * SIZE)
    evicted = []
    tier.eviction_listener = lambda key, data: evicted.append(key)
    hashes, blocks = make_blocks(5)
    tier.put(list(zip(hashes[:3], blocks[:3])))
    read(tier, [hashes[0]])  # refresh 0: 1 is the oldest
    tier.put([(hashes[3], blocks[3])])
    tier.put([(hashes[4], blocks[4])])
    assert evicted == [hashes[1], hashes[2]]
    assert tier.keys_lru_order() == [hashes[0], hashes[3], hashes[4]]
    assert len(block_files(tmp_path)) == 3 and tier.stats().evictions == 2
    tier.check_integrity()
    tier.close()


def test_eviction_hands_over_the_bytes_when_asked(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=2 * SIZE)
    tier.eviction_wants_data = True
    seen = {}
    tier.eviction_listener = lambda key, data: seen.setdefault(key, data)
    hashes, blocks = make_blocks(3)
    tier.put(list(zip(hashes, blocks)))
    assert seen == {hashes[0]: blocks[0]}
    tier.close()


def test_restart_rebuilds_the_index_and_drops_temp_files(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=10 * SIZE, touch_interval_s=0)  # every read refreshes the mtime
    hashes, blocks = make_blocks(3)
    for item in zip(hashes, blocks):
        tier.put([item])
        time.sleep(0.01)  # distinct mtimes: the restart orders the LRU by them
    read(tier, [hashes[0]])
    tier.close()
    stale = os.path.join(tmp_path, hashes[0].hex()[:2], f".{hashes[0].hex()}.dead.tmp")
    with open(stale, "wb") as f:
        f.write(b"half a block")  # a writer crashed mid-write
    again = DiskTier(str(tmp_path), capacity_bytes=10 * SIZE)
    assert again.contains(hashes) == [True, True, True]
    assert again.keys_lru_order() == [hashes[1], hashes[2], hashes[0]]
    assert read(again, hashes) == blocks
    assert not os.path.exists(stale)
    again.check_integrity()
    again.close()


def test_restart_with_a_smaller_capacity_evicts_the_oldest(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=10 * SIZE)
    hashes, blocks = make_blocks(4)
    for item in zip(hashes, blocks):
        tier.put([item])
        time.sleep(0.01)
    tier.close()
    smaller = DiskTier(str(tmp_path), capacity_bytes=2 * SIZE)
    assert smaller.contains(hashes) == [False, False, True, True]
    smaller.close()


def test_fsync_mode_round_trips(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=10 * SIZE, fsync=True)
    hashes, blocks = make_blocks(2)
    tier.put(list(zip(hashes, blocks)))
    assert read(tier, hashes) == blocks
    tier.close()


def test_flipped_bit_on_disk_is_a_counted_miss_and_the_file_is_deleted(tmp_path):
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20), disk=DiskTierConfig(str(tmp_path), 1 << 20))
    with TieredStore(config) as store:
        hashes, blocks = make_blocks(2)
        store.tier("disk").put(list(zip(hashes, blocks)))  # on disk only
        path = os.path.join(tmp_path, hashes[0].hex()[:2], hashes[0].hex() + ".kvb")
        with open(path, "r+b") as f:
            f.seek(SIZE - 5)
            byte = f.read(1)
            f.seek(SIZE - 5)
            f.write(bytes([byte[0] ^ 0x04]))
        bufs = [bytearray(SIZE), bytearray(SIZE)]
        result = store.get(hashes, bufs, FP)
        assert result.tiers == [None, "disk"] and result.blocks[0] is None  # never the wrong block
        assert bytes(result.blocks[1].payload) == codec.decode(blocks[1], FP, hashes[1]).payload.tobytes()
        assert not os.path.exists(path)
        assert store.stats()["disk"].checksum_failures == 1
        assert store.lookup(hashes).per_tier["disk"] == 0


_FULL_DISK_CHILD = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, {repo!r})
    from tests.integration.test_disk_tier import make_blocks, FP, LAYOUT, SIZE
    from kvstore import codec
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
    from kvstore.store import TieredStore
    from kvstore.tiers.base import TierUnavailable
    from kvstore.tiers.disk import DiskTier

    # The host tier's shared memory is a file too: create it (and the tiers) before the limit applies.
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, slot_bytes=8192),
                         disk=DiskTierConfig({path!r} + "/store", 1 << 20), write_through=("disk",))
    store = TieredStore(config)
    tier = DiskTier({path!r} + "/tier", capacity_bytes=1 << 20)
    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG like a full filesystem would.
    resource.setrlimit(resource.RLIMIT_FSIZE, (SIZE * 2, SIZE * 2))
    big_layout = codec.BlockLayout(num_layers=4, block_size=4, kv_heads=2, head_dim=8)
    small_h, small_b = make_blocks(1)
    big_h, big_b = make_blocks(2, big_layout)
    out = {{}}
    tier.put([(small_h[0], small_b[0])])
    try:
        tier.put([(big_h[1], big_b[1])])
        out["raised"] = False
    except TierUnavailable as exc:
        out["raised"], out["message"] = True, str(exc)
    stats = tier.stats()
    out.update(errors=stats.errors, healthy=stats.healthy, blocks=stats.blocks)
    buf = bytearray(SIZE)
    out["small_still_served"] = tier.get(small_h, [memoryview(buf)]) == [SIZE] and bytes(buf) == small_b[0]
    tier.close()

    with store:
        store.put([(big_h[1], big_b[1]), (small_h[0], small_b[0])])
        store.flush()
        disk = store.stats()["disk"]
        out.update(store_errors=disk.errors, store_healthy=disk.healthy,
                   disk_has=store.tier("disk").contains([big_h[1], small_h[0]]))
        bufs = [bytearray(len(big_b[1]))]
        out["served_from"] = store.get([big_h[1]], bufs, FP).tiers
    print(json.dumps(out))
""")


def test_full_disk_is_counted_marks_the_tier_unhealthy_and_serving_continues(tmp_path):
    """A real EFBIG: the child runs under RLIMIT_FSIZE, so the kernel refuses writes past two small blocks."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = _FULL_DISK_CHILD.format(repo=repo, path=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] and "File too large" in out["message"]
    assert (out["errors"], out["healthy"], out["blocks"]) == (1, False, 1)
    assert out["small_still_served"]
    assert out["store_errors"] == 1 and out["store_healthy"] is False
    assert out["disk_has"] == [False, True]  # only the big block failed; host holds both
    assert out["served_from"] == ["host"]
    assert not [f for f in block_files(tmp_path) if f.endswith(".tmp")]  # no torn block left behind


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield str(mount)
    subprocess.run(["umount", str(mount)], check=False)


def test_full_tmpfs_gives_enospc_counted_and_reads_continue(tiny_tmpfs):
    big_layout = codec.BlockLayout(num_layers=16, block_size=4, kv_heads=2, head_dim=8)
    hashes, blocks = make_blocks(40, big_layout)  # about 8 KiB each: 320 KiB does not fit in 256 KiB
    tier = DiskTier(tiny_tmpfs, capacity_bytes=1 << 30)  # the tier believes it has room: the filesystem does not
    stored, failures = [], 0
    for item in zip(hashes, blocks):
        try:
            stored += tier.put([item])
        except Exception as exc:  # noqa: BLE001
            assert "No space left" in str(exc)
            failures += 1
    assert failures >= 1 and tier.stats().errors == failures and not tier.stats().healthy
    first = bytearray(len(blocks[0]))
    assert tier.get(hashes[:1], [memoryview(first)]) == [len(blocks[0])] and bytes(first) == blocks[0]
    tier.delete(hashes[:10])  # room again: the next write succeeds and the tier is healthy
    assert tier.put([(hashes[-1], blocks[-1])]) == [True] and tier.stats().healthy
    tier.close()


@pytest.mark.skipif(not getattr(os, "RWF_NOWAIT", 0), reason="RWF_NOWAIT is Linux's")
def test_cached_blocks_are_read_at_once_and_evicted_ones_through_the_pool_with_the_same_bytes(tmp_path):
    """A batch is read from the page cache first (RWF_NOWAIT); a block the cache dropped (posix_fadvise
    DONTNEED after fsync) goes to the pool. Either way the bytes are the block's."""
    tier = DiskTier(str(tmp_path), 1 << 20, fsync=True)
    try:
        hashes, blocks = make_blocks(6)
        assert tier.put(list(zip(hashes, blocks))) == [True] * 6
        for h in hashes[3:]:                       # out of the page cache: a read of them would wait
            fd = os.open(tier._file(bytes(h)), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        before = (tier.reads_cached, tier.reads_waited)
        assert read(tier, hashes) == blocks
        cached, waited = tier.reads_cached - before[0], tier.reads_waited - before[1]
        assert cached + waited == 6 and cached >= 3    # the three just written stay cached
        assert read(tier, hashes) == blocks            # now every one is cached again
        assert tier.reads_cached - before[0] - cached == 6
    finally:
        tier.close()
