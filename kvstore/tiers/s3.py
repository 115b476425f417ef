"""The S3 tier (DESIGN §5, G4): blocks in any S3-compatible object store, through boto3.

Credentials come from where boto3 looks (explicit options, environment, shared config/credentials files, instance
roles); `endpoint_url` points it at MinIO, Ceph, moto or another S3-compatible server. Every object lives under
`<prefix><namespace>/` (the key base). Two layouts:

`layout="pack"` (default): each `put` batch is ONE object, a pack, so a long prefix is read with a few large ranged
GETs instead of one small GET per block (S3 charges per request and each costs milliseconds of overhead). The pack
format (names, the byte layout with its index and footer, tombstones) and the `PackIndex` bookkeeping live in
kvstore/tiers/s3_pack.py; this module does the I/O:
- `contains` is answered from the in-memory `PackIndex`, never one request per block. The index learns this
  process's puts at once and other processes' packs by LIST plus one ranged GET of each new pack's index, at
  start-up (the first lookup, which waits for it) and whenever it is older than `index_refresh_s` (then on the
  tier's pool, beside the lookup that noticed: no lookup waits for a periodic LIST); `refresh_index()` forces it. A
  refresh waits at most `refresh_budget_s` for new indexes (a read still running then is collected by the next
  refresh); a refresh that fails raises `TierUnavailable` and suspends the index (it claims nothing and `put`
  skips nothing) until a refresh succeeds. Between refreshes a block another process stored looks absent (a lost
  reuse), and one another process deleted may still be read (its bytes are still its own; the store verifies
  them).
- `get` groups the wanted blocks by pack and reads each run of nearby blocks (gaps under 1 MiB, at most
  `multipart_part_bytes`) with one ranged GET, the runs concurrently. A pack that vanished is a miss and leaves the
  index. A block is only ever copied from the index entry of its own hash.
- `put` skips blocks the index already holds and stores the rest as one pack (multipart above the threshold).
  A put skipped on a stale entry (another process just deleted that pack) stores nothing: a lost reuse, which
  the next refresh or a `get` (a miss) corrects in the index.
- `delete`: packs are immutable. A pack all of whose live blocks are deleted is deleted (space reclaimed); the
  deleted blocks of other packs are named in ONE tombstone object per call, which every process reads on its
  next refresh. A refresh also collects garbage (see s3_pack.py): it lists tombstones before packs and deletes
  dead packs before the tombstones that name them.

`layout="block"`: one object per block at `<key base><block hash hex>`. S3 has no batched existence query, so
`contains` has two modes (`lookup`, which the pack layout ignores):
- `lookup="head"` (default): one HEAD per key, `max_workers` at a time. Always current, one request per key.
- `lookup="index"`: an in-memory index of the keys under this prefix, rebuilt from LIST (1000 keys per request)
  every `index_refresh_s` and updated by this process's own puts and deletes.
Reads stream the body straight into the caller's buffer (`readinto`); writes at or above
`multipart_threshold_bytes` go up as a multipart upload with parts sent in parallel.

`quota_bytes` > 0 (pack layout): each namespace (the fingerprint in every object's header) may hold that many bytes
of packs; a put past it is refused and counted (`quota_refused`). Packs then hold one namespace each and carry its
fingerprint in their name, so the count comes from the index (see `_admit` for its limit).

Both layouts: botocore retries (`max_attempts`, standard mode) and timeouts bound every call; every failure but
"not found" raises `TierUnavailable`. A missing bucket holds nothing for `contains` (as HEAD cannot tell it from
a missing key), while `get` and `put` raise.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Sequence

import boto3
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.hashing import HASH_BYTES, BlockHash, Namespace
from kvstore.sealing import fingerprint_of
from kvstore.tiers.base import Tier, TierStats, TierUnavailable, register_tier
from kvstore.tiers.redis import namespace_tag
from kvstore.tiers.s3_pack import (PACKS, TOMBSTONES, PackIndex, PackRange, decode_pack_tail, decode_tombstone,
                                   encode_pack, encode_tombstone, pack_count, pack_first_hash, pack_tail_bytes,
                                   plan_ranges)

log = logging.getLogger(__name__)

MiB = 1 << 20
_MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_PACK_GONE = _NOT_FOUND | {"InvalidRange"}  # a pack deleted or replaced since we indexed it
_ALREADY_OURS = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}
_BACKEND_ERRORS = (BotoCoreError, ClientError, urllib3.exceptions.HTTPError, OSError)
LAYOUTS = ("pack", "block")

_MAX_GAP = 1 * MiB  # a ranged GET reads through a gap this small rather than paying for another request
_DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys


# ------------------------------------------------------------------------------------------------------ tier

@register_tier("s3")
class S3Tier(Tier):
    """Blocks in an S3 bucket. See the module docstring for the layouts and lookup modes."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "strata/kv/",
        endpoint_url: str = "",
        region: str = "",
        *,
        namespace: Namespace | bytes | str | None = None,
        create_bucket: bool = False,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        profile: str | None = None,
        layout: str = "pack",
        lookup: str = "head",
        index_refresh_s: float = 5.0,
        refresh_budget_s: float = 2.0,
        multipart_threshold_bytes: int = 8 * MiB,
        multipart_part_bytes: int = 8 * MiB,
        max_workers: int = 16,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 2,
        capacity_bytes: int = 0,
        quota_bytes: int = 0,
    ) -> None:
        super().__init__()
        if quota_bytes < 0 or (quota_bytes and layout != "pack"):
            raise ValueError(f"quota_bytes must be >= 0 (0 = none) and needs layout='pack', got {quota_bytes}")
        self.quota_bytes = quota_bytes  # per namespace fingerprint; see `_admit`
        _check_args(bucket, layout, lookup, multipart_threshold_bytes, multipart_part_bytes, max_workers,
                    max_attempts, index_refresh_s, refresh_budget_s)
        self.bucket, self.layout, self.lookup = bucket, layout, lookup
        self.key_base = f"{prefix}{namespace_tag(namespace)}/"
        self.multipart_threshold, self.part_bytes = multipart_threshold_bytes, multipart_part_bytes
        self.index_refresh_s, self.refresh_budget_s = index_refresh_s, refresh_budget_s
        self._stats.capacity_bytes = capacity_bytes
        self._sizes: dict[bytes, int] = {}  # block layout: blocks this process has seen (index mode: all LIST saw)
        self._packs = PackIndex()  # pack layout
        self._lock = threading.Lock()  # guards _sizes and _packs
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._index_at = float("-inf")  # time.monotonic() of the last complete refresh; -inf: none (or it failed)
        self._reading: dict[str, Future] = {}  # pack layout: index and tombstone reads a refresh left running
        self._io = ThreadPoolExecutor(max_workers, thread_name_prefix="strata-s3")
        self._parts = ThreadPoolExecutor(max_workers, thread_name_prefix="strata-s3-part")
        self._client = self._make_client(endpoint_url, region, profile, aws_access_key_id, aws_secret_access_key,
                                         aws_session_token, connect_timeout_s, read_timeout_s, max_attempts,
                                         max_workers)
        if create_bucket:
            self._create_bucket(region)

    @staticmethod
    def _make_client(endpoint_url, region, profile, key_id, secret, token, connect_s, read_s, attempts, workers):
        session = boto3.session.Session(profile_name=profile) if profile else boto3.session.Session()
        config = Config(connect_timeout=connect_s, read_timeout=read_s, max_pool_connections=2 * workers,
                        retries={"max_attempts": attempts, "mode": "standard"})
        return session.client("s3", endpoint_url=endpoint_url or None, region_name=region or None,
                              aws_access_key_id=key_id, aws_secret_access_key=secret, aws_session_token=token,
                              config=config)

    def _create_bucket(self, region: str) -> None:
        args: dict = {"Bucket": self.bucket}
        if region and region != "us-east-1":
            args["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(**args)
        except ClientError as exc:
            if _code(exc) not in _ALREADY_OURS:
                raise self._unavailable("create_bucket", exc) from exc
        except _BACKEND_ERRORS as exc:
            raise self._unavailable("create_bucket", exc) from exc

    def key(self, block_hash: BlockHash) -> str:
        """The object that holds `block_hash`: its own (block layout), or its pack (pack layout; KeyError when the
        index does not know the block)."""
        if self.layout == "block":
            return self.key_base + block_hash.hex()
        with self._lock:
            entry = self._packs.find(bytes(block_hash))
        if entry is None:
            raise KeyError(f"no pack known to hold block {block_hash.hex()}")
        return entry.pack

    # ------------------------------------------------------------------------------------------------ Tier API

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        if self.layout == "pack" or self.lookup == "index":
            self._refresh_if_stale()
            with self._lock:
                if self.layout == "pack":
                    return [self._packs.find(bytes(k)) is not None for k in keys]
                return [bytes(k) in self._sizes for k in keys]
        return self._run("contains", self._head, keys)

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(bufs):
            raise ValueError(f"get needs one buffer per key, got {len(keys)} keys and {len(bufs)} buffers")
        started = time.perf_counter()
        if self.layout == "pack":
            written = self._get_packed(keys, bufs)
        else:
            written = self._run("get", self._get_one, keys, bufs)
        hits = [n for n in written if n is not None]
        self._observe("get", started, hits=len(hits), misses=len(written) - len(hits), bytes_read=sum(hits))
        return written

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        started = time.perf_counter()
        refused: set[bytes] = set()
        if self.layout == "pack" and self.quota_bytes:
            admitted, refused = self._admit(items)
            written = sum(self._put_packed(group, ns) for ns, group in _by_namespace(admitted).items())
        elif self.layout == "pack":
            written = self._put_packed(items)
        else:
            written = self._put_blocks(items)
        self._observe("put", started, bytes_written=written, quota_refused=len(refused))
        return [bytes(k) not in refused for k, _ in items]

    def delete(self, keys: Sequence[BlockHash]) -> int:
        if self.layout == "pack":
            return self._delete_packed(keys)
        present = [k for k, there in zip(keys, self._run("delete", self._head, keys)) if there]
        self._delete_objects("delete", [self.key(k) for k in present])
        self._forget(keys)
        return len(present)

    def clear(self) -> None:
        """Delete every object under this tier's prefix and namespace (and nothing else in the bucket)."""
        self._delete_objects("clear", list(self._list(self.key_base)))
        with self._lock:
            self._sizes.clear()
            self._packs = PackIndex()
        self._index_at = time.monotonic() if self.layout == "pack" else float("-inf")

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        self._parts.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def stats(self) -> TierStats:
        stats = super().stats()
        with self._lock:
            if self.layout == "pack":
                stats.blocks, stats.used_bytes = self._packs.blocks_and_bytes()
            else:
                stats.blocks, stats.used_bytes = len(self._sizes), sum(self._sizes.values())
        return stats

    def refresh_index(self) -> None:
        """Bring the index up to date from LIST now (the tier does this on its own every `index_refresh_s`)."""
        with self._refresh_lock:
            if self.layout == "pack":
                self._refresh_packs()
            else:
                self._refresh_blocks()

    def known(self, keys: Sequence[BlockHash]) -> list[bool]:
        """`contains` as the index stands, starting no periodic refresh (the first load still waits); the block
        layout without an index asks S3 as `contains` does."""
        if (self.layout != "pack" and self.lookup != "index") or self._index_at == float("-inf"):
            return self.contains(keys)
        with self._lock:
            if self.layout == "pack":
                return [self._packs.find(bytes(k)) is not None for k in keys]
            return [bytes(k) in self._sizes for k in keys]

    def learn(self, wanted: Sequence[BlockHash]) -> None:
        """Bring the index up to date for `wanted`, blocks another process is known to have stored (the router saw
        its KV events) since this one last listed, reading as little as it can before a lookup that waits for it:
        one LIST of the packs, then the indexes of the new packs named after a wanted block (a prefix stored in one
        put names its pack after its first block), concurrently; a full `refresh_index()` only if some wanted block
        is still unknown (or the layout keeps no pack index). Tombstones and garbage wait for the next refresh (a
        block deleted meanwhile may be read: its bytes are still its own, and the store verifies them)."""
        wanted = {bytes(k) for k in wanted}
        if self.layout != "pack" or self._index_at == float("-inf") or not wanted:
            self.refresh_index()
            return
        # NOTE: not under `_refresh_lock`: a periodic refresh the lookup's `contains` just started in the background
        # (reading every new pack) would hold it; both only add to the index, under `_lock`
        listed_at = time.monotonic()  # a refresh whose listing began earlier must not forget what this one learns
        packs = self._list(self.key_base + PACKS, missing_bucket_is_empty=True)
        with self._lock:
            new, _ = self._packs.unread(packs, {})
        named = {k: size for k, size in new.items() if pack_first_hash(k) in wanted}
        reads = {k: self._io.submit(self._read_pack_tail, k, size) for k, size in named.items()}
        try:
            results = {k: f.result() for k, f in reads.items()}
        except _BACKEND_ERRORS as exc:
            raise self._unavailable("refresh", exc) from exc
        with self._lock:
            for key, spans in results.items():
                if spans is not None and key not in self._packs.packs:
                    self._packs.add_pack(key, named[key], spans, born=listed_at)
            missing = [k for k in wanted if self._packs.find(k) is None]
        if missing:
            self.refresh_index()

    # ------------------------------------------------------------------------------------------ pack layout

    def _get_packed(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        wanted = [bytes(k) for k in keys]
        self._refresh_if_stale(wanted)
        views = [_bytes_view(b) for b in bufs]
        with self._lock:
            entries = [self._packs.find(k) for k in wanted]
        found = [(e, i) for i, e in enumerate(entries) if e is not None and e.block_hash == wanted[i]]
        for entry, i in found:
            if entry.length > len(views[i]):
                raise ValueError(f"buffer of {len(views[i])} bytes is too small for block {entry.block_hash.hex()} "
                                 f"of {entry.length} bytes")
        ranges = plan_ranges(found, _MAX_GAP, self.part_bytes)
        served = self._run("get", lambda r: self._read_range(r, views), ranges)
        written: list[int | None] = [None] * len(keys)
        gone = {r.pack for r, ok in zip(ranges, served) if not ok}
        for r in ranges:
            for entry, i in r.parts if r.pack not in gone else ():
                written[i] = entry.length
        if gone:
            with self._lock:
                for pack in gone:
                    self._packs.drop_pack(pack)
        return written

    def _read_range(self, rng: PackRange, views: list[memoryview]) -> bool:
        """One ranged GET straight into the callers' buffers; False when the pack is gone or not what we indexed."""
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=rng.pack, Range=f"bytes={rng.start}-{rng.end - 1}")
        except ClientError as exc:
            if _code(exc) in _PACK_GONE:
                return False
            raise
        body = reply["Body"]
        try:
            if reply["ContentLength"] != rng.end - rng.start:
                return False  # NOTE: a shorter object under the pack's name: never guess where the blocks are
            position, previous = rng.start, None
            for entry, i in rng.parts:
                if previous is not None and entry.offset == previous[0].offset:  # the same block asked twice
                    views[i][:entry.length] = views[previous[1]][:entry.length]
                    continue
                _skip(body, entry.offset - position)
                _read_exactly(body, views[i], entry.length, entry.block_hash)
                position, previous = entry.offset + entry.length, (entry, i)
        finally:
            body.close()
        return True

    def _admit(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]
               ) -> tuple[list[tuple[BlockHash, bytes | memoryview]], set[bytes]]:
        """Quota: the items that fit their namespace's quota, and the keys refused. A namespace's usage is the bytes
        of the packs named after it in the index: every process's packs as of the last LIST (refreshed every
        `index_refresh_s`) plus this process's since. NOTE: so processes writing between two refreshes can
        together overshoot by what they write in that window; a tombstoned block counts until its pack goes."""
        self._refresh_if_stale()
        admitted, refused = [], set()
        with self._lock:
            usage: dict[str, int] = {}
            for key, pack in self._packs.packs.items():
                if ns := _pack_namespace(key):
                    usage[ns] = usage.get(ns, 0) + pack.size
            for key, data in items:
                ns, size = fingerprint_of(data).hex(), memoryview(data).nbytes
                if self._packs.find(bytes(key)) is None and usage.get(ns, 0) + size > self.quota_bytes:
                    refused.add(bytes(key))
                    continue
                usage[ns] = usage.get(ns, 0) + size
                admitted.append((key, data))
        return admitted, refused

    def _put_packed(self, items: Sequence[tuple[BlockHash, bytes | memoryview]], namespace: str = "") -> int:
        fresh: dict[bytes, memoryview] = {}
        with self._lock:
            for key, data in items:
                key = bytes(key)
                if len(key) != HASH_BYTES:
                    raise ValueError(f"block hash must be {HASH_BYTES} bytes, got {len(key)}")
                if key not in fresh and self._packs.find(key) is None:
                    fresh[key] = memoryview(data).cast("B")
        if not fresh:
            return 0
        body, spans = encode_pack(list(fresh.items()))
        # NOTE: with a quota, a pack holds one namespace and is named `<fingerprint hex>.<first hash>-...`
        owner = f"{namespace}." if namespace else ""
        name = f"{self.key_base}{PACKS}{owner}{spans[0][0].hex()}-{len(spans)}-{os.urandom(8).hex()}"
        self._put_object(name, body)
        with self._lock:
            self._packs.add_pack(name, len(body), spans, born=time.monotonic())
        return sum(length for _, _, length in spans)

    def _delete_packed(self, keys: Sequence[BlockHash]) -> int:
        wanted = [bytes(k) for k in keys]
        self._refresh_if_stale(wanted)
        with self._lock:
            holders = {h: self._packs.holders(h) for h in set(wanted)}
            doomed: dict[str, set[bytes]] = {}
            for entry in (e for entries in holders.values() for e in entries):
                doomed.setdefault(entry.pack, set()).add(entry.block_hash)
            whole = [pack for pack, hashes in doomed.items() if self._packs.live(pack) <= hashes]
        partial = {pack: hashes for pack, hashes in doomed.items() if pack not in whole}
        if partial:
            self._write_tombstone(partial)
        self._delete_objects("delete", whole)
        with self._lock:
            for pack in whole:
                self._packs.drop_pack(pack)
        return sum(bool(holders[h]) for h in wanted)

    def _write_tombstone(self, named: dict[str, set[bytes]]) -> None:
        key = f"{self.key_base}{TOMBSTONES}{int(time.time() * 1000)}-{os.urandom(8).hex()}"
        self._call("delete", self._client.put_object, Bucket=self.bucket, Key=key,
                   Body=encode_tombstone(named, self.key_base))
        with self._lock:
            self._packs.add_tombstone(key, named)

    def _refresh_if_stale(self, wanted: Sequence[bytes] | None = None) -> None:
        """Refresh the index (pack layout; block layout in index mode) when it is older than `index_refresh_s`
        (for `wanted`: only when it lacks one of them). Once the index has loaded, the refresh runs on the tier's
        pool and the caller answers from the index as it stands; before (or after a failed refresh suspended it),
        the caller refreshes and waits."""
        if time.monotonic() - self._index_at < self.index_refresh_s:
            return
        if wanted is not None:
            with self._lock:
                if all(self._packs.find(k) is not None for k in wanted):
                    return
        loaded = self._index_at != float("-inf")
        if not self._refresh_lock.acquire(blocking=not loaded):
            return
        if loaded:  # a periodic refresh never holds up a lookup: it runs beside it, the index answers as it stands
            try:
                self._io.submit(self._refresh_locked, True)
            except RuntimeError:  # the tier is closing
                self._refresh_lock.release()
            return
        self._refresh_locked(False)

    def _refresh_locked(self, background: bool) -> None:
        """Refresh if still stale; the caller acquired `_refresh_lock`, released here. A failed background refresh
        is logged (the index is suspended, so the next lookup refreshes in the foreground and raises)."""
        try:
            if time.monotonic() - self._index_at >= self.index_refresh_s:
                if self.layout == "pack":
                    self._refresh_packs()
                else:
                    self._refresh_blocks()
        except TierUnavailable as exc:
            if not background:
                raise
            log.warning("s3 tier: background index refresh failed (%s)", exc)
        finally:
            self._refresh_lock.release()

    def _refresh_blocks(self) -> None:
        """Block layout, index mode: the key index from LIST. The caller holds `_refresh_lock`."""
        listed = {bytes.fromhex(k[len(self.key_base):]): size for k, size in self._list(self.key_base).items()
                  if _is_hash_hex(k[len(self.key_base):])}
        with self._lock:
            self._sizes, self._index_at = listed, time.monotonic()

    def _refresh_packs(self) -> None:
        """LIST tombstones, then packs (see s3_pack.py for why in that order); read what is new within
        the budget; forget what is gone; collect garbage. The caller holds `_refresh_lock`."""
        started = time.monotonic()
        try:
            tombstones = self._list(self.key_base + TOMBSTONES, missing_bucket_is_empty=True)
            packs = self._list(self.key_base + PACKS, missing_bucket_is_empty=True)
            complete = self._read_new(packs, tombstones, started + self.refresh_budget_s)
        except TierUnavailable:
            with self._lock:
                self._packs.suspended = True
            self._index_at = float("-inf")
            raise
        with self._lock:
            self._packs.sync(packs, tombstones, started)
            dead, orphans = self._packs.garbage(packs, tombstones)
        self._index_at = started if complete else started - self.index_refresh_s  # NOTE: partial: stale at once
        self._delete_objects("refresh", dead)  # NOTE: packs first: a tombstone must outlive the packs it names
        with self._lock:
            for pack in dead:
                self._packs.drop_pack(pack)
        self._delete_objects("refresh", orphans)

    def _read_new(self, packs: dict[str, int], tombstones: dict[str, int], deadline: float) -> bool:
        """Read the listed packs' indexes and tombstones the index lacks, until `deadline`; whether all were read.
        A read still running at the deadline carries on and is collected by the next refresh, so every refresh
        makes progress however short its budget. The caller holds `_refresh_lock` (which guards `_reading`)."""
        with self._lock:
            new_packs, new_tombstones = self._packs.unread(packs, tombstones)
        reads = {k: self._reading.get(k) or self._io.submit(self._read_pack_tail, k, size)
                 for k, size in new_packs.items()}
        reads.update({k: self._reading.get(k) or self._io.submit(self._read_tombstone, k) for k in new_tombstones})
        done, _ = wait(reads.values(), timeout=max(0.0, deadline - time.monotonic()))
        self._reading = {k: f for k, f in reads.items() if f not in done}  # forgets reads of what has gone
        try:
            results = {k: f.result() for k, f in reads.items() if f in done}
        except _BACKEND_ERRORS as exc:
            raise self._unavailable("refresh", exc) from exc
        with self._lock:
            for key in new_tombstones:
                if results.get(key) is not None:
                    self._packs.add_tombstone(key, results[key])
            for key, size in new_packs.items():
                if results.get(key) is not None:
                    self._packs.add_pack(key, size, results[key])
        return not self._reading

    def _read_pack_tail(self, key: str, size: int) -> list[tuple[bytes, int, int]] | None:
        """A pack's spans, or None when it is gone. A malformed pack has no spans: logged, remembered (so it is
        not read again), never served, never collected."""
        try:
            count = pack_count(key)
            start = size - pack_tail_bytes(count)
            if start < 0:
                raise ValueError(f"a {size}-byte object cannot hold the index of {count} blocks")
            tail = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{size - 1}")
            return decode_pack_tail(tail["Body"].read(), count, size)
        except ClientError as exc:
            if _code(exc) in _PACK_GONE:
                return None
            raise
        except ValueError as exc:
            log.warning("s3 tier: ignoring malformed pack %s: %s", key, exc)
            return []

    def _read_tombstone(self, key: str) -> dict[str, set[bytes]] | None:
        """The blocks a tombstone names per pack, or None when it is gone (a malformed one names nothing)."""
        try:
            return decode_tombstone(self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read(),
                                    self.key_base)
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return None
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("s3 tier: ignoring malformed tombstone %s: %s", key, exc)
            return {}

    # ---------------------------------------------------------------------------------------- block layout

    def _put_blocks(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> int:
        small = [(k, d) for k, d in items if len(d) < self.multipart_threshold]
        self._run("put", self._put_one, [k for k, _ in small], [d for _, d in small])
        for k, d in items:
            if len(d) >= self.multipart_threshold:
                view = memoryview(d).cast("B")
                self._upload_multipart(self.key(k), view)  # NOTE: parts go in parallel on their own pool
                self._remember(k, len(view))
        return sum(len(d) for _, d in items)

    def _head(self, key: BlockHash) -> bool:
        try:
            reply = self._client.head_object(Bucket=self.bucket, Key=self.key(key))
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                self._forget([key])
                return False
            raise
        self._remember(key, reply["ContentLength"])
        return True

    def _get_one(self, key: BlockHash, buf: memoryview) -> int | None:
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=self.key(key))
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                self._forget([key])
                return None
            raise
        body, size = reply["Body"], reply["ContentLength"]
        try:
            _read_exactly(body, _bytes_view(buf), size, key)
        finally:
            body.close()
        self._remember(key, size)
        return size

    def _put_one(self, key: BlockHash, data: bytes | memoryview) -> None:
        # NOTE: botocore needs bytes or a file for the body; a memoryview is copied once here.
        body = data if isinstance(data, bytes) else bytes(data)
        self._client.put_object(Bucket=self.bucket, Key=self.key(key), Body=body)
        self._remember(key, len(data))

    # -------------------------------------------------------------------------------------- both layouts

    def _put_object(self, name: str, body: bytes) -> None:
        if len(body) >= self.multipart_threshold:
            self._upload_multipart(name, memoryview(body))
        else:
            self._call("put", self._client.put_object, Bucket=self.bucket, Key=name, Body=body)

    def _upload_multipart(self, name: str, data: memoryview) -> None:
        upload = self._call("put", self._client.create_multipart_upload, Bucket=self.bucket, Key=name)["UploadId"]
        try:
            parts = list(self._parts.map(lambda part: self._upload_part(name, upload, data, *part),
                                         _part_ranges(len(data), self.part_bytes)))
            self._client.complete_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload,
                                                   MultipartUpload={"Parts": parts})
        except _BACKEND_ERRORS as exc:
            self._abort(name, upload)
            raise self._unavailable("put (multipart)", exc) from exc

    def _upload_part(self, name: str, upload: str, data: memoryview, number: int, start: int, end: int) -> dict:
        reply = self._client.upload_part(Bucket=self.bucket, Key=name, UploadId=upload, PartNumber=number,
                                         Body=bytes(data[start:end]))
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def _abort(self, name: str, upload: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
        except _BACKEND_ERRORS:
            pass  # NOTE: the server is likely down; a bucket lifecycle rule reaps abandoned uploads

    def _delete_objects(self, what: str, keys: Sequence[str]) -> None:
        """DeleteObjects in batches of 1000, the batches concurrently; any key refused -> TierUnavailable."""
        batches = [list(keys[i:i + _DELETE_BATCH]) for i in range(0, len(keys), _DELETE_BATCH)]
        replies = self._run(what, lambda batch: self._client.delete_objects(
            Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}), batches)
        refused = [e for reply in replies for e in reply.get("Errors", [])]
        if refused:
            raise self._unavailable(what, RuntimeError(f"DeleteObjects refused {len(refused)} keys: {refused[0]}"))

    # ------------------------------------------------------------------------------------------------- internals

    def _run(self, what: str, fn, *columns: Sequence) -> list:
        """fn(*row) for every row of `columns`, `max_workers` at a time; any backend failure -> TierUnavailable."""
        if not columns[0]:
            return []
        try:
            results = list(self._io.map(fn, *columns))
        except _BACKEND_ERRORS as exc:
            raise self._unavailable(what, exc) from exc
        self._mark_healthy()
        return results

    def _call(self, what: str, fn, **kwargs):
        try:
            reply = fn(**kwargs)
        except _BACKEND_ERRORS as exc:
            raise self._unavailable(what, exc) from exc
        self._mark_healthy()
        return reply

    def _list(self, prefix: str, missing_bucket_is_empty: bool = False) -> dict[str, int]:
        """Every key under `prefix` with its size."""
        found: dict[str, int] = {}
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                found.update((o["Key"], o["Size"]) for o in page.get("Contents", []))
        except ClientError as exc:
            if not (missing_bucket_is_empty and _code(exc) == "NoSuchBucket"):
                raise self._unavailable("list", exc) from exc
            return {}  # NOTE: a missing bucket holds no blocks; get and put still raise NoSuchBucket
        except _BACKEND_ERRORS as exc:
            raise self._unavailable("list", exc) from exc
        self._mark_healthy()
        return found

    def _remember(self, key: BlockHash, size: int) -> None:
        with self._lock:
            self._sizes[bytes(key)] = size

    def _forget(self, keys: Sequence[BlockHash]) -> None:
        with self._lock:
            for k in keys:
                self._sizes.pop(bytes(k), None)

    def _unavailable(self, what: str, exc: BaseException) -> TierUnavailable:
        with self._stats_lock:
            self._stats.healthy = False
        return self._failed(what, exc)

    def _mark_healthy(self) -> None:
        if not self._stats.healthy:
            with self._stats_lock:
                self._stats.healthy = True


def _check_args(bucket: str, layout: str, lookup: str, threshold: int, part: int, workers: int, attempts: int,
                refresh_s: float, budget_s: float) -> None:
    if not 3 <= len(bucket) <= 63:
        raise ValueError(f"bucket must be 3 to 63 characters, got {bucket!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'pack' or 'block', got {layout!r}")
    if lookup not in ("head", "index"):
        raise ValueError(f"lookup must be 'head' or 'index' (it applies to layout='block'), got {lookup!r}")
    if part < _MIN_PART:
        raise ValueError(f"multipart_part_bytes must be >= {_MIN_PART} (S3's minimum part), got {part}")
    if threshold < 1:
        raise ValueError(f"multipart_threshold_bytes must be >= 1, got {threshold}")
    if not 1 <= workers <= 256:
        raise ValueError(f"max_workers must be in [1, 256], got {workers}")
    if not 1 <= attempts <= 10:
        raise ValueError(f"max_attempts must be in [1, 10], got {attempts}")
    if refresh_s < 0:
        raise ValueError(f"index_refresh_s must be >= 0 (0 = refresh on every lookup), got {refresh_s}")
    if budget_s <= 0:
        raise ValueError(f"refresh_budget_s must be > 0, got {budget_s}")


def _pack_namespace(key: str) -> str:
    """The namespace (fingerprint hex) a pack's name carries, '' when none (written without a quota)."""
    head, dot, _ = key.rsplit("/", 1)[-1].partition(".")
    return head if dot else ""


def _by_namespace(items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> dict[str, list]:
    groups: dict[str, list] = {}
    for key, data in items:
        groups.setdefault(fingerprint_of(data).hex(), []).append((key, data))
    return groups


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_hash_hex(name: str) -> bool:
    try:
        return len(bytes.fromhex(name)) == 16
    except ValueError:
        return False


def _bytes_view(buf: memoryview) -> memoryview:
    buf = memoryview(buf)
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def _read_exactly(body, buf: memoryview, size: int, key: BlockHash) -> None:
    if size > len(buf):
        raise ValueError(f"buffer of {len(buf)} bytes is too small for block {key.hex()} of {size} bytes")
    done = 0
    while done < size:
        n = body.readinto(buf[done:size])
        if not n:
            raise urllib3.exceptions.ProtocolError(f"object {key.hex()} ended after {done} of {size} bytes")
        done += n


def _skip(body, size: int) -> None:
    """Read and drop `size` bytes of a body (a small gap between wanted blocks of a ranged GET)."""
    while size > 0:
        chunk = body.read(min(size, MiB))
        if not chunk:
            raise urllib3.exceptions.ProtocolError(f"pack body ended {size} bytes before the next block")
        size -= len(chunk)


def _part_ranges(size: int, part: int) -> list[tuple[int, int, int]]:
    """(part number, start, end) covering [0, size); the last part takes a remainder smaller than S3's minimum.

        |<- part ->|<- part ->|<- part + tail ->|
    """
    count = max(1, size // part)
    bounds = [i * part for i in range(count)] + [size]
    return [(i + 1, bounds[i], bounds[i + 1]) for i in range(count)]
