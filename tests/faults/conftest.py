"""Fault tests reuse the real-server fixtures of tests/integration (a redis-server and moto's S3 server on free
loopback ports, stopped when the session or test ends); imported, not copied."""
from tests.integration.conftest import (  # noqa: F401 - fixtures, found by name
    fresh_redis_server, fresh_s3_server, redis_key_prefix, redis_server, s3_bucket, s3_server)
