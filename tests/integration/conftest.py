"""Real servers for integration tests (DESIGN §10): a `redis-server` and moto's S3 server on free loopback ports.

Fixtures:
- `redis_server`, `s3_server`: one server each per session (started on first use). A test that kills one must use
  `fresh_redis_server` / `fresh_s3_server` instead, which give it its own.
- `redis_key_prefix`: a key prefix no other test uses, so tests never see each other's keys.
- `s3_bucket`: an empty bucket of its own on the session S3 server, removed afterwards.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid

import pytest

from strata.devservers import RedisServer, S3Server


def _unique(request: pytest.FixtureRequest, max_len: int) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower()).strip("-")
    suffix = uuid.uuid4().hex[:8]
    return f"{name[:max_len - len(suffix) - 1].strip('-')}-{suffix}"


def _redis_or_skip() -> None:
    if shutil.which("redis-server") is None and not os.path.exists("/usr/bin/redis-server"):
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


@pytest.fixture(scope="session")
def redis_server():
    _redis_or_skip()
    with RedisServer() as server:
        yield server


@pytest.fixture
def fresh_redis_server():
    _redis_or_skip()
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_key_prefix(request, redis_server) -> str:
    if not redis_server.running:  # a test broke the shared server: heal it for the next ones
        redis_server.start()
    return "test:" + _unique(request, 60)


@pytest.fixture(scope="session")
def s3_server():
    with S3Server() as server:
        yield server


@pytest.fixture
def fresh_s3_server():
    with S3Server() as server:
        yield server


def s3_client(server: S3Server):
    """A plain boto3 client for the server (tests use it to look behind the tier's back)."""
    import boto3

    opts = server.client_options()
    return boto3.client("s3", endpoint_url=opts["endpoint_url"], region_name=opts["region"],
                        aws_access_key_id=opts["aws_access_key_id"],
                        aws_secret_access_key=opts["aws_secret_access_key"])


def empty_and_delete_bucket(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    client.delete_bucket(Bucket=bucket)


@pytest.fixture
def s3_bucket(request, s3_server) -> str:
    if not s3_server.running:
        s3_server.start()
    client = s3_client(s3_server)
    bucket = _unique(request, 63)
    client.create_bucket(Bucket=bucket)
    yield bucket
    try:
        empty_and_delete_bucket(client, bucket)
    except Exception:  # noqa: BLE001 - the test may have deleted it or stopped the server on purpose
        pass
