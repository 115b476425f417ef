"""The tcp owner's server: plain TCP connections, a thread each, answering batched reads out of registered memory.

Wire format: every message is a 4-byte big-endian length and a msgpack header (no pickle); a reply's payload
follows its header raw.

    request : [request_id, [[region_id, offset, length, lease_id|None], ...]]
    reply   : [request_id, None]                     then every read's bytes, back to back, in request order
    error   : [request_id, [error_name, message, index]]   (index: the read at fault, or None)

Every read of a request is checked (region, bounds, lease) before any byte is sent. The payload goes out with
`sendmsg` over memoryview slices of the region: the kernel copies it straight from the region memory (no copy in
user space on the owner side), and the reader receives it straight into its destination buffers.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Sequence

import msgpack

from kvstore.transfer.base import MemoryRegion
from kvstore.transfer.errors import LeaseExpired, OutOfBounds, TransferError, UnknownRegion
from kvstore.transfer.lease import LeaseBook, check_lease

SOCKET_BUFFER_BYTES = 8 << 20
MAX_HEADER_BYTES = 16 << 20      # a request for ~100k reads; anything larger is a broken peer
LENGTH = struct.Struct("!I")
_ACCEPT_POLL_S = 0.05
_IOV_MAX = 512                   # buffers per sendmsg call (Linux allows 1024)


class ConnectionClosed(OSError):
    """The peer closed the connection (between messages or in the middle of one)."""


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def recv_exactly(sock: socket.socket, view: memoryview, until: float | None = None) -> None:
    """Fill `view` from the socket (ConnectionClosed on EOF). `until`: a `time.monotonic()` deadline, past which
    `socket.timeout` is raised; None waits as long as the socket's own timeout allows."""
    got, n = 0, view.nbytes
    while got < n:
        if until is not None:
            remaining = until - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(remaining)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionClosed("connection closed by the peer")
        got += k


def recv_header(sock: socket.socket, until: float | None = None, *, eof_ok: bool = False) -> bytearray | None:
    """One length-prefixed message body (None at a clean EOF between messages when `eof_ok`)."""
    prefix = bytearray(LENGTH.size)
    try:
        recv_exactly(sock, memoryview(prefix), until)
    except ConnectionClosed:
        if eof_ok:
            return None
        raise
    (length,) = LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise ConnectionClosed(f"message header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    body = bytearray(length)
    recv_exactly(sock, memoryview(body), until)
    return body


def send_message(sock: socket.socket, header: bytes, payload: Sequence[memoryview] = ()) -> None:
    """The length-prefixed header and then the payload buffers, all of them (sendmsg may send part of a call)."""
    views = [memoryview(LENGTH.pack(len(header))), memoryview(header), *(p for p in payload if p.nbytes)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + _IOV_MAX])
        while sent:
            if sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


class TcpServer:
    """Serves `regions` (shared with the agent, guarded by `lock`) until `stop()`."""

    def __init__(self, host: str, port: int, regions: dict[str, MemoryRegion], lock: threading.Lock,
                 leases: LeaseBook) -> None:
        self._regions, self._lock, self._leases = regions, lock, leases
        self._listener = socket.create_server(("" if host == "*" else host, port), backlog=128)
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
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
        try:
            while not self._stop.is_set():
                header = recv_header(conn, eof_ok=True)
                if header is None:
                    return
                reply, payload = self._answer(header)
                send_message(conn, reply, payload)
        except OSError:
            pass  # the reader went away (or stop() closed us): nothing to answer
        finally:
            with self._lock:
                self._connections.discard(conn)
            close_socket(conn)

    def _answer(self, header: bytes) -> tuple[bytes, list[memoryview]]:
        request_id = None
        try:
            request_id, reads = msgpack.unpackb(header)
            payload = [self._slice(i, *read) for i, read in enumerate(reads)]
        except TransferError as e:
            return msgpack.packb([request_id, [type(e).__name__, str(e), e.desc_index]]), []
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            return msgpack.packb([request_id, ["TransferError", f"malformed request: {e}", None]]), []
        return msgpack.packb([request_id, None]), payload

    def _slice(self, index: int, region_id: str, offset: int, length: int, lease_id: int | None) -> memoryview:
        with self._lock:
            region = self._regions.get(region_id)
        if region is None:
            raise UnknownRegion(f"region {region_id!r} is not registered", index)
        if offset < 0 or length < 0 or offset + length > region.length:
            raise OutOfBounds(f"({offset}, {length}) is outside region {region_id!r} of {region.length} bytes", index)
        if lease_id is not None:
            check_lease(self._leases.get(lease_id), lease_id, region_id, offset, length, index)
        # NOTE: the lease is what keeps these bytes unchanged while the kernel copies them out
        return region.buffer[offset:offset + length]


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


ERRORS: dict[str, type[TransferError]] = {
    cls.__name__: cls for cls in (TransferError, UnknownRegion, OutOfBounds, LeaseExpired)
}
