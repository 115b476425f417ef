"""The region/lease snapshot the RDMA adapters (nixl, mooncake) exchange: what a reader can check without the owner."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvstore.transfer import Descriptor, LeaseExpired, MemoryRegion, OutOfBounds, UnknownRegion
from kvstore.transfer.directory import OwnerDirectory, PeerDirectory, buffer_address


def test_snapshot_round_trip_resolves_addresses_and_checks_leases():
    arr = np.zeros(4096, np.uint8)
    owner = OwnerDirectory()
    remote = owner.add(MemoryRegion.from_buffer("pool", arr))
    assert remote.base_addr == arr.ctypes.data and remote.length == 4096
    lease = owner.grant("pool", [(0, 1024)], ttl_s=30.0)
    peer = PeerDirectory(owner.export(b"backend-metadata"))
    assert peer.backend_metadata == b"backend-metadata"
    assert peer.resolve(Descriptor("x", "pool", 0, 1024, lease), 0).base_addr == arr.ctypes.data
    with pytest.raises(OutOfBounds):
        peer.resolve(Descriptor("x", "pool", 1000, 100, lease), 0)
    with pytest.raises(OutOfBounds):
        peer.resolve(Descriptor("x", "pool", 4000, 100), 0)
    with pytest.raises(UnknownRegion):
        peer.resolve(Descriptor("x", "other", 0, 1), 0)
    with pytest.raises(LeaseExpired):
        peer.resolve(Descriptor("x", "pool", 0, 1, lease + 1), 0)


def test_expired_lease_in_a_snapshot_fails_on_the_reader():
    owner = OwnerDirectory()
    owner.add(MemoryRegion.from_buffer("pool", bytearray(100)))
    lease = owner.grant("pool", [(0, 10)], ttl_s=0.001)
    snapshot = owner.export(b"")
    import time

    time.sleep(0.01)
    with pytest.raises(LeaseExpired):
        PeerDirectory(snapshot).resolve(Descriptor("x", "pool", 0, 10, lease), 0)


def test_buffer_address_is_the_first_byte_and_needs_writable_memory():
    buf = bytearray(b"abc")
    assert ctypes.string_at(buffer_address(MemoryRegion.from_buffer("r", buf)), 3) == b"abc"
    with pytest.raises(ValueError, match="writable"):
        buffer_address(MemoryRegion.from_buffer("r", b"abc"))


def test_per_handle_snapshots_carry_one_lease_and_merge_without_dropping_live_ones():
    """A KV handle carries a snapshot with its own lease only; a reader holding an earlier handle's lease keeps it
    (another thread may be reading under it) until that lease expires."""
    import time

    owner = OwnerDirectory()
    owner.add(MemoryRegion.from_buffer("pool", bytearray(1000)))
    a = owner.grant("pool", [(0, 10)], ttl_s=30.0)
    short = owner.grant("pool", [(10, 10)], ttl_s=0.001)
    b = owner.grant("pool", [(20, 10)], ttl_s=30.0)
    first = PeerDirectory(owner.export(b"", [a, short]))
    assert set(first.leases) == {a, short}
    time.sleep(0.01)
    merged = PeerDirectory(owner.export(b"", [b])).merged_into(first)
    assert set(merged.leases) == {a, b}          # `short` expired: dropped; `a` kept beside the newer `b`
    merged.resolve(Descriptor("x", "pool", 0, 10, a), 0)
    merged.resolve(Descriptor("x", "pool", 20, 10, b), 0)
