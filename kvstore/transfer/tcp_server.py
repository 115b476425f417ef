"""The tcp owner's server: plain TCP connections, a thread each, answering batched reads out of registered memory.

Wire format: every message is a 4-byte big-endian length and a msgpack header (no pickle); a reply's payload
follows its header raw.

    request : [request_id, [[region_id, offset, length, lease_id|None], ...]]
    reply   : [request_id, None]                     then every read's bytes, back to back, in request order
    error   : [request_id, [error_name, message, index]]   (index: the read at fault, or None)

Every read of a request is checked (region, bounds, lease) before any byte is sent. The payload's pages are spliced
into the socket (`page_splice`: no copy at all on the owner, `sendmsg` where splicing is unavailable), and the reader
receives it straight into its destination buffers.
"""
from __future__ import annotations

import itertools
import socket
import struct
import threading
import time
from typing import Callable, Sequence

import msgpack

from kvstore.transfer.base import MemoryRegion
from kvstore.transfer.errors import LeaseExpired, OutOfBounds, TransferError, UnknownRegion
from kvstore.transfer.lease import LeaseBook, check_lease
from kvstore.transfer.page_splice import IOV_MAX, PageSender, address_of, send_views

SOCKET_BUFFER_BYTES = 8 << 20
MAX_HEADER_BYTES = 16 << 20      # a request for ~100k reads; anything larger is a broken peer
LENGTH = struct.Struct("!I")
TIMEVAL = struct.Struct("@ll")
_RECV_IOV_BYTES = 2 << 20        # buffers offered to one recvmsg_into: more than a socket buffer holds at once
_ACCEPT_POLL_S = 0.05


class ConnectionClosed(OSError):
    """The peer closed the connection (between messages or in the middle of one)."""


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket (ConnectionClosed on EOF)."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionClosed("connection closed by the peer")
        got += k


class Bounded:
    """A socket in blocking mode whose calls the kernel bounds (SO_RCVTIMEO / SO_SNDTIMEO; a call past them fails
    with EAGAIN) instead of Python's timeout mode, which polls before every call. `check(until)` keeps the bound
    within `until`'s remaining time +- 10% (+ 2 ms), so the two setsockopt calls are made only when the deadline
    has moved: back-to-back reads with the same `deadline_s` make none."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self.sock, self._armed_s = sock, -1.0

    def check(self, until: float) -> None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("deadline passed")
        if abs(self._armed_s - remaining) > 0.1 * remaining + 0.002:
            value = TIMEVAL.pack(int(remaining), max(int(remaining % 1 * 1e6), 1))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
            self._armed_s = remaining

    def recv_all(self, views: list[memoryview], until: float) -> None:
        """Fill every view in order, `socket.timeout` past `until` (a call that returns part is followed by a
        `check`, so no wait outlives the deadline by more than its tolerance). One call fills as many views as
        the kernel has bytes for; it is offered at most `_RECV_IOV_BYTES` of them."""
        pending = [v for v in views if v.nbytes]
        first = 0
        while first < len(pending):
            self.check(until)
            try:
                if first == len(pending) - 1:
                    got = self.sock.recv_into(pending[first])
                else:
                    iov, room, last = [], _RECV_IOV_BYTES, min(len(pending), first + IOV_MAX)
                    for view in itertools.islice(pending, first, last):
                        iov.append(view)
                        room -= view.nbytes
                        if room <= 0:
                            break
                    got = self.sock.recvmsg_into(iov)[0]
            except BlockingIOError:  # the kernel's bound ran out: `check` says whether the deadline did
                continue
            if got == 0:
                raise ConnectionClosed("connection closed by the peer")
            while got:
                if got >= pending[first].nbytes:
                    got -= pending[first].nbytes
                    first += 1
                else:
                    pending[first], got = pending[first][got:], 0


def recv_header(sock: socket.socket, *, eof_ok: bool = False,
                fill: Callable[[memoryview], None] | None = None) -> bytearray | None:
    """One length-prefixed message body (None at a clean EOF between messages when `eof_ok`). `fill(view)` fills a
    view exactly (default: `recv_exactly` on `sock`; a reader passes its deadline-bound `Bounded.recv_all`)."""
    fill = fill or (lambda view: recv_exactly(sock, view))
    prefix = bytearray(LENGTH.size)
    try:
        fill(memoryview(prefix))
    except ConnectionClosed:
        if eof_ok:
            return None
        raise
    (length,) = LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise ConnectionClosed(f"message header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    body = bytearray(length)
    fill(memoryview(body))
    return body


def send_message(sock: socket.socket, header: bytes, payload: Sequence[memoryview] = ()) -> None:
    """The length-prefixed header and then the payload buffers, all of them, copied by the kernel."""
    send_views(sock, [memoryview(LENGTH.pack(len(header))), memoryview(header), *payload])


class TcpServer:
    """Serves `regions` (shared with the agent, guarded by `lock`) until `stop()`."""

    def __init__(self, host: str, port: int, regions: dict[str, MemoryRegion], lock: threading.Lock,
                 leases: LeaseBook) -> None:
        self._regions, self._lock, self._leases = regions, lock, leases
        self._listener = socket.create_server(("" if host == "*" else host, port), backlog=128)
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._bases: dict[str, tuple[MemoryRegion, int]] = {}  # region id -> (region, address of its first byte)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"strata-transfer-tcp:{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop serving and drop every connection; whether the accept thread has finished."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            close_socket(conn)  # NOTE: shutdown wakes a handler thread blocked on this socket
        return not self._thread.is_alive()

    def _accept(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                tune(conn)
                with self._lock:
                    self._connections.add(conn)
                threading.Thread(target=self._serve, args=(conn,), name=f"strata-transfer-tcp:{self.port}:conn",
                                 daemon=True).start()
        finally:
            self._listener.close()

    def _serve(self, conn: socket.socket) -> None:
        sender = PageSender()
        try:
            while not self._stop.is_set():
                header = recv_header(conn, eof_ok=True)
                if header is None:
                    return
                reply, payload, addresses = self._answer(header)
                sender.send(conn, LENGTH.pack(len(reply)) + reply, payload, addresses)
        except OSError:
            pass  # the reader went away (or stop() closed us): nothing to answer
        finally:
            with self._lock:
                self._connections.discard(conn)
            close_socket(conn)
            sender.close()

    def _answer(self, header: bytes) -> tuple[bytes, list[memoryview], list[int]]:
        """The reply header, and the payload's slices of region memory with their addresses."""
        request_id = None
        try:
            request_id, reads = msgpack.unpackb(header)
            payload, addresses = [], []
            for i, read in enumerate(reads):
                view, address = self._slice(i, *read)
                payload.append(view)
                addresses.append(address)
        except TransferError as e:
            return msgpack.packb([request_id, [type(e).__name__, str(e), e.desc_index]]), [], []
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            return msgpack.packb([request_id, ["TransferError", f"malformed request: {e}", None]]), [], []
        return msgpack.packb([request_id, None]), payload, addresses

    def _slice(self, index: int, region_id: str, offset: int, length: int,
               lease_id: int | None) -> tuple[memoryview, int]:
        with self._lock:
            region = self._regions.get(region_id)
            base = self._bases.get(region_id)
            if region is None:
                self._bases.pop(region_id, None)  # NOTE: unregistered: let its memory go
            elif base is None or base[0] is not region:
                base = self._bases[region_id] = (region, address_of(region.buffer))
        if region is None:
            raise UnknownRegion(f"region {region_id!r} is not registered", index)
        if offset < 0 or length < 0 or offset + length > region.length:
            raise OutOfBounds(f"({offset}, {length}) is outside region {region_id!r} of {region.length} bytes", index)
        if lease_id is not None:
            check_lease(self._leases.get(lease_id), lease_id, region_id, offset, length, index)
        # NOTE: the lease is what keeps these bytes unchanged until the reader has them (see page_splice)
        return region.buffer[offset:offset + length], base[1] + offset


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


ERRORS: dict[str, type[TransferError]] = {
    cls.__name__: cls for cls in (TransferError, UnknownRegion, OutOfBounds, LeaseExpired)
}
