"""The tcp transfer owner against hostile or broken peers (issue 15 item 6): the fleet secret's proof, bounded and
typed request parsing, and a server that answers or drops, never crashes. Owner and reader are in-process agents
over real loopback sockets (the spawned-owner tests are in test_transfer_tcp.py, the random fuzz in tests/faults)."""
from __future__ import annotations

import socket
import time

import msgpack
import pytest

from kvstore.transfer import (AccessDenied, LeaseRequired, MalformedRequest, MemoryRegion, PeerUnavailable,
                              TransferConfig, TransferError, create_agent)
from kvstore.transfer import tcp_server
from kvstore.transfer.tcp_request import MAX_READS_PER_REQUEST, PROOF_BYTES, decode_request, encode_request
from kvstore.transfer.tcp_server import LENGTH, MAX_REQUEST_BYTES, recv_header

REGION = 1 << 16
SECRET = "fleet-secret"


def make_owner(secret: str = ""):
    agent = create_agent(TransferConfig(backend="tcp", secret=secret))
    region = MemoryRegion.from_buffer("pool", bytearray(bytes(range(256)) * (REGION // 256)))
    handle = agent.register(region)
    lease = agent.grant_lease("pool", [(0, REGION)], ttl_s=60.0)
    return agent, handle, lease


@pytest.fixture
def owner():
    agent, handle, lease = make_owner()
    yield agent, handle, lease
    agent.close()


def port_of(handle) -> int:
    return int(handle.agent.rsplit(":", 1)[1])


def exchange(port: int, body: bytes) -> list:
    """Send one length-prefixed message on a fresh connection; the decoded reply header."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(LENGTH.pack(len(body)) + body)
        return msgpack.unpackb(recv_header(sock))


def assert_serves(agent_or_reader, handle, lease, n: int = 300) -> None:
    dst = bytearray(n)
    agent_or_reader.read([handle.descriptor(7, n, lease)], [dst], deadline_s=5.0)
    assert bytes(dst) == (bytes(range(256)) * 2)[7:7 + n]


# ------------------------------------------------------------------------------------------------ the fleet secret

def test_reader_with_the_fleet_secret_reads_and_one_without_is_refused():
    agent, handle, lease = make_owner(SECRET)
    try:
        with create_agent(TransferConfig(backend="tcp", secret=SECRET)) as member:
            assert_serves(member, handle, lease)
        for secret in ("", "wrong-secret"):
            with create_agent(TransferConfig(backend="tcp", secret=secret)) as stranger:
                with pytest.raises(AccessDenied, match="cluster secret"):
                    assert_serves(stranger, handle, lease)
    finally:
        agent.close()


def test_a_proof_for_another_request_is_refused():
    """The proof covers the whole body: a valid proof glued to another body (a wider range) does not pass."""
    agent, handle, lease = make_owner(SECRET)
    try:
        signed = encode_request(1, [["pool", 0, 16, lease]], SECRET.encode())
        forged = signed[:PROOF_BYTES] + msgpack.packb([1, [["pool", 0, REGION, lease]]])
        request_id, error = exchange(port_of(handle), forged)
        assert (request_id, error[0]) == (1, "AccessDenied")  # (the id is echoed so the reader can match it)
        assert exchange(port_of(handle), signed)[1] is None
    finally:
        agent.close()


def test_the_secret_stays_out_of_the_configs_repr():
    assert SECRET not in repr(TransferConfig(backend="tcp", secret=SECRET))


# ----------------------------------------------------------------------------------------------------- leases

def test_a_read_without_a_lease_is_refused_even_inside_a_registered_region(owner):
    agent, handle, lease = owner
    with create_agent(TransferConfig(backend="tcp")) as reader:
        with pytest.raises(LeaseRequired):
            reader.read([handle.descriptor(0, 16)], [bytearray(16)], deadline_s=5.0)
        assert_serves(reader, handle, lease)


# ------------------------------------------------------------------------------------------------ bad requests

@pytest.mark.parametrize("body,index", [
    (b"", None),                                                             # empty
    (b"\xc1", None),                                                         # not msgpack
    (msgpack.packb([1, [["pool", 0, 16]]]), 0),                              # a read of 3 parts
    (msgpack.packb([1, [["pool", 0, 16, 1, 5]]]), 0),                        # a read of 5 parts
    (msgpack.packb([1, [["pool", -1, 16, 1]]]), 0),                          # negative offset
    (msgpack.packb([1, [["pool", 0, 2 ** 63, 1]]]), 0),                      # length past int64
    (msgpack.packb([1, [["pool", 0.5, 16, 1]]]), 0),                         # float offset
    (msgpack.packb([1, [["pool", True, 16, 1]]]), 0),                        # bool offset
    (msgpack.packb([1, [["p" * 65, 0, 16, 1]]]), 0),                         # region id past 64 bytes
    (msgpack.packb([1, [[b"pool", 0, 16, 1]]]), None),                       # binary region id (no bin allowed)
    (msgpack.packb([1, [["pool", 0, 16, "1"]]]), 0),                         # string lease
    (msgpack.packb([1, {"pool": 1}]), None),                                 # a map
    (msgpack.packb([1, [["pool", 0, 1, 1]] * (MAX_READS_PER_REQUEST + 1)]), None),  # too many reads
    (msgpack.packb([1]), None),                                              # one part
    (msgpack.packb([1, [], 3]), None),                                       # three parts
    (b"\xdd\xff\xff\xff\xff", None),                                         # an array claiming 4 G elements
    (b"\x91" * 5000, None),                                                  # nested past msgpack's depth
])
def test_malformed_requests_get_a_malformed_request_reply_and_the_server_serves_on(owner, body, index):
    agent, handle, lease = owner
    with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as sock:
        sock.sendall(LENGTH.pack(len(body)) + body)
        request_id, error = msgpack.unpackb(recv_header(sock))
        assert error[0] == "MalformedRequest" and error[2] == index
        good = encode_request(2, [["pool", 0, 4, lease]], b"")  # the same connection still serves
        sock.sendall(LENGTH.pack(len(good)) + good)
        assert msgpack.unpackb(recv_header(sock)) == [2, None]
        assert sock.recv(4, socket.MSG_WAITALL) == bytes(range(4))


def test_a_request_id_that_can_be_read_is_echoed_on_a_malformed_request(owner):
    _, handle, _ = owner
    assert exchange(port_of(handle), msgpack.packb([41, [["pool", 0, 16]]]))[0] == 41
    assert exchange(port_of(handle), msgpack.packb(["x", []]))[0] is None


def test_a_message_past_the_size_limit_drops_only_that_connection(owner):
    agent, handle, lease = owner
    with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as sock:
        sock.sendall(LENGTH.pack(MAX_REQUEST_BYTES + 1))
        assert sock.recv(1) == b""
    with create_agent(TransferConfig(backend="tcp")) as reader:
        assert_serves(reader, handle, lease)


def test_an_announced_body_that_never_comes_holds_no_other_reader_up(owner):
    """A peer announces 8 MiB and sends 10 bytes: its connection waits (receiving in chunks, so it holds ~64 KiB),
    and other readers are served meanwhile."""
    agent, handle, lease = owner
    with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as sock:
        sock.sendall(LENGTH.pack(MAX_REQUEST_BYTES) + b"0123456789")
        with create_agent(TransferConfig(backend="tcp")) as reader:
            assert_serves(reader, handle, lease)


def test_connections_past_the_limit_are_closed_and_the_server_serves_on(owner, monkeypatch):
    agent, handle, lease = owner
    monkeypatch.setattr(tcp_server, "MAX_CONNECTIONS", 2)
    with create_agent(TransferConfig(backend="tcp")) as first:
        assert_serves(first, handle, lease)  # one connection
        with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as second:
            second.sendall(LENGTH.pack(1) + b"\xc1")
            recv_header(second)  # served: the second connection is in
            with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as third:
                assert third.recv(1) == b""  # the third is closed at once
        assert_serves(first, handle, lease)


# ------------------------------------------------------------------------------------------------- stalled peers

def make_short_timeout_owner(recv_timeout_s: float = 0.3, idle_timeout_s: float = 600.0):
    agent = create_agent(TransferConfig(backend="tcp", options=(("recv_timeout_s", str(recv_timeout_s)),
                                                                 ("idle_timeout_s", str(idle_timeout_s)))))
    region = MemoryRegion.from_buffer("pool", bytearray(bytes(range(256)) * (REGION // 256)))
    handle = agent.register(region)
    return agent, handle, agent.grant_lease("pool", [(0, REGION)], ttl_s=60.0)


def closed_within(sock: socket.socket, seconds: float) -> float:
    """How long until the owner closed `sock` (fails past `seconds`)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    assert sock.recv(1) == b""
    return time.monotonic() - start


@pytest.mark.parametrize("sent", [LENGTH.pack(64), LENGTH.pack(64)[:2], LENGTH.pack(MAX_REQUEST_BYTES) + b"0123"])
def test_a_message_that_stalls_once_started_is_closed_within_the_receive_timeout(sent):
    """A length prefix (whole or half) and then silence, or an announced 8 MiB that stops after 4 bytes: the owner
    closes the connection once `recv_timeout_s` (0.3 s here) has passed since the message began."""
    agent, handle, lease = make_short_timeout_owner()
    try:
        with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as sock:
            sock.sendall(sent)
            assert 0.2 <= closed_within(sock, 10.0) < 5.0
        assert_serves(agent, handle, lease)
    finally:
        agent.close()


def test_a_connection_idle_between_messages_is_not_held_to_the_receive_timeout():
    """Idle time is not message time: a connection silent for 3x `recv_timeout_s` before its request is served."""
    agent, handle, lease = make_short_timeout_owner()
    try:
        with socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5) as sock:
            time.sleep(1.0)
            body = encode_request(1, [["pool", 0, 4, lease]], b"")
            sock.sendall(LENGTH.pack(len(body)) + body)
            assert msgpack.unpackb(recv_header(sock)) == [1, None]
            assert sock.recv(4, socket.MSG_WAITALL) == bytes(range(4))
    finally:
        agent.close()


def test_a_pooled_reader_reconnects_after_the_owner_closes_its_idle_connection():
    """The owner closes connections idle past `idle_timeout_s`; the reader's next read notices (before sending)
    and carries it on a fresh connection instead of failing."""
    agent, handle, lease = make_short_timeout_owner(idle_timeout_s=0.2)
    try:
        with create_agent(TransferConfig(backend="tcp")) as reader:
            assert_serves(reader, handle, lease)
            time.sleep(0.6)  # the owner has closed the pooled connection by now
            assert_serves(reader, handle, lease)
            assert_serves(reader, handle, lease)
    finally:
        agent.close()


def test_stalled_connections_past_the_slot_limit_free_their_slots_for_a_real_reader():
    """MAX_CONNECTIONS + 8 peers each announce a body and stall: every slot is taken (the extra ones are refused),
    and once the receive timeout has passed they are all closed and a real reader is served."""
    agent, handle, lease = make_short_timeout_owner(recv_timeout_s=1.0)
    stalled = []
    try:
        for _ in range(tcp_server.MAX_CONNECTIONS + 8):
            sock = socket.create_connection(("127.0.0.1", port_of(handle)), timeout=5)
            sock.sendall(LENGTH.pack(64))
            stalled.append(sock)
        deadline = time.monotonic() + 20.0
        with create_agent(TransferConfig(backend="tcp")) as reader:
            while True:  # NOTE: refused while the slots are held; the timeout frees them, no tight timing here
                try:
                    assert_serves(reader, handle, lease)
                    break
                except PeerUnavailable:
                    assert time.monotonic() < deadline, "the stalled connections still hold every slot"
                    time.sleep(0.2)
        for sock in stalled:
            assert closed_within(sock, 10.0) < 10.0
    finally:
        for sock in stalled:
            sock.close()
        agent.close()


def test_a_receive_timeout_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="recv_timeout_s must be > 0"):
        create_agent(TransferConfig(backend="tcp", options=(("recv_timeout_s", "0"),)))
    with pytest.raises(ValueError, match="idle_timeout_s must be a number"):
        create_agent(TransferConfig(backend="tcp", options=(("idle_timeout_s", "soon"),)))


# --------------------------------------------------------------------------------------------------- large batches

def test_a_batch_past_the_per_request_limit_is_split_by_the_reader(owner):
    agent, handle, lease = owner
    n = MAX_READS_PER_REQUEST + 10
    descs = [handle.descriptor(i % 256, 1, lease) for i in range(n)]
    dst = [bytearray(1) for _ in range(n)]
    with create_agent(TransferConfig(backend="tcp")) as reader:
        reader.read(descs, dst, deadline_s=60.0)
    assert all(d[0] == i % 256 for i, d in enumerate(dst))


def test_decode_request_round_trips_and_names_the_bad_read():
    key = SECRET.encode()
    request = decode_request(encode_request(9, [["pool", 1, 2, 3], ["pool", 4, 5, None]], key), key)
    assert request.request_id == 9 and [tuple(r) for r in request.reads] == [("pool", 1, 2, 3), ("pool", 4, 5, None)]
    with pytest.raises(MalformedRequest) as err:
        decode_request(encode_request(9, [["pool", 1, 2, 3], ["pool", -4, 5, None]], b""), b"")
    assert err.value.desc_index == 1
    with pytest.raises(AccessDenied):
        decode_request(b"short", key)
    assert issubclass(MalformedRequest, TransferError)
