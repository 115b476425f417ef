"""The tcp owner's server: plain TCP connections, a thread each, answering batched reads out of registered memory.

Wire format: every message is a 4-byte big-endian length and a msgpack header (no pickle); a reply's payload
follows its header raw.

    request : [request_id, [[region_id, offset, length, lease_id], ...]]   (`tcp_request.py`: proof, limits)
    reply   : [request_id, None]                     then every read's bytes, back to back, in request order
    error   : [request_id, [error_name, message, index]]   (index: the read at fault, or None)

Every read of a request is checked (region, bounds, lease) before any byte is sent, and every read must carry a
live lease: the lease is the owner's consent to that range (`LeaseRequired` otherwise). Nothing a peer sends can
crash the server or make it allocate more than what the peer has sent: a malformed or unauthenticated request gets
an error reply, a message past `MAX_REQUEST_BYTES` drops the connection. The payload's pages are spliced
into the socket (`page_splice`: no copy at all on the owner, `sendmsg` where splicing is unavailable), and the reader
receives it straight into its destination buffers. With TLS (`tcp_tls.py`, the fleet's certificates) the same
messages run inside TLS records, the payload encrypted from region memory instead of spliced.

Stalled peers: once a message has started (its length prefix is readable), all of it must arrive within
`recv_timeout_s`, and each send of the reply may wait at most that long for room in a reader that stopped reading;
past either the connection is closed and its slot (one of `MAX_CONNECTIONS`) freed. Between messages a connection
may idle up to `idle_timeout_s`, much longer: a reader keeps one pooled connection per owner between reads, and
checks before each request that the owner has not closed it (`tcp.py`), reconnecting if it has.
"""
from __future__ import annotations

import itertools
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable, Sequence

import ssl

import msgpack

from kvstore.transfer.base import MemoryRegion
from kvstore.transfer.errors import (AccessDenied, LeaseExpired, LeaseRequired, MalformedRequest, OutOfBounds,
                                     TransferError, UnknownRegion)
from kvstore.transfer.lease import LeaseBook, check_lease
from kvstore.transfer.tcp_request import ReadRequest, decode_request, request_id_of
from kvstore.transfer.tcp_tls import handshake, send_tls, wrap_accepted
from kvstore.transfer.page_splice import IOV_MAX, PageSender, address_of, send_views

SOCKET_BUFFER_BYTES = 8 << 20
MAX_HEADER_BYTES = 16 << 20      # a request for ~100k reads; anything larger is a broken peer
MAX_REQUEST_BYTES = 8 << 20      # what the owner accepts: 64k reads (MAX_READS_PER_REQUEST) of <= ~100 bytes each
MAX_CONNECTIONS = 512            # a thread each; past it a new connection is closed at once
_FIRST_CHUNK = 64 << 10          # a message body is received in growing chunks: memory follows what arrived
LENGTH = struct.Struct("!I")
TIMEVAL = struct.Struct("@ll")
_RECV_IOV_BYTES = 2 << 20        # buffers offered to one recvmsg_into: more than a socket buffer holds at once
_ACCEPT_POLL_S = 0.05
RECV_TIMEOUT_S = 30.0            # a started message must arrive within this (a reader sends one in microseconds)
IDLE_TIMEOUT_S = 600.0           # a connection with no message for this long is closed (readers reconnect)

log = logging.getLogger(__name__)


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


class TlsBounded:
    """`Bounded` for a TLS socket: the same `check` / `recv_all` contract on Python's socket timeouts (the kernel's
    SO_RCVTIMEO would surface inside OpenSSL as a WANT_READ error mid-record), one `recv_into` per TLS record."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock

    def check(self, until: float) -> None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("deadline passed")
        self.sock.settimeout(remaining)

    def recv_all(self, views: list[memoryview], until: float) -> None:
        for view in views:
            got, n = 0, view.nbytes
            while got < n:
                self.check(until)
                k = self.sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise ConnectionClosed("connection closed by the peer")
                got += k


def recv_header(sock: socket.socket, *, eof_ok: bool = False, fill: Callable[[memoryview], None] | None = None,
                max_bytes: int = MAX_HEADER_BYTES) -> bytearray | None:
    """One length-prefixed message body (None at a clean EOF between messages when `eof_ok`). `fill(view)` fills a
    view exactly (default: `recv_exactly` on `sock`; a reader passes its deadline-bound `Bounded.recv_all`). A body
    past `max_bytes` closes the connection; one below it is received in chunks that at most double what has
    arrived, so a peer that announces a large body and sends nothing costs `_FIRST_CHUNK`, not the body."""
    fill = fill or (lambda view: recv_exactly(sock, view))
    prefix = bytearray(LENGTH.size)
    try:
        fill(memoryview(prefix))
    except ConnectionClosed:
        if eof_ok:
            return None
        raise
    (length,) = LENGTH.unpack(prefix)
    if length > max_bytes:
        raise ConnectionClosed(f"message header of {length} bytes exceeds {max_bytes}")
    body = bytearray(min(length, _FIRST_CHUNK))
    fill(memoryview(body))
    while len(body) < length:
        chunk = bytearray(min(length - len(body), len(body)))
        fill(memoryview(chunk))
        body += chunk
    return body


def send_message(sock: socket.socket, header: bytes, payload: Sequence[memoryview] = ()) -> None:
    """The length-prefixed header and then the payload buffers, all of them, copied by the kernel."""
    send_views(sock, [memoryview(LENGTH.pack(len(header))), memoryview(header), *payload])


class TcpServer:
    """Serves `regions` (shared with the agent, guarded by `lock`) until `stop()`."""

    def __init__(self, host: str, port: int, regions: dict[str, MemoryRegion], lock: threading.Lock,
                 leases: LeaseBook, key: bytes = b"", tls: ssl.SSLContext | None = None, *,
                 recv_timeout_s: float = RECV_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        """`key`: the fleet secret's bytes; set, every request must carry its proof (`tcp_request.py`). `tls`: the
        owner's TLS context (`tcp_tls.server_context`); set, every connection is TLS and payloads are encrypted
        copies instead of spliced pages. `recv_timeout_s` / `idle_timeout_s`: see the module docstring."""
        for name, value in (("recv_timeout_s", recv_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self._recv_timeout_s, self._idle_timeout_s = recv_timeout_s, idle_timeout_s
        self._regions, self._lock, self._leases, self._key, self._tls = regions, lock, leases, key, tls
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
                if self._tls is not None:
                    conn = wrap_accepted(self._tls, conn)
                with self._lock:
                    full = len(self._connections) >= MAX_CONNECTIONS
                    if not full:
                        self._connections.add(conn)
                if full:
                    log.warning("tcp transfer server on port %d has %d connections: refusing one more",
                                self.port, MAX_CONNECTIONS)
                    close_socket(conn)
                    continue
                threading.Thread(target=self._serve, args=(conn,), name=f"strata-transfer-tcp:{self.port}:conn",
                                 daemon=True).start()
        finally:
            self._listener.close()

    def _serve(self, conn: socket.socket) -> None:
        sender = PageSender()
        bounded = TlsBounded(conn) if self._tls is not None else Bounded(conn)
        try:
            if self._tls is not None:
                handshake(conn)
            while not self._stop.is_set():
                if not wait_readable(conn, self._idle_timeout_s):
                    return  # idle past idle_timeout_s: the slot goes back (a pooled reader reconnects)
                until = time.monotonic() + self._recv_timeout_s
                header = recv_header(conn, eof_ok=True, max_bytes=MAX_REQUEST_BYTES,
                                     fill=lambda view: bounded.recv_all([view], until))
                if header is None:
                    return
                reply, payload, addresses = self._answer(header)
                bounded.check(time.monotonic() + self._recv_timeout_s)  # NOTE: bounds each send call's wait for room
                if self._tls is not None:
                    send_tls(conn, LENGTH.pack(len(reply)) + reply, payload)
                else:
                    sender.send(conn, LENGTH.pack(len(reply)) + reply, payload, addresses)
        except ssl.SSLError as e:  # a plain-text reader, or a certificate the fleet CA did not sign: refused
            log.info("tcp transfer server on port %d refused a TLS connection: %s", self.port, e)
        except (socket.timeout, BlockingIOError):  # BlockingIOError: a send's SO_SNDTIMEO ran out
            log.info("tcp transfer server on port %d closed a stalled connection (past its timeout)", self.port)
        except OSError:
            pass  # the reader went away (or stop() closed us, or sent a message past the limit): nothing to answer
        except Exception:  # noqa: BLE001 - a peer must never take the server down: drop this connection only
            log.exception("tcp transfer server dropped a connection after an unexpected error")
        finally:
            with self._lock:
                self._connections.discard(conn)
            close_socket(conn)
            sender.close()

    def _answer(self, header: bytes) -> tuple[bytes, list[memoryview], list[int]]:
        """The reply header, and the payload's slices of region memory with their addresses."""
        try:
            request = decode_request(header, self._key)
        except TransferError as e:  # MalformedRequest, AccessDenied: answered with the id when it can be read
            return _error_reply(request_id_of(header, self._key), e), [], []
        try:
            payload, addresses = [], []
            for i, read in enumerate(request.reads):
                view, address = self._slice(i, read)
                payload.append(view)
                addresses.append(address)
        except TransferError as e:
            return _error_reply(request.request_id, e), [], []
        return msgpack.packb([request.request_id, None]), payload, addresses

    def _slice(self, index: int, read: ReadRequest) -> tuple[memoryview, int]:
        region_id, offset, length, lease_id = read
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
        if lease_id is None:
            raise LeaseRequired(f"read {index} of region {region_id!r} carries no lease: the owner serves only "
                                "ranges it has leased (grant_lease)", index)
        check_lease(self._leases.get(lease_id), lease_id, region_id, offset, length, index)
        # NOTE: the lease is what keeps these bytes unchanged until the reader has them (see page_splice)
        return region.buffer[offset:offset + length], base[1] + offset


def _error_reply(request_id: int | None, error: TransferError) -> bytes:
    return msgpack.packb([request_id, [type(error).__name__, str(error), error.desc_index]])


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has something to read (bytes, EOF or an error) within `timeout_s`; a TLS socket's decrypted
    bytes already buffered count. Waits in `poll` (no descriptor limit, unlike `select`)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


ERRORS: dict[str, type[TransferError]] = {
    cls.__name__: cls for cls in (TransferError, UnknownRegion, OutOfBounds, LeaseExpired, LeaseRequired,
                                  AccessDenied, MalformedRequest)
}
