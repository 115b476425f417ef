"""Region and lease directory for the RDMA adapters (nixl, mooncake), whose reads never reach owner code.

The owner exports a msgpack snapshot (its backend metadata, every region's base address and length, its live
leases with wall-clock expiry); readers import it with `add_peer` and check descriptors against it locally.

NOTE: a lease released early stays valid for readers until they import a newer snapshot: on these backends a lease
is as strong as its expiry. Cross-host expiry compares wall clocks, so keep hosts NTP-synced and TTLs >> skew.
"""
from __future__ import annotations

import ctypes
import time
from typing import NamedTuple, Sequence

import msgpack

from kvstore.transfer.base import Descriptor, LeaseId, MemoryRegion
from kvstore.transfer.errors import OutOfBounds, PeerUnavailable, UnknownRegion
from kvstore.transfer.lease import Lease, LeaseBook, check_lease, now_ns


class RemoteRegion(NamedTuple):
    base_addr: int
    length: int
    device_id: int


def buffer_address(region: MemoryRegion) -> int:
    """The virtual address of a region's first byte (what RDMA engines register)."""
    if region.buffer.readonly:
        raise ValueError(f"region {region.region_id!r} must be writable to be registered for RDMA")
    return view_address(region.buffer)


def view_address(view: memoryview) -> int:
    """The address of a writable, non-empty byte view's first byte."""
    if view.nbytes == 0:
        raise ValueError("an empty buffer has no address to register")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class OwnerDirectory:
    """The owner's regions (with their addresses) and leases."""

    def __init__(self) -> None:
        self.regions: dict[str, tuple[MemoryRegion, RemoteRegion]] = {}
        self.leases = LeaseBook()

    def add(self, region: MemoryRegion, device_id: int = 0) -> RemoteRegion:
        if region.region_id in self.regions:
            raise ValueError(f"region {region.region_id!r} is already registered")
        remote = RemoteRegion(buffer_address(region), region.length, device_id)
        self.regions[region.region_id] = (region, remote)
        return remote

    def remove(self, region_id: str) -> RemoteRegion:
        if region_id not in self.regions:
            raise UnknownRegion(f"region {region_id!r} is not registered")
        self.leases.drop_region(region_id)
        return self.regions.pop(region_id)[1]

    def grant(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        if region_id not in self.regions:
            raise UnknownRegion(f"region {region_id!r} is not registered")
        return self.leases.grant(region_id, self.regions[region_id][1].length, ranges, ttl_s)

    def export(self, backend_metadata: bytes, lease_ids: Sequence[int] | None = None) -> bytes:
        """The snapshot readers import: every region and the live leases (only `lease_ids`, when given: a KV
        handle carries its own lease, not every other request's)."""
        offset = time.time_ns() - now_ns()  # monotonic -> wall clock, for readers on other hosts
        wanted = None if lease_ids is None else set(lease_ids)
        leases = {lid: [lease.region_id, lease.starts, lease.ends, lease.expires_ns + offset]
                  for lid, lease in self.leases.items() if wanted is None or lid in wanted}
        regions = {rid: list(remote) for rid, (_, remote) in self.regions.items()}
        return msgpack.packb({"meta": backend_metadata, "regions": regions, "leases": leases})


class PeerDirectory:
    """A reader's imported snapshot of one owner."""

    def __init__(self, snapshot: bytes) -> None:
        data = msgpack.unpackb(snapshot, strict_map_key=False)
        self.backend_metadata: bytes = data["meta"]
        self.regions = {rid: RemoteRegion(*r) for rid, r in data["regions"].items()}
        offset = now_ns() - time.time_ns()  # wall clock -> this host's monotonic clock
        self.leases = {lid: Lease(r, s, e, exp + offset) for lid, (r, s, e, exp) in data["leases"].items()}

    def merged_into(self, older: PeerDirectory) -> PeerDirectory:
        """This snapshot plus the leases of an older one of the same owner that have not expired (snapshots that
        carry one handle's lease each must not drop the lease another thread is reading under)."""
        now = now_ns()
        self.leases = {**{lid: lease for lid, lease in older.leases.items() if lease.expires_ns > now},
                       **self.leases}
        return self

    def resolve(self, desc: Descriptor, index: int) -> RemoteRegion:
        """The remote region of a descriptor, after bounds and lease checks."""
        region = self.regions.get(desc.region_id)
        if region is None:
            raise UnknownRegion(f"region {desc.region_id!r} is not registered at {desc.agent}", index)
        if desc.offset < 0 or desc.length < 0 or desc.offset + desc.length > region.length:
            raise OutOfBounds(f"({desc.offset}, {desc.length}) is outside region {desc.region_id!r}", index)
        if desc.lease_id is not None:
            check_lease(self.leases.get(desc.lease_id), desc.lease_id, desc.region_id, desc.offset, desc.length,
                        index)
        return region


def unknown_peer(address: str) -> PeerUnavailable:
    return PeerUnavailable(f"no metadata for {address}: import the owner's export_metadata() with add_peer first")

