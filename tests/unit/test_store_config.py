"""Store configs: frozen, validated, and errors name the field."""
from __future__ import annotations

import dataclasses

import pytest

from kvstore.config import DiskTierConfig, HostTierConfig, RedisTierConfig, S3TierConfig, StoreConfig


def test_defaults_configure_host_only():
    config = StoreConfig()
    assert config.tier_names() == ["host"]
    assert config.tier_options("host") == {"capacity_bytes": 1 << 30, "slot_bytes": 0, "shm_name": "",
                                           "populate": False}


def test_tiers_are_ordered_fastest_first_and_options_are_constructor_keywords():
    config = StoreConfig(s3=S3TierConfig(bucket="kv-bucket"), disk=DiskTierConfig(path="/tmp/kv"),
                         redis=RedisTierConfig(url="redis://10.0.0.1:6379/2", ttl_s=60))
    assert config.tier_names() == ["host", "disk", "redis", "s3"]
    assert config.tier_options("redis")["ttl_s"] == 60
    assert config.tier_options("s3")["bucket"] == "kv-bucket"


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StoreConfig().demotion = "none"


@pytest.mark.parametrize("make, field", [
    (lambda: HostTierConfig(capacity_bytes=0), "host.capacity_bytes"),
    (lambda: HostTierConfig(capacity_bytes=4096, slot_bytes=8192), "host.slot_bytes"),
    (lambda: HostTierConfig(shm_name="a/b"), "host.shm_name"),
    (lambda: DiskTierConfig(path=""), "disk.path"),
    (lambda: DiskTierConfig(path="/x", capacity_bytes=-1), "disk.capacity_bytes"),
    (lambda: DiskTierConfig(path="/x", io_threads=0), "disk.io_threads"),
    (lambda: RedisTierConfig(url="http://localhost"), "redis.url"),
    (lambda: RedisTierConfig(ttl_s=-1), "redis.ttl_s"),
    (lambda: S3TierConfig(bucket="b"), "s3.bucket"),
    (lambda: S3TierConfig(bucket="bucket", endpoint_url="localhost:9000"), "s3.endpoint_url"),
    (lambda: StoreConfig(write_through=("host",)), "write_through"),
    (lambda: StoreConfig(write_through=("disk",)), "store.disk is not set"),
    (lambda: StoreConfig(demotion="lru"), "demotion"),
    (lambda: StoreConfig(queue_depth=0), "queue_depth"),
    (lambda: StoreConfig(backoff_initial_s=5, backoff_max_s=1), "backoff_initial_s"),
])
def test_invalid_values_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()
