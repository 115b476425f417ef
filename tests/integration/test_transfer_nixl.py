"""The nixl transfer backend against a real owner process: NIXL's own agent over UCX (shared memory / TCP on one
host), metadata exchanged out of band (`export_metadata` -> `add_peer`), leases checked by the reader.

NIXL is optional: these tests run where it imports (`nixl`, or the `nixl-cu12` build wheel, which works on a
CPU-only host). `.ci/run` installs it and sets STRATA_REQUIRE_NIXL=1, so in CI a missing NIXL fails, not skips.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvstore.transfer import (LeaseExpired, OutOfBounds, PeerUnavailable, TransferConfig,
                              TransferTimeout, UnknownRegion, create_agent, pack_views)
from kvstore.transfer.owner_process import OwnerProcess, region_bytes
from tests.conftest import needs_nixl


pytestmark = needs_nixl

POOL = 8 << 20
SLACK_S = 1.0


@pytest.fixture(scope="module")
def owner():
    with OwnerProcess("nixl", {"pool": POOL, "other": 1 << 20}) as proc:
        yield proc


@pytest.fixture
def reader(owner):
    agent = create_agent(TransferConfig(backend="nixl"))
    agent.add_peer(owner.handles["pool"].agent, owner.call("export_metadata"))
    yield agent
    agent.close()


def test_many_descriptors_from_two_regions_round_trip_exact_bytes(owner, reader):
    pool, other = owner.handles["pool"], owner.handles["other"]
    rng = np.random.default_rng(0)
    descs = [pool.descriptor(int(rng.integers(0, POOL - n)), int(n)) for n in rng.integers(1, 64 << 10, 40)]
    descs.append(other.descriptor(5, 1000))
    dsts = [np.zeros(d.length, np.uint8) for d in descs]
    result = reader.read(descs, dsts, deadline_s=10.0)
    assert result.num_descs == 41 and result.nbytes == sum(d.length for d in descs)
    for d, dst in zip(descs, dsts):
        assert np.array_equal(dst, region_bytes(d.region_id, owner.sizes[d.region_id])[d.offset:d.offset + d.length])


def test_batched_read_lands_end_to_end_in_one_destination(owner, reader):
    handle, expected = owner.handles["pool"], region_bytes("pool", POOL)
    descs = [handle.descriptor(i * (256 << 10), 256 << 10) for i in range(15, -1, -1)]   # reversed order
    big = np.zeros(16 * (256 << 10), np.uint8)
    reader.read(descs, pack_views(big, descs), deadline_s=10.0)
    for i, d in enumerate(descs):
        assert np.array_equal(big[i * (256 << 10):(i + 1) * (256 << 10)], expected[d.offset:d.offset + d.length])


def test_concurrent_reads_from_many_threads_are_each_exact(owner, reader):
    """What a decode worker does: pulls from several gRPC threads through one agent at once."""
    handle, expected = owner.handles["pool"], region_bytes("pool", POOL)
    errors = []

    def pull(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            n = int(rng.integers(1, 512 << 10))
            offset = int(rng.integers(0, POOL - n))
            dst = np.zeros(n, np.uint8)
            reader.read([handle.descriptor(offset, n)], [dst], deadline_s=20.0)
            if not np.array_equal(dst, expected[offset:offset + n]):
                errors.append((seed, offset, n))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(pull, range(8)))
    assert errors == []


def test_leased_reads_follow_the_snapshot_and_expire(owner, reader):
    handle, expected = owner.handles["pool"], region_bytes("pool", POOL)
    lease = owner.grant("pool", [(4096, 8192)], ttl_s=0.5)
    reader.add_peer(handle.agent, owner.call("export_metadata"))   # a later snapshot: same peer, new leases
    dst = np.zeros(8192, np.uint8)
    reader.read([handle.descriptor(4096, 8192, lease)], [dst], deadline_s=10.0)
    assert np.array_equal(dst, expected[4096:4096 + 8192])
    with pytest.raises(OutOfBounds, match="not covered"):
        reader.read([handle.descriptor(0, 8192, lease)], [dst], deadline_s=10.0)
    time.sleep(0.6)
    with pytest.raises(LeaseExpired):
        reader.read([handle.descriptor(4096, 8192, lease)], [dst], deadline_s=10.0)


def test_a_bad_descriptor_fails_the_batch_before_any_byte_moves(owner, reader):
    handle = owner.handles["pool"]
    first = np.zeros(4096, np.uint8)
    for bad, error in [(handle.descriptor(POOL - 10, 100), OutOfBounds),
                       (handle._replace(region_id="nope").descriptor(0, 10), UnknownRegion)]:
        with pytest.raises(error) as info:
            reader.read([handle.descriptor(0, 4096), bad], [first, np.zeros(100, np.uint8)], deadline_s=10.0)
        assert info.value.desc_index == 1 and not first.any()


def test_a_peer_without_imported_metadata_is_unavailable(owner):
    with create_agent(TransferConfig(backend="nixl")) as stranger:
        with pytest.raises(PeerUnavailable, match="add_peer"):
            stranger.read([owner.handles["pool"].descriptor(0, 10)], [np.zeros(10, np.uint8)], deadline_s=5.0)


def test_owner_killed_gives_an_explicit_error_within_the_deadline():
    with OwnerProcess("nixl", {"pool": 4 << 20}) as owner, create_agent(TransferConfig(backend="nixl")) as reader:
        desc = owner.handles["pool"].descriptor(0, 1 << 20)
        reader.add_peer(desc.agent, owner.call("export_metadata"))
        reader.read([desc], [np.zeros(1 << 20, np.uint8)], deadline_s=5.0)
        owner.kill()
        start = time.monotonic()
        with pytest.raises((PeerUnavailable, TransferTimeout)):
            reader.read([desc], [np.zeros(1 << 20, np.uint8)], deadline_s=2.0)
        assert time.monotonic() - start < 2.0 + SLACK_S


def test_an_idle_agent_does_not_spin_a_core():
    """NIXL's progress thread polls without pause unless told otherwise; ours waits between polls."""
    with create_agent(TransferConfig(backend="nixl")):
        before = os.times()
        time.sleep(1.0)
        after = os.times()
    assert (after.user + after.system) - (before.user + before.system) < 0.5


def test_a_process_that_used_nixl_exits_cleanly():
    """nixl-cu12's bundled UCX once crashed every such process at exit (SIGSEGV in a library destructor) where
    rdma-core is installed without an RDMA device; `_skip_absent_rdma` keeps those modules out."""
    code = ("from kvstore.transfer import TransferConfig, create_agent\n"
            "with create_agent(TransferConfig(backend='nixl')) as agent:\n"
            "    assert agent.export_metadata()\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
