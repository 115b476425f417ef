"""The transfer package's public surface: registry, config validation, optional backends, import hygiene."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvstore.transfer import (TRANSFER_REGISTRY, BackendUnavailable, Descriptor, MemoryRegion, OutOfBounds,
                              TransferConfig, TransferError, create_agent, pack_views)
from kvstore.transfer.errors import LeaseExpired, PeerUnavailable, TransferTimeout, UnknownRegion


def test_every_backend_is_registered_under_its_config_name():
    assert set(TRANSFER_REGISTRY) >= {"shm", "tcp", "nixl", "mooncake"}


def test_importing_the_package_needs_no_optional_rdma_package_nor_torch_nor_engine():
    code = ("import sys, kvstore.transfer; "
            "bad = [m for m in ('nixl', 'nixl_cu12', 'mooncake', 'torch', 'engine') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_optional_backend_without_its_package_raises_backend_unavailable(backend, monkeypatch):
    # None in sys.modules makes an import fail as if the package were absent (NIXL is installed where CI runs).
    packages = {"nixl": ("nixl", "nixl_cu12", "nixl_cu13"), "mooncake": ("mooncake",)}[backend]
    for name in packages:
        for module in (name, f"{name}._api", f"{name}.engine"):
            monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(BackendUnavailable, match=backend):
        create_agent(TransferConfig(backend=backend))


def test_errors_share_one_base_class():
    for cls in (PeerUnavailable, UnknownRegion, LeaseExpired, TransferTimeout, OutOfBounds, BackendUnavailable):
        assert issubclass(cls, TransferError)


@pytest.mark.parametrize("kwargs,field", [({"backend": "rdma"}, "backend"), ({"port": 70000}, "port"),
                                          ({"max_leases": 0}, "max_leases")])
def test_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TransferConfig(**kwargs)


def test_pack_views_lays_descriptors_end_to_end():
    descs = [Descriptor("a", "r", 0, 3), Descriptor("a", "r", 10, 5)]
    buf = np.zeros(10, np.uint8)
    views = pack_views(buf, descs)
    views[1][:] = b"\x01" * 5
    assert [v.nbytes for v in views] == [3, 5] and buf.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(OutOfBounds):
        pack_views(np.zeros(7, np.uint8), descs)


def test_memory_region_wraps_typed_arrays_as_bytes_and_validates_ids():
    region = MemoryRegion.from_buffer("kv", np.zeros((4, 8), np.float16))
    assert region.length == 64 and region.buffer.format == "B"
    with pytest.raises(ValueError, match="region_id"):
        MemoryRegion.from_buffer("", bytearray(1))


def test_shm_backend_refuses_memory_outside_shared_memory():
    with create_agent(TransferConfig(backend="shm")) as agent:
        with pytest.raises(ValueError, match="MemoryRegion.shared"):
            agent.register(MemoryRegion.from_buffer("kv", bytearray(16)))


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_same_agent_can_read_its_own_region_and_rejects_a_bad_deadline(backend):
    with create_agent(TransferConfig(backend=backend)) as agent:
        region = MemoryRegion.shared("r", 4096)
        try:
            region.buffer[:4] = b"abcd"
            handle = agent.register(region)
            lease = agent.grant_lease("r", [(0, 4096)], ttl_s=30.0)  # a tcp owner serves only leased ranges
            dst = bytearray(4)
            agent.read([handle.descriptor(0, 4, lease)], [dst], deadline_s=5.0)
            assert dst == b"abcd"
            with pytest.raises(ValueError, match="deadline_s"):
                agent.read([handle.descriptor(0, 4)], [dst], deadline_s=-1)
            with pytest.raises(ValueError, match="already registered"):
                agent.register(region)
        finally:
            agent.close()
            region.close()
