"""The transfer engine (DESIGN §7): one-sided, batched, deadline-bound reads of registered memory.

    agent = create_agent(TransferConfig(backend="shm"))        # or "tcp"; "nixl"/"mooncake" where installed
    handle = agent.register(MemoryRegion.shared("host-pool", nbytes))
    lease = agent.grant_lease("host-pool", [(offset, length)], ttl_s=30)
    peer.read([handle.descriptor(offset, length, lease)], [dst], deadline_s=1.0)

Importing this package never needs the optional RDMA packages: their adapters import them in their constructors.
"""
from kvstore.transfer import mooncake, nixl, shm, tcp  # noqa: F401  (each registers its backend)
from kvstore.transfer.base import (TRANSFER_REGISTRY, Descriptor, LeaseId, MemoryRegion, ReadResult, RegionHandle,
                                   TransferAgent, TransferConfig, create_agent, pack_views, register_backend)
from kvstore.transfer.errors import (AccessDenied, BackendUnavailable, LeaseExpired, LeaseRequired, MalformedRequest,
                                     OutOfBounds, PeerUnavailable, TransferError, TransferTimeout, UnknownRegion)

__all__ = [
    "TRANSFER_REGISTRY", "AccessDenied", "BackendUnavailable", "LeaseRequired", "MalformedRequest", "Descriptor", "LeaseExpired", "LeaseId", "MemoryRegion",
    "OutOfBounds", "PeerUnavailable", "ReadResult", "RegionHandle", "TransferAgent", "TransferConfig",
    "TransferError", "TransferTimeout", "UnknownRegion", "create_agent", "pack_views", "register_backend",
]
