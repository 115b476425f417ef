"""The shm transfer backend against a real owner process (spawned), over real POSIX shared memory."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.transfer import (Descriptor, LeaseExpired, OutOfBounds, PeerUnavailable, TransferConfig,
                              UnknownRegion, create_agent, pack_views)
from kvstore.transfer.owner_process import OwnerProcess, region_bytes

POOL, SMALL = 8 << 20, 64 << 10


@pytest.fixture(scope="module")
def owner():
    with OwnerProcess("shm", {"pool": POOL, "small": SMALL}) as proc:
        yield proc


@pytest.fixture
def reader():
    agent = create_agent(TransferConfig(backend="shm"))
    yield agent
    agent.close()


def make_descs(handle, count: int, seed: int = 0) -> list[Descriptor]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 256 << 10, count)
    offsets = [int(rng.integers(0, handle.length - n)) for n in lengths]
    return [handle.descriptor(o, int(n)) for o, n in zip(offsets, lengths)]


def test_many_descriptors_round_trip_exact_bytes(owner, reader):
    handle, expected = owner.handles["pool"], region_bytes("pool", POOL)
    descs = make_descs(handle, 200)
    dsts = [np.zeros(d.length, np.uint8) for d in descs]
    result = reader.read(descs, dsts, deadline_s=10.0)
    assert (result.num_descs, result.nbytes) == (200, sum(d.length for d in descs))
    for d, dst in zip(descs, dsts):
        assert np.array_equal(dst, expected[d.offset:d.offset + d.length])


def test_batched_read_lands_end_to_end_in_one_destination(owner, reader):
    handle, expected = owner.handles["pool"], region_bytes("pool", POOL)
    descs = [handle.descriptor(i * (256 << 10), 256 << 10) for i in range(0, 32, 2)]  # every other 256 KiB block
    big = np.zeros(16 * (256 << 10) + 7, np.uint8)
    reader.read(descs, pack_views(big, descs), deadline_s=10.0)
    want = np.concatenate([expected[d.offset:d.offset + d.length] for d in descs])
    assert np.array_equal(big[:want.size], want) and not big[want.size:].any()


def test_reads_from_two_regions_in_one_batch(owner, reader):
    pool, small = owner.handles["pool"], owner.handles["small"]
    descs = [small.descriptor(0, SMALL), pool.descriptor(POOL - 100, 100)]
    dsts = [bytearray(SMALL), bytearray(100)]
    reader.read(descs, dsts, deadline_s=5.0)
    assert bytes(dsts[0]) == region_bytes("small", SMALL).tobytes()
    assert bytes(dsts[1]) == region_bytes("pool", POOL)[-100:].tobytes()


def test_unknown_region_is_an_explicit_error(owner, reader):
    desc = Descriptor(owner.handles["pool"].agent, "no-such-region", 0, 16)
    with pytest.raises(UnknownRegion):
        reader.read([desc], [bytearray(16)], deadline_s=5.0)


@pytest.mark.parametrize("offset,length", [(POOL - 10, 11), (-1, 4), (POOL, 1)])
def test_out_of_bounds_descriptor_is_rejected_before_any_copy(owner, reader, offset, length):
    handle = owner.handles["pool"]
    dsts = [bytearray(b"\xaa" * 16), bytearray(max(length, 0))]
    with pytest.raises(OutOfBounds) as err:
        reader.read([handle.descriptor(0, 16), handle.descriptor(offset, length)], dsts, deadline_s=5.0)
    assert err.value.desc_index == 1 and dsts[0] == b"\xaa" * 16  # validated first, nothing copied


@pytest.mark.parametrize("offset,length", [(POOL - 10, 11), (-1, 4), (POOL, 1), (0, -1)])
def test_out_of_bounds_single_descriptor_is_rejected(owner, reader, offset, length):
    dst = bytearray(b"\xaa" * 16)
    with pytest.raises(OutOfBounds) as err:
        reader.read([owner.handles["pool"].descriptor(offset, length)], [dst], deadline_s=5.0)
    assert err.value.desc_index == 0 and dst == b"\xaa" * 16


def test_destination_smaller_than_descriptor_is_out_of_bounds(owner, reader):
    with pytest.raises(OutOfBounds):
        reader.read([owner.handles["pool"].descriptor(0, 64)], [bytearray(63)], deadline_s=5.0)


def test_leased_read_succeeds_then_fails_with_lease_expired_after_ttl(owner, reader):
    handle = owner.handles["pool"]
    lease = owner.grant("pool", [(0, 4096), (4096, 4096), (1 << 20, 4096)], ttl_s=0.5)
    descs = [handle.descriptor(0, 8192, lease), handle.descriptor(1 << 20, 4096, lease)]
    reader.read(descs, [bytearray(8192), bytearray(4096)], deadline_s=5.0)  # adjacent ranges merged
    time.sleep(0.6)
    with pytest.raises(LeaseExpired):
        reader.read(descs, [bytearray(8192), bytearray(4096)], deadline_s=5.0)


def test_released_lease_fails_with_lease_expired(owner, reader):
    handle = owner.handles["pool"]
    lease = owner.grant("pool", [(0, 4096)], ttl_s=30.0)
    reader.read([handle.descriptor(0, 4096, lease)], [bytearray(4096)], deadline_s=5.0)
    assert owner.release(lease) is True
    with pytest.raises(LeaseExpired):
        reader.read([handle.descriptor(0, 4096, lease)], [bytearray(4096)], deadline_s=5.0)


def test_range_outside_its_lease_is_out_of_bounds(owner, reader):
    lease = owner.grant("pool", [(0, 4096)], ttl_s=30.0)
    with pytest.raises(OutOfBounds):
        reader.read([owner.handles["pool"].descriptor(4000, 200, lease)], [bytearray(200)], deadline_s=5.0)
    owner.release(lease)


def test_unregistered_region_becomes_unknown_to_a_reader_that_had_mapped_it(reader):
    with OwnerProcess("shm", {"a": 4096, "b": 4096}) as owner:
        desc = owner.handles["a"].descriptor(0, 16)
        reader.read([desc], [bytearray(16)], deadline_s=5.0)
        owner.unregister("a")
        with pytest.raises(UnknownRegion):
            reader.read([desc], [bytearray(16)], deadline_s=5.0)


def test_owner_closing_gives_peer_unavailable(reader):
    owner = OwnerProcess("shm", {"a": 4096}).start()
    desc = owner.handles["a"].descriptor(0, 16)
    reader.read([desc], [bytearray(16)], deadline_s=5.0)
    owner.stop()
    with pytest.raises(PeerUnavailable):
        reader.read([desc], [bytearray(16)], deadline_s=5.0)


def test_address_without_an_agent_gives_peer_unavailable(reader):
    with pytest.raises(PeerUnavailable):
        reader.read([Descriptor("shm://st-0000000000000000", "x", 0, 1)], [bytearray(1)], deadline_s=1.0)
