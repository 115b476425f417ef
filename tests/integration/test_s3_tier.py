"""The S3 tier against a real S3-compatible HTTP server (moto's): round trips, multipart, lookups, clear, in both
layouts; then the pack layout's own behaviour: one object and one ranged GET per batch, lookups without a request
per block, other processes' packs after a refresh, tombstones, batched deletes, vanished packs."""
from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from kvstore.hashing import Namespace, hash_blocks
from kvstore.tiers.base import TIER_REGISTRY
from kvstore.tiers.s3 import S3Tier, _part_ranges
from kvstore.tiers.s3_pack import PACKS, TOMBSTONES
from tests.integration.conftest import s3_client

NS = Namespace("tiny-llama:abc", "L2-H4-D16-B4", "float16")
MiB = 1 << 20
BLOCK_BYTES = 65_728  # an encoded block of a small model: 124 of them are a 8 MB prefix


def make_hashes(n: int, salt: str = "") -> list[bytes]:
    return hash_blocks(NS.with_salt(salt), list(range(n * 4)), 4)


def make_tier(server, bucket, **options) -> S3Tier:
    return S3Tier(bucket=bucket, namespace=NS, **server.client_options(), **options)


def make_blocks(n: int, size: int = 64) -> list[bytes]:
    return [bytes([i % 251]) * size + i.to_bytes(4, "little") for i in range(n)]


def listed(server, bucket: str, prefix: str) -> list[str]:
    pages = s3_client(server).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


class Requests:
    """Counts the S3 requests one tier sends, by operation (`GetObject`, `ListObjectsV2`, ...)."""

    def __init__(self, tier: S3Tier) -> None:
        self.seen: Counter[str] = Counter()
        tier._client.meta.events.register("before-send.s3.*", self._count)  # NOTE: behind the tier's back, on purpose

    def _count(self, event_name: str, **_) -> None:
        self.seen[event_name.rsplit(".", 1)[-1]] += 1

    def take(self) -> dict[str, int]:
        seen, self.seen = dict(self.seen), Counter()
        return seen


@pytest.fixture(params=["pack", "block"])
def layout(request) -> str:
    return request.param


@pytest.fixture
def tier(s3_server, s3_bucket, layout):
    t = make_tier(s3_server, s3_bucket, layout=layout)
    yield t
    t.close()


# ------------------------------------------------------------------------------------------- both layouts

def test_round_trip_streams_into_caller_buffers(tier):
    hashes = make_hashes(3)
    blocks = [os.urandom(4096 + i) for i in range(3)]
    assert tier.put(list(zip(hashes, blocks))) == [True] * 3

    bufs = [memoryview(bytearray(8192)) for _ in hashes]
    assert tier.get(hashes, bufs) == [4096, 4097, 4098]
    assert [bytes(b[:len(blk)]) for b, blk in zip(bufs, blocks)] == blocks
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_written, stats.blocks) == (3, 0, 3 * 4096 + 3, 3)


def test_get_of_missing_key_is_none(tier):
    hashes = make_hashes(2)
    tier.put([(hashes[0], b"v")])
    assert tier.get(hashes, [memoryview(bytearray(4)) for _ in hashes]) == [1, None]
    assert tier.stats().misses == 1


def test_put_above_threshold_is_a_multipart_upload(s3_server, s3_bucket, layout):
    tier = make_tier(s3_server, s3_bucket, layout=layout, multipart_threshold_bytes=6 * MiB,
                     multipart_part_bytes=5 * MiB)
    h, small_h = make_hashes(2)
    big = os.urandom(12 * MiB + 123)  # parts: 5 MiB, 7 MiB + 123 (+ the small block and the index for a pack)
    tier.put([(h, memoryview(big)), (small_h, b"small")])

    etag = s3_client(s3_server).head_object(Bucket=s3_bucket, Key=tier.key(h))["ETag"]
    assert etag.strip('"').endswith("-2")  # S3 marks a multipart object's ETag with its part count
    buf = memoryview(bytearray(13 * MiB))
    assert tier.get([h], [buf]) == [len(big)]
    assert bytes(buf[:len(big)]) == big


def test_part_ranges_cover_the_object_with_a_larger_last_part():
    assert _part_ranges(12 * MiB + 123, 5 * MiB) == [(1, 0, 5 * MiB), (2, 5 * MiB, 12 * MiB + 123)]
    assert _part_ranges(3, 5 * MiB) == [(1, 0, 3)]


@pytest.mark.parametrize("layout, lookup", [("block", "head"), ("block", "index"), ("pack", "head")])
def test_contains_is_batched_and_longest_prefix_stops_at_first_gap(s3_server, s3_bucket, layout, lookup):
    tier = make_tier(s3_server, s3_bucket, layout=layout, lookup=lookup)
    hashes = make_hashes(40)
    tier.put([(h, b"v") for i, h in enumerate(hashes) if i != 25])
    assert tier.contains(hashes) == [i != 25 for i in range(40)]
    assert tier.longest_prefix(hashes) == 25


@pytest.mark.parametrize("layout, lookup", [("block", "index"), ("pack", "head")])
def test_index_lookup_sees_other_writers_after_refresh(s3_server, s3_bucket, layout, lookup):
    reader = make_tier(s3_server, s3_bucket, layout=layout, lookup=lookup, index_refresh_s=3600)
    writer = make_tier(s3_server, s3_bucket, layout=layout)
    h = make_hashes(1)[0]
    assert reader.contains([h]) == [False]  # builds the index

    writer.put([(h, b"v")])
    assert reader.contains([h]) == [False]  # stale until the next refresh: a lost reuse, never a wrong block
    reader.refresh_index()
    assert reader.contains([h]) == [True]


def test_clear_removes_only_its_own_prefix_and_namespace(s3_server, s3_bucket, layout):
    tier = make_tier(s3_server, s3_bucket, layout=layout)
    other = S3Tier(bucket=s3_bucket, namespace="other", layout=layout, **s3_server.client_options())
    client = s3_client(s3_server)
    client.put_object(Bucket=s3_bucket, Key="unrelated/object", Body=b"keep")
    hashes = make_hashes(5)
    tier.put([(h, b"v") for h in hashes])
    other.put([(h, b"v") for h in hashes])

    tier.clear()

    assert tier.contains(hashes) == [False] * 5
    assert other.contains(hashes) == [True] * 5
    assert client.get_object(Bucket=s3_bucket, Key="unrelated/object")["Body"].read() == b"keep"


def test_delete_counts_present_keys(tier):
    hashes = make_hashes(3)
    tier.put([(hashes[0], b"v"), (hashes[2], b"v")])
    assert tier.delete(hashes) == 2
    assert tier.contains(hashes) == [False] * 3


def test_create_bucket_makes_a_missing_bucket_and_accepts_an_existing_one(s3_server, s3_bucket, layout):
    name = s3_bucket[:50] + "-new"
    tier = S3Tier(bucket=name, create_bucket=True, layout=layout, **s3_server.client_options())
    tier.put([(make_hashes(1)[0], b"v")])
    S3Tier(bucket=name, create_bucket=True, **s3_server.client_options())  # already ours: fine
    tier.clear()
    s3_client(s3_server).delete_bucket(Bucket=name)


def test_buffer_too_small_is_a_value_error(tier):
    h = make_hashes(1)[0]
    tier.put([(h, b"x" * 100)])
    with pytest.raises(ValueError, match="too small"):
        tier.get([h], [memoryview(bytearray(10))])


@pytest.mark.parametrize("layout", [None, "pack", "block"])
def test_registered_under_its_config_name_and_takes_config_options(s3_server, s3_bucket, monkeypatch, layout):
    from dataclasses import asdict

    from kvstore.config import S3TierConfig

    opts = s3_server.client_options()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["aws_access_key_id"])  # credentials from the usual places
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["aws_secret_access_key"])
    chosen = {"layout": layout} if layout else {}
    config = S3TierConfig(bucket=s3_bucket, endpoint_url=opts["endpoint_url"], region=opts["region"], **chosen)
    tier = TIER_REGISTRY["s3"](**asdict(config))
    assert tier.layout == (layout or "pack")
    h = make_hashes(1)[0]
    tier.put([(h, b"v")])
    assert tier.contains([h]) == [True]


@pytest.mark.parametrize("bad, match", [({"bucket": "x"}, "bucket"), ({"lookup": "scan"}, "lookup"),
                                        ({"layout": "zip"}, "layout"), ({"index_refresh_s": -1}, "index_refresh_s"),
                                        ({"multipart_part_bytes": MiB}, "multipart_part_bytes")])
def test_bad_options_are_rejected_with_what_is_allowed(bad, match):
    options = {"bucket": "strata-test", **bad}
    with pytest.raises(ValueError, match=match):
        S3Tier(**options)


def test_config_rejects_an_unknown_layout_naming_the_field():
    from kvstore.config import S3TierConfig

    with pytest.raises(ValueError, match=r"s3\.layout must be 'pack' or 'block', got 'zip'"):
        S3TierConfig(bucket="strata-test", layout="zip")


# ------------------------------------------------------------------------------------------- pack layout

@pytest.fixture
def packs(s3_server, s3_bucket):
    t = make_tier(s3_server, s3_bucket)
    yield t
    t.close()


def test_pack_round_trip_of_124_blocks_is_one_put_and_one_ranged_get(packs, s3_server, s3_bucket):
    hashes = make_hashes(124)
    blocks = [os.urandom(BLOCK_BYTES) for _ in hashes]
    requests = Requests(packs)

    assert packs.put(list(zip(hashes, blocks))) == [True] * 124
    assert requests.take() == {"PutObject": 1}
    assert len(listed(s3_server, s3_bucket, packs.key_base + PACKS)) == 1

    bufs = [memoryview(bytearray(BLOCK_BYTES)) for _ in hashes]
    assert packs.get(hashes, bufs) == [BLOCK_BYTES] * 124
    assert requests.take() == {"GetObject": 1}
    assert [bytes(b) for b in bufs] == blocks
    stats = packs.stats()
    assert (stats.blocks, stats.hits, stats.bytes_read) == (124, 124, 124 * BLOCK_BYTES)


def test_put_of_present_blocks_is_a_no_op_and_only_new_blocks_make_a_pack(packs, s3_server, s3_bucket):
    hashes = make_hashes(4)
    packs.put([(h, b"v") for h in hashes[:2]])
    requests = Requests(packs)

    assert packs.put([(h, b"v") for h in hashes[:2]]) == [True, True]
    assert requests.take() == {}
    assert packs.put([(h, b"w") for h in hashes]) == [True] * 4
    assert requests.take() == {"PutObject": 1}
    assert sorted(int(k.rsplit("-", 2)[1]) for k in listed(s3_server, s3_bucket, packs.key_base + PACKS)) == [2, 2]


def test_contains_answers_from_the_index_without_a_request_per_block(s3_server, s3_bucket):
    writer = make_tier(s3_server, s3_bucket)
    hashes = make_hashes(124)
    writer.put([(h, b"v") for h in hashes[:62]])
    writer.put([(h, b"v") for h in hashes[62:]])
    reader = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    requests = Requests(reader)

    assert reader.contains(hashes) == [True] * 124  # start-up: two LISTs and one ranged GET per pack
    assert requests.take() == {"ListObjectsV2": 2, "GetObject": 2}
    assert reader.contains(hashes + make_hashes(3, salt="absent")) == [True] * 124 + [False] * 3
    assert requests.take() == {}


def test_a_second_instance_reads_the_first_ones_packs_after_refresh_index(s3_server, s3_bucket):
    first = make_tier(s3_server, s3_bucket)
    second = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    hashes = make_hashes(6)
    blocks = make_blocks(6)
    assert second.contains(hashes) == [False] * 6
    first.put(list(zip(hashes[:3], blocks[:3])))
    first.put(list(zip(hashes[3:], blocks[3:])))

    second.refresh_index()

    bufs = [memoryview(bytearray(100)) for _ in hashes]
    assert second.get(hashes, bufs) == [len(b) for b in blocks]
    assert [bytes(buf[:len(b)]) for buf, b in zip(bufs, blocks)] == blocks
    assert second.stats().blocks == 6


def test_learn_reads_only_the_pack_named_after_a_wanted_block_and_falls_back_to_a_refresh(s3_server, s3_bucket):
    """`learn(wanted)`: one LIST and the index of the new pack named after a wanted block, not of the other new
    packs; wanted blocks in a pack named after another block (stored after it in one put) take a full refresh."""
    first = make_tier(s3_server, s3_bucket)
    second = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    hashes, blocks = make_hashes(9), make_blocks(9)
    assert second.contains(hashes) == [False] * 9  # its index is loaded (empty) now
    for lo, hi in ((0, 3), (3, 6), (6, 9)):
        first.put(list(zip(hashes[lo:hi], blocks[lo:hi])))
    requests = Requests(second)

    second.learn(hashes[3:6])
    assert requests.take() == {"ListObjectsV2": 1, "GetObject": 1}
    assert second.contains(hashes) == [False] * 3 + [True] * 3 + [False] * 3
    bufs = [memoryview(bytearray(100)) for _ in range(3)]
    assert second.get(hashes[3:6], bufs) == [len(b) for b in blocks[3:6]]
    assert [bytes(buf[:len(b)]) for buf, b in zip(bufs, blocks[3:6])] == blocks[3:6]
    requests.take()

    second.learn(hashes[7:9])  # in the pack named after hashes[6]: not among the wanted, so a full refresh
    assert requests.take()["GetObject"] == 2  # the two packs still unread
    assert second.contains(hashes) == [True] * 9
    first.close()
    second.close()


def test_known_answers_from_a_stale_index_without_a_request(s3_server, s3_bucket):
    """`known`: what a lookup the router expects hits asks first; a periodic refresh it started would compete
    with the `learn` that follows for the same server."""
    first, second = make_tier(s3_server, s3_bucket), make_tier(s3_server, s3_bucket, index_refresh_s=0.0)
    hashes = make_hashes(3)
    assert second.known(hashes) == [False] * 3  # the first answer loads the index, as `contains` does
    first.put(list(zip(hashes, make_blocks(3))))
    requests = Requests(second)
    assert second.known(hashes) == [False] * 3 and requests.take() == {}
    second.learn(hashes)
    assert second.known(hashes) == [True] * 3
    first.close()
    second.close()


def test_get_reads_far_apart_blocks_of_one_pack_with_separate_ranged_gets(packs):
    hashes = make_hashes(3)
    blocks = [b"a" * 100, b"b" * (2 * MiB), b"c" * 100]  # the middle block is a gap worth a second request
    packs.put(list(zip(hashes, blocks)))
    requests = Requests(packs)

    bufs = [memoryview(bytearray(100)) for _ in range(2)]
    assert packs.get([hashes[2], hashes[0]], bufs) == [100, 100]
    assert requests.take() == {"GetObject": 2}
    assert [bytes(b) for b in bufs] == [b"c" * 100, b"a" * 100]


def test_get_of_the_same_block_twice_fills_both_buffers(packs):
    h = make_hashes(1)[0]
    packs.put([(h, b"xyz")])
    bufs = [memoryview(bytearray(3)) for _ in range(2)]
    assert packs.get([h, h], bufs) == [3, 3]
    assert [bytes(b) for b in bufs] == [b"xyz", b"xyz"]


def test_deleting_some_blocks_of_a_pack_tombstones_them_for_every_process(s3_server, s3_bucket):
    first = make_tier(s3_server, s3_bucket)
    second = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    hashes = make_hashes(4)
    first.put([(h, b"v") for h in hashes])
    assert second.contains(hashes) == [True] * 4

    assert first.delete([hashes[1], hashes[1], make_hashes(1, salt="absent")[0]]) == 2
    assert first.contains(hashes) == [True, False, True, True]
    assert len(listed(s3_server, s3_bucket, first.key_base + TOMBSTONES)) == 1
    assert second.contains(hashes) == [True] * 4  # stale until it refreshes
    second.refresh_index()
    assert second.contains(hashes) == [True, False, True, True]
    assert second.get(hashes[1:2], [memoryview(bytearray(1))]) == [None]


def test_deleting_the_last_live_blocks_of_a_pack_deletes_it_and_a_refresh_collects_its_tombstones(
        s3_server, s3_bucket):
    first = make_tier(s3_server, s3_bucket)
    second = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    hashes = make_hashes(4)
    first.put([(h, b"v") for h in hashes])
    first.delete(hashes[:1])  # a tombstone
    second.refresh_index()

    assert second.delete(hashes[1:]) == 3  # every live block: the pack goes, no second tombstone
    assert listed(s3_server, s3_bucket, second.key_base + PACKS) == []
    assert len(listed(s3_server, s3_bucket, second.key_base + TOMBSTONES)) == 1
    first.refresh_index()  # the tombstone names only a pack that is gone
    assert listed(s3_server, s3_bucket, first.key_base) == []
    assert first.contains(hashes) == [False] * 4 and first.stats().blocks == 0


def test_a_refresh_deletes_a_pack_that_two_processes_tombstoned_between_them(s3_server, s3_bucket):
    """Neither saw the other's tombstone, so neither deleted the pack; the next refresh does."""
    first = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    second = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    hashes = make_hashes(2)
    first.put([(h, b"v") for h in hashes])
    second.refresh_index()
    first.delete(hashes[:1])
    second.delete(hashes[1:])
    assert len(listed(s3_server, s3_bucket, first.key_base + PACKS)) == 1

    first.refresh_index()  # the pack: every block tombstoned
    first.refresh_index()  # its tombstones: their pack is gone
    assert listed(s3_server, s3_bucket, first.key_base) == []


def test_a_block_stored_again_after_its_delete_is_live_for_every_process(s3_server, s3_bucket):
    first = make_tier(s3_server, s3_bucket)
    second = make_tier(s3_server, s3_bucket, index_refresh_s=3600)
    hashes = make_hashes(2)
    first.put([(h, b"v") for h in hashes])
    first.delete(hashes[:1])  # tombstoned in the first pack
    first.put([(hashes[0], b"again")])  # a new pack: the tombstone does not name it

    second.refresh_index()
    assert second.contains(hashes) == [True, True]
    buf = memoryview(bytearray(5))
    assert second.get(hashes[:1], [buf]) == [5] and bytes(buf) == b"again"


def test_delete_of_2000_keys_is_batched_and_returns_how_many_were_present(packs, s3_server, s3_bucket):
    hashes = make_hashes(2000)
    for start in range(0, 2000, 100):
        packs.put([(h, b"v") for h in hashes[start:start + 100]])
    doomed = hashes[50:] + make_hashes(50, salt="absent")  # 1950 present: 19 whole packs, half of the first
    packs.refresh_index()  # else the unknown keys make the delete load the index first (two LISTs)
    requests = Requests(packs)

    started = time.monotonic()
    assert packs.delete(doomed) == 1950
    assert time.monotonic() - started < 5.0
    assert requests.take() == {"PutObject": 1, "DeleteObjects": 1}  # one tombstone, one batch of 19 packs
    assert packs.contains(hashes) == [i < 50 for i in range(2000)]
    other = make_tier(s3_server, s3_bucket)
    assert other.contains(hashes) == [i < 50 for i in range(2000)]
    assert len(listed(s3_server, s3_bucket, packs.key_base + PACKS)) == 1


def test_clear_deletes_packs_and_tombstones_and_empties_the_index(packs, s3_server, s3_bucket):
    hashes = make_hashes(300)
    for start in range(0, 300, 3):
        packs.put([(h, b"v") for h in hashes[start:start + 3]])
    packs.delete(hashes[::3])
    requests = Requests(packs)

    packs.clear()

    assert listed(s3_server, s3_bucket, packs.key_base) == []
    assert requests.take() == {"ListObjectsV2": 1, "DeleteObjects": 1}  # 101 objects, one batch
    assert packs.contains(hashes) == [False] * 300
    assert (packs.stats().blocks, packs.stats().used_bytes) == (0, 0)
    assert make_tier(s3_server, s3_bucket).contains(hashes) == [False] * 300


def test_get_of_a_pack_deleted_behind_the_tiers_back_is_a_miss_and_leaves_the_index(packs, s3_server, s3_bucket):
    hashes = make_hashes(3)
    packs.put([(h, b"v") for h in hashes])
    s3_client(s3_server).delete_object(Bucket=s3_bucket, Key=packs.key(hashes[0]))

    assert packs.get(hashes, [memoryview(bytearray(1)) for _ in hashes]) == [None] * 3
    assert packs.stats().misses == 3
    assert packs.contains(hashes) == [False] * 3


def test_a_pack_replaced_by_a_shorter_object_is_a_miss_never_other_bytes(packs, s3_server, s3_bucket):
    hashes = make_hashes(3)
    packs.put([(h, bytes([i]) * 10) for i, h in enumerate(hashes)])
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key=packs.key(hashes[0]), Body=b"short")

    assert packs.get(hashes[2:], [memoryview(bytearray(10))]) == [None]


def test_a_malformed_pack_is_ignored_and_left_alone(packs, s3_server, s3_bucket):
    h = make_hashes(1)[0]
    junk = f"{packs.key_base}{PACKS}{h.hex()}-1-0000"
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key=junk, Body=b"not a pack" * 10)

    assert packs.contains([h]) == [False]
    assert packs.get([h], [memoryview(bytearray(100))]) == [None]
    assert listed(s3_server, s3_bucket, packs.key_base) == [junk]


def test_a_refresh_waits_at_most_its_budget_and_later_ones_collect_the_rest(s3_server, s3_bucket):
    writer = make_tier(s3_server, s3_bucket)
    hashes = make_hashes(40)
    for start in range(0, 40, 2):
        writer.put([(h, b"v") for h in hashes[start:start + 2]])
    reader = make_tier(s3_server, s3_bucket, refresh_budget_s=0.001, index_refresh_s=3600)

    started = time.monotonic()
    reader.contains(hashes)  # 20 new packs to read: more than a millisecond's work
    assert time.monotonic() - started < 1.0
    deadline = time.monotonic() + 10
    while not all(reader.contains(hashes)) and time.monotonic() < deadline:
        time.sleep(0.01)  # each lookup refreshes again (a partial refresh is stale at once) and collects reads
    assert reader.contains(hashes) == [True] * 40
