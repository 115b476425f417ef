"""`nixl` backend: NVIDIA NIXL (UCX: RDMA, NVLink, TCP fallback) behind the `TransferAgent` interface.

Loaded only where `nixl` imports (GPU hosts); importing this module never needs it. Written against NIXL's
documented Python API (`nixl._api.nixl_agent`: get_reg_descs / register_memory / get_agent_metadata /
add_remote_agent / get_xfer_descs / initialize_xfer("READ") / check_xfer_state / release_xfer_handle). It is not
installable on the CPU machines this project is tested on, so it is exercised only where NIXL is present.

Metadata exchange is out of band: the owner's `export_metadata()` travels with the KV handle or the worker registry
and the reader passes it to `add_peer`. Leases are checked by the reader against that snapshot (directory.py).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

from kvstore.transfer.base import (Deadline, Descriptor, LeaseId, MemoryRegion, ReadResult, RegionHandle,
                                   TransferAgent, TransferConfig, byte_views, register_backend)
from kvstore.transfer.directory import OwnerDirectory, PeerDirectory, unknown_peer, view_address
from kvstore.transfer.errors import BackendUnavailable, PeerUnavailable, TransferTimeout

_POLL_S = 0.0002


@register_backend("nixl")
class NixlAgent(TransferAgent):
    """Options (TransferConfig.options): `backends` (comma-separated NIXL backends, default "UCX"),
    `mem_type` ("DRAM" or "VRAM", default "DRAM"), `name` (agent name, default a fresh uuid)."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise BackendUnavailable(f"transfer backend 'nixl' needs the nixl package (pip install nixl): {e}") from e
        config = config or TransferConfig(backend="nixl")
        opts = dict(config.options)
        self._mem_type = opts.get("mem_type", "DRAM")
        self._name = opts.get("name", f"strata-{uuid.uuid4().hex[:12]}")
        backends = opts.get("backends", "UCX").split(",")
        self._agent = nixl_agent(self._name, nixl_agent_config(backends=backends))
        self._dir = OwnerDirectory()
        self._reg: dict[str, Any] = {}
        self._peers: dict[str, tuple[str, PeerDirectory]] = {}

    @property
    def address(self) -> str:
        return f"nixl://{self._name}"

    def register(self, region: MemoryRegion) -> RegionHandle:
        remote = self._dir.add(region)
        descs = self._agent.get_reg_descs([(remote.base_addr, remote.length, remote.device_id, "")], self._mem_type)
        self._reg[region.region_id] = self._agent.register_memory(descs) or descs
        return RegionHandle(self.address, region.region_id, region.length)

    def unregister(self, region_id: str) -> None:
        self._dir.remove(region_id)
        self._agent.deregister_memory(self._reg.pop(region_id))

    def grant_lease(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        return self._dir.grant(region_id, ranges, ttl_s)

    def release(self, lease_id: LeaseId) -> bool:
        return self._dir.leases.release(lease_id)

    def export_metadata(self) -> bytes:
        """Call after registering (and after granting leases) and hand the bytes to readers' `add_peer`."""
        return self._dir.export(self._agent.get_agent_metadata())

    def add_peer(self, address: str, snapshot: bytes) -> None:
        peer = PeerDirectory(snapshot)
        self._peers[address] = (self._agent.add_remote_agent(peer.backend_metadata), peer)

    def read(self, descs: Sequence[Descriptor], dst_bufs: Sequence[Any], deadline_s: float) -> ReadResult:
        start, deadline = time.perf_counter(), Deadline(deadline_s)
        views = byte_views(dst_bufs, descs)
        for address in dict.fromkeys(d.agent for d in descs):
            self._read_from(address, [(i, d) for i, d in enumerate(descs) if d.agent == address], views, deadline)
        return ReadResult(len(descs), sum(d.length for d in descs), time.perf_counter() - start)

    def _read_from(self, address: str, items: list[tuple[int, Descriptor]], views: list[memoryview],
                   deadline: Deadline) -> None:
        if address not in self._peers:
            raise unknown_peer(address)
        remote_name, peer = self._peers[address]
        remote = [(peer.resolve(d, i).base_addr + d.offset, d.length, peer.regions[d.region_id].device_id)
                  for i, d in items]
        local = [(view_address(views[i]), d.length, 0) for i, d in items]
        local_reg = self._agent.get_reg_descs([(a, n, dev, "") for a, n, dev in local], "DRAM")
        self._agent.register_memory(local_reg)
        handle = None
        try:
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                                 self._agent.get_xfer_descs(remote, self._mem_type), remote_name)
            if handle is None:
                raise PeerUnavailable(f"NIXL could not prepare a transfer from {address}")
            state = self._agent.transfer(handle)
            while state == "PROC":
                if deadline.remaining() <= 0:
                    raise TransferTimeout(f"NIXL read from {address} did not finish before the deadline")
                time.sleep(_POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerUnavailable(f"NIXL read from {address} failed: {state}")
        finally:
            if handle is not None:
                self._agent.release_xfer_handle(handle)
            self._agent.deregister_memory(local_reg)

    def close(self) -> None:
        for region_id in list(self._reg):
            self.unregister(region_id)
        for remote_name, _ in self._peers.values():
            self._agent.remove_remote_agent(remote_name)
        self._peers.clear()

