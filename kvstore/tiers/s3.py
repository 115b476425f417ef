"""The S3 tier (DESIGN §5, G4): blocks in any S3-compatible object store, through boto3.

One object per block at `<prefix><namespace>/<block hash hex>`. Credentials come from where boto3 looks (explicit
options, environment, shared config/credentials files, instance roles); `endpoint_url` points it at MinIO, Ceph,
moto or another S3-compatible server.

Lookups. S3 has no batched existence query, so `contains` has two modes:
- `lookup="head"` (default): one HEAD per key, `max_workers` at a time. Always current (sees blocks other workers
  stored a moment ago), one request per key.
- `lookup="index"`: an in-memory index of the keys under this prefix, rebuilt from LIST (1000 keys per request)
  every `index_refresh_s` and updated by this process's own puts and deletes. No request per lookup, but blocks
  other workers stored since the last refresh look absent (a lost reuse, never a wrong block: a stale positive is
  a miss on `get`). Choose it for large shared buckets where HEAD latency dominates.

Reads stream the body straight into the caller's buffer (`readinto`); writes at or above
`multipart_threshold_bytes` go up as a multipart upload with parts sent in parallel. botocore retries
(`max_attempts`, standard mode) and timeouts bound every call; every failure but "not found" raises
`TierUnavailable`.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import boto3
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.hashing import BlockHash, Namespace
from kvstore.tiers.base import Tier, TierStats, TierUnavailable, register_tier
from kvstore.tiers.redis import namespace_tag

MiB = 1 << 20
_MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_ALREADY_OURS = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}
_BACKEND_ERRORS = (BotoCoreError, ClientError, urllib3.exceptions.HTTPError, OSError)


@register_tier("s3")
class S3Tier(Tier):
    """Blocks in an S3 bucket. See the module docstring for the lookup modes."""

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
        lookup: str = "head",
        index_refresh_s: float = 5.0,
        multipart_threshold_bytes: int = 8 * MiB,
        multipart_part_bytes: int = 8 * MiB,
        max_workers: int = 16,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 2,
        capacity_bytes: int = 0,
    ) -> None:
        super().__init__()
        _check_args(bucket, lookup, multipart_threshold_bytes, multipart_part_bytes, max_workers, max_attempts)
        self.bucket, self.lookup = bucket, lookup
        self.key_base = f"{prefix}{namespace_tag(namespace)}/"
        self.multipart_threshold, self.part_bytes = multipart_threshold_bytes, multipart_part_bytes
        self.index_refresh_s = index_refresh_s
        self._stats.capacity_bytes = capacity_bytes
        self._sizes: dict[bytes, int] = {}  # blocks this process has seen (index mode: everything LIST saw)
        self._lock = threading.Lock()
        self._index_at = float("-inf")
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
        return self.key_base + block_hash.hex()

    # ------------------------------------------------------------------------------------------------ Tier API

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        if self.lookup == "index":
            self._refresh_index_if_stale()
            with self._lock:
                return [bytes(k) in self._sizes for k in keys]
        return self._run("contains", self._head, keys)

    def get(self, keys: Sequence[BlockHash], bufs: Sequence[memoryview]) -> list[int | None]:
        if len(keys) != len(bufs):
            raise ValueError(f"get needs one buffer per key, got {len(keys)} keys and {len(bufs)} buffers")
        started = time.perf_counter()
        written = self._run("get", self._get_one, keys, bufs)
        hits = [n for n in written if n is not None]
        self._observe("get", started, hits=len(hits), misses=len(written) - len(hits), bytes_read=sum(hits))
        return written

    def put(self, items: Sequence[tuple[BlockHash, bytes | memoryview]]) -> list[bool]:
        started = time.perf_counter()
        small = [(k, d) for k, d in items if len(d) < self.multipart_threshold]
        self._run("put", self._put_one, [k for k, _ in small], [d for _, d in small])
        for k, d in items:
            if len(d) >= self.multipart_threshold:
                self._put_multipart(k, memoryview(d).cast("B"))  # NOTE: parts go in parallel on their own pool
        self._observe("put", started, bytes_written=sum(len(d) for _, d in items))
        return [True] * len(items)

    def delete(self, keys: Sequence[BlockHash]) -> int:
        present = [k for k, there in zip(keys, self._run("delete", self._head, keys)) if there]
        for start in range(0, len(present), 1000):
            chunk = present[start:start + 1000]
            self._call("delete", self._client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": [{"Key": self.key(k)} for k in chunk], "Quiet": True})
        self._forget(keys)
        return len(present)

    def clear(self) -> None:
        """Delete every object under this tier's prefix and namespace (and nothing else in the bucket)."""
        keys = list(self._list().keys())
        for start in range(0, len(keys), 1000):
            objects = [{"Key": k} for k in keys[start:start + 1000]]
            self._call("clear", self._client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": objects, "Quiet": True})
        with self._lock:
            self._sizes.clear()

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        self._parts.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def stats(self) -> TierStats:
        stats = super().stats()
        with self._lock:
            stats.blocks, stats.used_bytes = len(self._sizes), sum(self._sizes.values())
        return stats

    def refresh_index(self) -> None:
        """Rebuild the key index from LIST now (index mode does this on its own every `index_refresh_s`)."""
        listed = {bytes.fromhex(k[len(self.key_base):]): size for k, size in self._list().items()
                  if _is_hash_hex(k[len(self.key_base):])}
        with self._lock:
            self._sizes, self._index_at = listed, time.monotonic()

    # -------------------------------------------------------------------------------------------- one object each

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

    def _put_multipart(self, key: BlockHash, data: memoryview) -> None:
        name = self.key(key)
        upload = self._call("put", self._client.create_multipart_upload, Bucket=self.bucket, Key=name)["UploadId"]
        try:
            parts = list(self._parts.map(lambda part: self._upload_part(name, upload, data, *part),
                                         _part_ranges(len(data), self.part_bytes)))
            self._client.complete_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload,
                                                   MultipartUpload={"Parts": parts})
        except _BACKEND_ERRORS as exc:
            self._abort(name, upload)
            raise self._unavailable("put (multipart)", exc) from exc
        self._remember(key, len(data))

    def _upload_part(self, name: str, upload: str, data: memoryview, number: int, start: int, end: int) -> dict:
        reply = self._client.upload_part(Bucket=self.bucket, Key=name, UploadId=upload, PartNumber=number,
                                         Body=bytes(data[start:end]))
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def _abort(self, name: str, upload: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
        except _BACKEND_ERRORS:
            pass  # NOTE: the server is likely down; a bucket lifecycle rule reaps abandoned uploads

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

    def _list(self) -> dict[str, int]:
        """Every key under this prefix and namespace with its size."""
        found: dict[str, int] = {}
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                               Prefix=self.key_base):
                found.update((o["Key"], o["Size"]) for o in page.get("Contents", []))
        except _BACKEND_ERRORS as exc:
            raise self._unavailable("list", exc) from exc
        self._mark_healthy()
        return found

    def _refresh_index_if_stale(self) -> None:
        if time.monotonic() - self._index_at >= self.index_refresh_s:
            self.refresh_index()

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


def _check_args(bucket: str, lookup: str, threshold: int, part: int, workers: int, attempts: int) -> None:
    if not 3 <= len(bucket) <= 63:
        raise ValueError(f"bucket must be 3 to 63 characters, got {bucket!r}")
    if lookup not in ("head", "index"):
        raise ValueError(f"lookup must be 'head' or 'index', got {lookup!r}")
    if part < _MIN_PART:
        raise ValueError(f"multipart_part_bytes must be >= {_MIN_PART} (S3's minimum part), got {part}")
    if threshold < 1:
        raise ValueError(f"multipart_threshold_bytes must be >= 1, got {threshold}")
    if not 1 <= workers <= 256:
        raise ValueError(f"max_workers must be in [1, 256], got {workers}")
    if not 1 <= attempts <= 10:
        raise ValueError(f"max_attempts must be in [1, 10], got {attempts}")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_hash_hex(name: str) -> bool:
    try:
        return len(bytes.fromhex(name)) == 16
    except ValueError:
        return False


def _bytes_view(buf: memoryview) -> memoryview:
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


def _part_ranges(size: int, part: int) -> list[tuple[int, int, int]]:
    """(part number, start, end) covering [0, size); the last part takes a remainder smaller than S3's minimum.

        |<- part ->|<- part ->|<- part + tail ->|
    """
    count = max(1, size // part)
    bounds = [i * part for i in range(count)] + [size]
    return [(i + 1, bounds[i], bounds[i + 1]) for i in range(count)]
