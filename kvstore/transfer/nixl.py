"""`nixl` backend: NVIDIA NIXL (UCX: RDMA, NVLink, shared memory, TCP) behind the `TransferAgent` interface.

Loaded only where NIXL imports; importing this module never needs it. NIXL ships as the `nixl` meta package (which
picks a build by the CUDA version it finds) or as a build wheel alone: `nixl-cu12` runs on a CPU-only host too, over
UCX's shared-memory and TCP transports, which is how the integration tests and `transfer_bench` exercise it here.

Metadata exchange is out of band: the owner's `export_metadata()` (NIXL's agent metadata + the region and lease
directory) travels with the KV handle (`KvHandle.agent_metadata`) and the reader imports it with `add_peer`. Leases
are checked by the reader against that snapshot (directory.py); NIXL itself never runs owner code per read.

NOTE: progress. Over UCX's non-RDMA transports the owner must answer connection set-up and emulated reads, so each
agent runs NIXL's progress thread. NIXL's Python wrapper starts it with no delay between polls, which spins one core
flat out; `_new_agent` sets the delay (`progress_delay_us`, default 100 us: ~3% of a core while idle). The agent is
made thread-safe (NIXL's STRICT sync mode): a decode worker pulls from several gRPC threads at once.
"""
from __future__ import annotations

import importlib
import os
import threading
import time
import uuid
from typing import Any, Sequence

from kvstore.transfer.base import (Deadline, Descriptor, LeaseId, MemoryRegion, ReadResult, RegionHandle,
                                   TransferAgent, TransferConfig, byte_views, register_backend)
from kvstore.transfer.directory import OwnerDirectory, PeerDirectory, unknown_peer, view_address
from kvstore.transfer.errors import BackendUnavailable, PeerUnavailable, TransferError, TransferTimeout

_SPIN_S = 0.0005      # poll a posted transfer without sleeping this long: most same-host reads finish in it
_POLL_S = 0.0001


def _skip_absent_rdma() -> None:
    """Without an RDMA device, keep UCX from loading its InfiniBand modules (unless UCX_MODULES says otherwise).

    NOTE: where rdma-core is installed but no device exists, nixl-cu12 1.5.1's UCX loads its ib module anyway, and
    the libnl-route it bundles crashes in its library destructor at process exit (SIGSEGV in rtnl_tc_unregister,
    seen with Debian 12's libibverbs1): every process that made a NIXL agent exited with 139. The modules could
    carry no traffic without a device, so leaving them out changes nothing else."""
    if not os.path.isdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")


def _import_nixl() -> Any:
    """NIXL's `_api` module: from the `nixl` meta package, or from a build wheel installed alone."""
    _skip_absent_rdma()
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise BackendUnavailable("transfer backend 'nixl' needs NIXL (pip install nixl, or nixl-cu12 on a CPU-only "
                             f"host): {'; '.join(errors)}")


def nixl_missing() -> bool:
    """True where NIXL cannot be imported (the backend then raises BackendUnavailable)."""
    try:
        _import_nixl()
    except BackendUnavailable:
        return True
    return False


def _new_agent(api: Any, name: str, backends: list[str], progress_delay_us: int) -> Any:
    """A `nixl_agent` whose progress thread waits `progress_delay_us` between polls."""
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, progress_delay_us if key == "pthrDelay" else value)

    # NOTE: the wrapper builds its config from the bindings module's class and hard-codes pthrDelay = 0, so the
    # class is swapped for the one call (agents are made once per worker, never concurrently).
    api.nixlBind.nixlAgentConfig = _Config
    try:
        return api.nixl_agent(name, api.nixl_agent_config(
            enable_prog_thread=True, backends=backends, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
    finally:
        api.nixlBind.nixlAgentConfig = base


@register_backend("nixl")
class NixlAgent(TransferAgent):
    """Options (TransferConfig.options): `backends` (comma-separated NIXL backends, default "UCX"),
    `mem_type` ("DRAM" or "VRAM", default "DRAM"), `name` (agent name, default a fresh uuid),
    `progress_delay_us` (default 100)."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        api = _import_nixl()
        config = config or TransferConfig(backend="nixl")
        opts = dict(config.options)
        self._mem_type = opts.get("mem_type", "DRAM")
        self._name = opts.get("name", f"strata-{uuid.uuid4().hex[:12]}")
        self._agent = _new_agent(api, self._name, opts.get("backends", "UCX").split(","),
                                 int(opts.get("progress_delay_us", 100)))
        self._dir = OwnerDirectory()
        self._reg: dict[str, Any] = {}
        self._metadata: bytes | None = None
        self._peers: dict[str, tuple[str, bytes, PeerDirectory]] = {}   # address -> (NIXL name, metadata, directory)
        self._peers_lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"nixl://{self._name}"

    def register(self, region: MemoryRegion) -> RegionHandle:
        remote = self._dir.add(region)
        descs = self._agent.get_reg_descs([(remote.base_addr, remote.length, remote.device_id, "")], self._mem_type)
        self._reg[region.region_id] = self._agent.register_memory(descs) or descs
        self._metadata = None       # NIXL's metadata lists registered memory
        return RegionHandle(self.address, region.region_id, region.length)

    def unregister(self, region_id: str) -> None:
        self._dir.remove(region_id)
        self._agent.deregister_memory(self._reg.pop(region_id))
        self._metadata = None

    def grant_lease(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        return self._dir.grant(region_id, ranges, ttl_s)

    def release(self, lease_id: LeaseId) -> bool:
        return self._dir.leases.release(lease_id)

    def export_metadata(self, lease_ids: Sequence[int] | None = None) -> bytes:
        """Call after registering (and after granting leases) and hand the bytes to readers' `add_peer`; with
        `lease_ids`, only those leases travel (the rest of what readers hold stays valid until it expires)."""
        if self._metadata is None:
            self._metadata = self._agent.get_agent_metadata()
        return self._dir.export(self._metadata, lease_ids)

    def add_peer(self, address: str, snapshot: bytes) -> None:
        """Import an owner's snapshot; NIXL connects to an owner once, later snapshots add their leases."""
        peer = PeerDirectory(snapshot)
        with self._peers_lock:  # NOTE: check-then-add: two threads must not load one owner twice
            known = self._peers.get(address)
            if known is not None and known[1] == peer.backend_metadata:
                self._peers[address] = (known[0], known[1], peer.merged_into(known[2]))
                return
            try:
                name = self._agent.add_remote_agent(peer.backend_metadata)
            except Exception as e:  # noqa: BLE001 - NIXL's errors are plain Exceptions named nixl*Error
                raise PeerUnavailable(f"NIXL could not load the metadata of {address}: {_describe(e)}") from None
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[address] = (name, peer.backend_metadata, peer)

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
        remote_name, _, peer = self._peers[address]
        remote = [(peer.resolve(d, i).base_addr + d.offset, d.length, peer.regions[d.region_id].device_id)
                  for i, d in items]          # every descriptor checked before any byte moves
        local = [(view_address(views[i]), d.length, 0) for i, d in items]
        handle = local_reg = None
        try:
            local_reg = self._agent.register_memory(self._agent.get_reg_descs([(*x, "") for x in local], "DRAM"))
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                                 self._agent.get_xfer_descs(remote, self._mem_type), remote_name)
            state = self._agent.transfer(handle)
            spin_until = time.monotonic() + _SPIN_S
            while state == "PROC":
                if deadline.remaining() <= 0:
                    raise TransferTimeout(f"NIXL read from {address} did not finish before the deadline")
                if time.monotonic() > spin_until:
                    time.sleep(_POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerUnavailable(f"NIXL read from {address} failed: {state}")
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError once the owner has died
            raise PeerUnavailable(f"NIXL read from {address} failed: {_describe(e)}") from None
        finally:
            if handle is not None:
                _quietly(self._agent.release_xfer_handle, handle)
            if local_reg is not None:
                _quietly(self._agent.deregister_memory, local_reg)

    def close(self) -> None:
        for region_id in list(self._reg):
            self.unregister(region_id)
        for remote_name, _, _ in self._peers.values():
            _quietly(self._agent.remove_remote_agent, remote_name)
        self._peers.clear()


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _quietly(fn: Any, *args: Any) -> None:
    """Clean-up after a failed transfer must not hide the failure (a dead peer's handle may refuse release)."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass
