"""The tcp transfer backend against a real owner process (spawned) over real loopback TCP connections."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.transfer import (Descriptor, LeaseExpired, LeaseRequired, OutOfBounds, PeerUnavailable,
                              MemoryRegion, RegionHandle, TransferConfig, UnknownRegion, create_agent, pack_views)
from kvstore.transfer.owner_process import OwnerProcess, region_bytes

POOL = 24 << 20
MiB = 1 << 20


class LeasedHandle:
    """A region handle whose descriptors carry a lease over the whole region (a tcp owner serves only leased
    ranges); one given explicitly wins."""

    def __init__(self, handle: RegionHandle, lease: int) -> None:
        self.handle, self.lease = handle, lease
        self.agent, self.region_id, self.length = handle

    def descriptor(self, offset: int, length: int, lease_id: int | None = None) -> Descriptor:
        return self.handle.descriptor(offset, length, self.lease if lease_id is None else lease_id)


def leased(proc: OwnerProcess) -> dict[str, LeasedHandle]:
    return {rid: LeasedHandle(h, proc.grant(rid, [(0, h.length)], ttl_s=3600.0)) for rid, h in proc.handles.items()}


@pytest.fixture(scope="module")
def owner():
    with OwnerProcess("tcp", {"pool": POOL}) as proc:
        proc.leased = leased(proc)
        yield proc


@pytest.fixture
def reader():
    agent = create_agent(TransferConfig(backend="tcp"))
    yield agent
    agent.close()


def make_descs(handle, count: int, max_len: int, seed: int = 0) -> list[Descriptor]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, count)
    return [handle.descriptor(int(rng.integers(0, handle.length - n)), int(n)) for n in lengths]


def test_many_descriptors_round_trip_exact_bytes(owner, reader):
    handle, expected = owner.leased["pool"], region_bytes("pool", POOL)
    descs = make_descs(handle, 300, 64 << 10)  # many small reads packed several to a request
    dsts = [np.zeros(d.length, np.uint8) for d in descs]
    result = reader.read(descs, dsts, deadline_s=20.0)
    assert result.nbytes == sum(d.length for d in descs)
    for d, dst in zip(descs, dsts):
        assert np.array_equal(dst, expected[d.offset:d.offset + d.length])


def test_large_descriptor_arrives_exactly(owner, reader):
    """A 9.5 MiB read arrives in many socket reads (more than the socket buffers hold); every byte in place."""
    handle, expected = owner.leased["pool"], region_bytes("pool", POOL)
    n = 9 * MiB + MiB // 2
    dst = np.zeros(n, np.uint8)
    reader.read([handle.descriptor(123, n)], [dst], deadline_s=20.0)
    assert np.array_equal(dst, expected[123:123 + n])


def test_batched_read_lands_end_to_end_in_one_destination(owner, reader):
    handle, expected = owner.leased["pool"], region_bytes("pool", POOL)
    descs = [handle.descriptor(i * (256 << 10), 256 << 10) for i in range(63, -1, -1)]  # 64 x 256 KiB, reversed
    big = np.zeros(64 * (256 << 10), np.uint8)
    reader.read(descs, pack_views(big, descs), deadline_s=20.0)
    assert np.array_equal(big, np.concatenate([expected[d.offset:d.offset + d.length] for d in descs]))


def test_concurrent_readers_each_get_their_own_bytes(owner):
    handle, expected = owner.leased["pool"], region_bytes("pool", POOL)
    failures = []

    def run(seed: int) -> None:
        with create_agent(TransferConfig(backend="tcp")) as agent:
            descs = make_descs(handle, 40, 512 << 10, seed)
            dsts = [np.zeros(d.length, np.uint8) for d in descs]
            agent.read(descs, dsts, deadline_s=30.0)
            failures.extend(d for d, x in zip(descs, dsts)
                            if not np.array_equal(x, expected[d.offset:d.offset + d.length]))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []


def test_zero_length_descriptor_reads_nothing(owner, reader):
    assert reader.read([owner.leased["pool"].descriptor(5, 0)], [bytearray(0)], deadline_s=5.0).nbytes == 0


def test_unknown_region_is_an_explicit_error_and_the_reader_recovers(owner, reader):
    with pytest.raises(UnknownRegion):
        reader.read([Descriptor(owner.leased["pool"].agent, "nope", 0, 16)], [bytearray(16)], deadline_s=5.0)
    dst = bytearray(16)
    reader.read([owner.leased["pool"].descriptor(0, 16)], [dst], deadline_s=5.0)
    assert bytes(dst) == region_bytes("pool", POOL)[:16].tobytes()


@pytest.mark.parametrize("offset,length", [(POOL - 10, 11), (-1, 4)])
def test_out_of_bounds_descriptor_is_rejected(owner, reader, offset, length):
    with pytest.raises(OutOfBounds):
        reader.read([owner.leased["pool"].descriptor(offset, length)], [bytearray(16)], deadline_s=5.0)


def test_leased_read_succeeds_then_fails_with_lease_expired_after_ttl(owner, reader):
    handle = owner.leased["pool"]
    lease = owner.grant("pool", [(0, 2 * MiB)], ttl_s=0.5)
    reader.read([handle.descriptor(0, 2 * MiB, lease)], [bytearray(2 * MiB)], deadline_s=5.0)
    time.sleep(0.6)
    with pytest.raises(LeaseExpired):
        reader.read([handle.descriptor(0, 4096, lease)], [bytearray(4096)], deadline_s=5.0)


def test_released_lease_fails_with_lease_expired(owner, reader):
    lease = owner.grant("pool", [(0, 4096)], ttl_s=30.0)
    assert owner.release(lease) is True
    with pytest.raises(LeaseExpired):
        reader.read([owner.leased["pool"].descriptor(0, 4096, lease)], [bytearray(4096)], deadline_s=5.0)


def test_range_outside_its_lease_is_out_of_bounds(owner, reader):
    lease = owner.grant("pool", [(0, 4096)], ttl_s=30.0)
    with pytest.raises(OutOfBounds):
        reader.read([owner.leased["pool"].descriptor(0, 4097, lease)], [bytearray(4097)], deadline_s=5.0)


def test_read_without_a_lease_is_refused_with_lease_required(owner, reader):
    """A registered region is not an open one: the owner serves only ranges it has leased."""
    handle = owner.handles["pool"]
    with pytest.raises(LeaseRequired, match="carries no lease") as err:
        reader.read([owner.leased["pool"].descriptor(0, 16), handle.descriptor(0, 16)], [bytearray(16)] * 2,
                    deadline_s=5.0)
    assert err.value.desc_index == 1


def test_nobody_listening_gives_peer_unavailable_before_the_deadline(reader):
    start = time.monotonic()
    with pytest.raises(PeerUnavailable):
        reader.read([Descriptor("tcp://127.0.0.1:1", "x", 0, 1)], [bytearray(1)], deadline_s=5.0)
    assert time.monotonic() - start < 2.0


def test_owner_closing_gives_peer_unavailable(reader):
    owner = OwnerProcess("tcp", {"a": 4096}).start()
    desc = leased(owner)["a"].descriptor(0, 16)
    reader.read([desc], [bytearray(16)], deadline_s=5.0)
    owner.stop()
    with pytest.raises(PeerUnavailable):
        reader.read([desc], [bytearray(16)], deadline_s=5.0)


def test_malformed_request_gets_an_error_reply_and_the_server_keeps_serving(owner, reader):
    import socket

    import msgpack

    from kvstore.transfer.tcp_server import LENGTH, recv_header

    host, port = owner.leased["pool"].agent[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(LENGTH.pack(13) + b"\xc1 not msgpack")
        request_id, error = msgpack.unpackb(recv_header(sock))
        assert error[0] == "MalformedRequest" and "not msgpack" in error[1]
        sock.sendall(LENGTH.pack(1 << 30))  # a header no reader sends: the owner drops this connection only
        assert sock.recv(1) == b""
    dst = bytearray(8)
    reader.read([owner.leased["pool"].descriptor(0, 8)], [dst], deadline_s=5.0)
    assert bytes(dst) == region_bytes("pool", POOL)[:8].tobytes()


def test_an_error_sends_no_byte_of_the_batch(owner, reader):
    """Every read is checked before any payload moves: a bad descriptor last in the batch leaves the earlier
    destinations untouched, and the connection serves the next batch."""
    handle = owner.leased["pool"]
    dsts = [bytearray(b"\xaa" * 16), bytearray(16)]
    with pytest.raises(UnknownRegion) as err:
        reader.read([handle.descriptor(0, 16), Descriptor(handle.agent, "nope", 0, 16)], dsts, deadline_s=5.0)
    assert err.value.desc_index == 1 and dsts[0] == b"\xaa" * 16
    reader.read([handle.descriptor(0, 16)], dsts[:1], deadline_s=5.0)
    assert bytes(dsts[0]) == region_bytes("pool", POOL)[:16].tobytes()


def test_a_garbled_reply_is_a_transfer_error_not_a_crash(reader):
    """An endpoint that answers with a well-framed header that is not a reply: an explicit TransferError."""
    import socket

    from kvstore.transfer import TransferError
    from kvstore.transfer.tcp_server import LENGTH, recv_header

    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = server.accept()
        with conn:
            recv_header(conn)
            conn.sendall(LENGTH.pack(3) + b"\xc1\xc1\xc1")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    with pytest.raises(TransferError, match="malformed reply"):
        reader.read([Descriptor(address, "x", 0, 4)], [bytearray(4)], deadline_s=5.0)
    thread.join(5)
    server.close()


def test_a_wildcard_bind_advertises_the_host_peers_reach_it_at():
    """An agent listening on every interface (a pod binding 0.0.0.0) names the advertised host, not 0.0.0.0 nor a
    machine name other pods cannot resolve."""
    with create_agent(TransferConfig(backend="tcp", host="0.0.0.0", advertise_host="127.0.0.1")) as agent:
        assert agent.address.startswith("tcp://127.0.0.1:")
        region = np.arange(64, dtype=np.uint8)
        agent.register(MemoryRegion("wild", memoryview(region)))
        lease = agent.grant_lease("wild", [(0, 64)], ttl_s=30)
        with create_agent(TransferConfig(backend="tcp")) as reader:
            out = bytearray(64)
            reader.read([Descriptor(agent.address, "wild", 0, 64, lease)], [memoryview(out)], deadline_s=10)
        assert bytes(out) == region.tobytes()
