"""The worker's tiered store: host always, disk, Redis and S3 when configured (written through in the background).

The store publishes its own per-tier `BlockStored` / `BlockRemoved` events (medium host, disk, redis, s3) to the
worker's KV-event publisher (DESIGN §6).

    --s3-url s3://BUCKET/PREFIX                 AWS (credentials from the usual boto3 places)
    --s3-url http://HOST:PORT/BUCKET/PREFIX     an S3-compatible server (MinIO, moto); the bucket is created

`s3_config` checks the URL the way S3 will (a bucket name is 3 to 63 lowercase letters, digits, dots and hyphens,
starting and ending with a letter or digit), so `strata serve` and the worker CLIs refuse a bad one while parsing
their arguments, before any process starts, rather than a worker failing after loading its model.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any
from urllib.parse import urlparse

from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, S3TierConfig, StoreConfig
from kvstore.store import TieredStore
from worker_common.config import WorkerConfig

LOCAL_TIERS = ("host", "disk")        # besides the device tier; redis and s3 are shared
S3_URL_FORMS = "s3://BUCKET[/PREFIX] or http(s)://HOST:PORT/BUCKET[/PREFIX]"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def s3_config(url: str) -> S3TierConfig:
    """The S3 tier of `--s3-url`; ValueError naming `--s3-url`, the URL and what is allowed."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        bucket, prefix = parsed.netloc, parsed.path.strip("/")
        endpoint = ""
    elif parsed.scheme in ("http", "https") and parsed.netloc:
        bucket, _, prefix = parsed.path.strip("/").partition("/")
        endpoint = f"{parsed.scheme}://{parsed.netloc}"
    else:
        raise ValueError(f"--s3-url must be {S3_URL_FORMS}, got {url!r}")
    if not bucket:
        raise ValueError(f"--s3-url must name a bucket ({S3_URL_FORMS}), got {url!r}")
    if not _BUCKET.match(bucket):
        raise ValueError(f"--s3-url names bucket {bucket!r}, but an S3 bucket name is 3 to 63 characters of "
                         f"lowercase letters, digits, '.' and '-', starting and ending with a letter or digit "
                         f"(e.g. {endpoint or 's3:/'}/strata-kv); got {url!r}")
    prefix = f"{prefix}/" if prefix else "strata/kv/"
    return S3TierConfig(bucket=bucket, prefix=prefix, endpoint_url=endpoint, create_bucket=bool(endpoint))


def store_config(config: WorkerConfig) -> StoreConfig:
    disk = DiskTierConfig(path=config.disk_path) if config.disk_path else None
    redis = RedisTierConfig(url=config.redis_url, quota_bytes=config.tier_quota_bytes) if config.redis_url else None
    s3 = replace(s3_config(config.s3_url), quota_bytes=config.tier_quota_bytes) if config.s3_url else None
    write_through = tuple(name for name, tier in (("disk", disk), ("redis", redis), ("s3", s3)) if tier is not None)
    # NOTE: populate: the host tier's pages are faulted in at start, not by the first write into each slot
    host = HostTierConfig(capacity_bytes=config.host_tier_bytes, populate=True)
    return StoreConfig(host=host, disk=disk, redis=redis, s3=s3,
                       write_through=write_through, encryption_key_file=config.kv_encryption_key_file)


def build_store(config: WorkerConfig, publisher: Any | None = None) -> TieredStore:
    return TieredStore(store_config(config), publisher=publisher)
