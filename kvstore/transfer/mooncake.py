"""`mooncake` backend: Mooncake Transfer Engine (RDMA, TCP, NVLink) behind the `TransferAgent` interface.

Loaded only where `mooncake.engine` imports; importing this module never needs it. Written against Mooncake's
documented Python API (`TransferEngine().initialize(local_hostname, metadata_server, protocol, device_name)`,
`get_rpc_port`, `register_memory(addr, len)`, `unregister_memory(addr)`, `transfer_sync_read(session, local_addr,
remote_addr, len)` and, where present, `batch_transfer_sync_read`). UNTESTED: the `mooncake-transfer-engine` 0.3.13
wheel installs on the CPU machines this project is tested on but does not load there (it links the NVIDIA driver's
`libcuda.so.1`), so this adapter runs only where Mooncake does; the nixl adapter, which shares its metadata path
(directory.py), is tested for real.

Metadata (region addresses, leases) travels out of band as with nixl: `export_metadata()` -> `add_peer`.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Sequence

from kvstore.transfer.base import (Deadline, Descriptor, LeaseId, MemoryRegion, ReadResult, RegionHandle,
                                   TransferAgent, TransferConfig, byte_views, register_backend)
from kvstore.transfer.directory import OwnerDirectory, PeerDirectory, unknown_peer, view_address
from kvstore.transfer.errors import BackendUnavailable, PeerUnavailable, TransferTimeout


@register_backend("mooncake")
class MooncakeAgent(TransferAgent):
    """Options (TransferConfig.options): `metadata_server` (default "P2PHANDSHAKE"), `protocol` ("rdma" or
    "tcp", default "rdma"), `device_name` (RDMA NICs, default auto), `hostname` (default config.host)."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise BackendUnavailable("transfer backend 'mooncake' needs the mooncake-transfer-engine package "
                                     f"(pip install mooncake-transfer-engine): {e}") from e
        config = config or TransferConfig(backend="mooncake")
        opts = dict(config.options)
        host = opts.get("hostname", config.host)
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, opts.get("metadata_server", "P2PHANDSHAKE"),
                                     opts.get("protocol", "rdma"), opts.get("device_name", ""))
        if rc != 0:
            raise BackendUnavailable(f"Mooncake TransferEngine.initialize failed with code {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._dir = OwnerDirectory()
        self._peers: dict[str, PeerDirectory] = {}
        # NOTE: sync reads cannot be cancelled; a worker thread lets the caller's deadline still hold.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-mooncake")

    @property
    def address(self) -> str:
        return f"mooncake://{self._session}"

    def register(self, region: MemoryRegion) -> RegionHandle:
        remote = self._dir.add(region)
        if self._engine.register_memory(remote.base_addr, remote.length) != 0:
            self._dir.remove(region.region_id)
            raise ValueError(f"Mooncake could not register region {region.region_id!r}")
        return RegionHandle(self.address, region.region_id, region.length)

    def unregister(self, region_id: str) -> None:
        self._engine.unregister_memory(self._dir.remove(region_id).base_addr)

    def grant_lease(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        return self._dir.grant(region_id, ranges, ttl_s)

    def release(self, lease_id: LeaseId) -> bool:
        return self._dir.leases.release(lease_id)

    def export_metadata(self, lease_ids: Sequence[int] | None = None) -> bytes:
        return self._dir.export(self._session.encode(), lease_ids)

    def add_peer(self, address: str, snapshot: bytes) -> None:
        peer, known = PeerDirectory(snapshot), self._peers.get(address)
        self._peers[address] = peer.merged_into(known) if known is not None else peer

    def read(self, descs: Sequence[Descriptor], dst_bufs: Sequence[Any], deadline_s: float) -> ReadResult:
        start, deadline = time.perf_counter(), Deadline(deadline_s)
        views = byte_views(dst_bufs, descs)
        for address in dict.fromkeys(d.agent for d in descs):
            if address not in self._peers:
                raise unknown_peer(address)
            peer = self._peers[address]
            items = [(i, d) for i, d in enumerate(descs) if d.agent == address]
            remote = [peer.resolve(d, i).base_addr + d.offset for i, d in items]
            local = [view_address(views[i]) for i, _ in items]
            lengths = [d.length for _, d in items]
            future = self._pool.submit(self._sync_read, peer.backend_metadata.decode(), local, remote, lengths)
            try:
                rc = future.result(timeout=max(0.0, deadline.remaining()))
            except concurrent.futures.TimeoutError:
                raise TransferTimeout(f"Mooncake read from {address} did not finish before the deadline") from None
            if rc != 0:
                raise PeerUnavailable(f"Mooncake read from {address} failed with code {rc}")
        return ReadResult(len(descs), sum(d.length for d in descs), time.perf_counter() - start)

    def _sync_read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        # RDMA needs the destinations registered too; a read into an already registered pool pays this per batch.
        for buf, n in zip(local, lengths):
            self._engine.register_memory(buf, n)
        try:
            batch = getattr(self._engine, "batch_transfer_sync_read", None)
            if batch is not None:
                return batch(session, local, remote, lengths)
            for buf, peer_addr, n in zip(local, remote, lengths):
                rc = self._engine.transfer_sync_read(session, buf, peer_addr, n)
                if rc != 0:
                    return rc
            return 0
        finally:
            for buf in local:
                self._engine.unregister_memory(buf)

    def close(self) -> None:
        for region_id in list(self._dir.regions):
            self.unregister(region_id)
        self._pool.shutdown(wait=False)

