"""The tcp owner's zero-copy sender over real loopback TCP sockets: exact bytes, spans merged or not, the copy
fallback, and that spliced bytes really are the region's pages (not a copy) until the reader takes them."""
from __future__ import annotations

import os
import socket
import sys
import threading

import numpy as np
import pytest

from kvstore.transfer import page_splice
from kvstore.transfer.page_splice import PIPE_BYTES, SPLICE_MIN_BYTES, PageSender, address_of
from kvstore.transfer.tcp_server import tune

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vmsplice/splice are Linux calls")
MiB = 1 << 20


@pytest.fixture
def pair():
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    server.close()
    for sock in (sender, receiver):
        tune(sock)
    yield sender, receiver
    sender.close()
    receiver.close()


def receive(sock: socket.socket, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    view, got = memoryview(out), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        assert n, "connection closed early"
        got += n
    return bytes(out)


def send_and_receive(sender: PageSender, pair, header: bytes, views: list[memoryview]) -> bytes:
    """Send on a thread while this one receives (a payload larger than the socket buffers would block)."""
    total = len(header) + sum(v.nbytes for v in views)
    addresses = [address_of(v) for v in views]
    errors = []

    def run():
        try:
            sender.send(pair[0], header, views, addresses)
        except BaseException as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    got = receive(pair[1], total)
    thread.join(10)
    assert not errors, errors
    return got


def test_spliced_spans_arrive_exactly(pair):
    data = np.random.default_rng(0).integers(0, 256, 8 * MiB, np.uint8)
    region = memoryview(data)
    # unaligned starts, a span larger than the pipe, two adjacent spans (merged), a zero-length one
    spans = [(3, 5000), (4096 + 1, 3 * PIPE_BYTES + 17), (5 * MiB, 300_000), (5 * MiB + 300_000, 1000), (7 * MiB, 0),
             (123, 64 * 1024)]
    views = [region[off:off + n] for off, n in spans]
    sender = PageSender()
    try:
        assert sender.zero_copy
        got = send_and_receive(sender, pair, b"head", views)
    finally:
        sender.close()
    assert got == b"head" + b"".join(bytes(v) for v in views)


def test_small_payloads_and_hosts_without_vmsplice_are_copied(pair, monkeypatch):
    data = np.arange(4 * MiB, dtype=np.uint8)
    small = [memoryview(data)[10:10 + SPLICE_MIN_BYTES // 2]]
    sender = PageSender()
    try:
        assert send_and_receive(sender, pair, b"h", small) == b"h" + bytes(small[0])
    finally:
        sender.close()
    monkeypatch.setattr(page_splice, "_vmsplice", None)
    sender = PageSender()
    assert not sender.zero_copy
    large = [memoryview(data)[1:1 + 3 * MiB]]
    assert send_and_receive(sender, pair, b"h", large) == b"h" + bytes(large[0])


def test_a_refused_vmsplice_falls_back_to_copying(pair):
    """vmsplice on something that is not a pipe fails: that message and every later one are copied instead."""
    data = np.arange(2 * MiB, dtype=np.uint8)
    sender = PageSender()
    sender.close()
    sender._pipe = (os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY))  # not a pipe
    views = [memoryview(data)[5:5 + MiB]]
    assert send_and_receive(sender, pair, b"x", views) == b"x" + bytes(views[0])
    assert not sender.zero_copy
    assert send_and_receive(sender, pair, b"y", views) == b"y" + bytes(views[0])


def test_spliced_bytes_are_the_pages_themselves_until_received(pair):
    """What makes the owner zero-copy, and why the reader verifies every block: bytes changed after the send but
    before the reader took them arrive changed. A copying send (the fallback) delivers the old bytes."""
    data = np.zeros(MiB, np.uint8)
    view = memoryview(data)
    sender = PageSender()
    try:
        sender.send(pair[0], b"", [view], [address_of(view)])  # fits the socket buffers: returns at once
        data[:] = 7
        assert set(receive(pair[1], MiB)) == {7}
    finally:
        sender.close()
    data[:] = 0
    page_splice.send_views(pair[0], [view])
    data[:] = 7
    assert set(receive(pair[1], MiB)) == {0}
