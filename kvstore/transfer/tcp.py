"""`tcp` backend: one-sided reads from any host over ZeroMQ (DESIGN §7).

The owner runs `TcpServer` (a ROUTER thread) that answers with zero-copy frames of region memory. The reader keeps
one DEALER socket per owner, splits a batch into requests of at most `chunk_bytes` (so one large read never holds
the line for others and network transfer overlaps the final copy), keeps up to `max_inflight_chunks` requests in
flight, and receives each payload frame straight into the caller's buffer with `recv_into`. Deadlines come from
poll timeouts; a socket monitor turns a dropped or refused connection into `PeerUnavailable` at once instead of
waiting for the deadline.
"""
from __future__ import annotations

import itertools
import socket
import threading
import time
from typing import Any, NamedTuple, Sequence

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstore.transfer.base import (Deadline, Descriptor, LeaseId, MemoryRegion, ReadResult, RegionHandle,
                                   TransferAgent, TransferConfig, byte_views, register_backend)
from kvstore.transfer.errors import OutOfBounds, PeerUnavailable, TransferError, TransferTimeout, UnknownRegion
from kvstore.transfer.lease import LeaseBook
from kvstore.transfer.tcp_server import ERRORS, SOCKET_BUFFER_BYTES, TcpServer

SCHEME = "tcp://"
_HAS_RECV_INTO = hasattr(zmq.Socket, "recv_into")  # pyzmq >= 26.4
WATCH_SLICE_MS = 20  # how often a waiting reader looks at the connection monitor


class _Request(NamedTuple):
    reads: list[list]             # [[region_id, offset, length, lease_id], ...]
    dsts: list[memoryview]        # where each payload frame lands
    indices: list[int]            # the descriptor each read came from (for error messages)


class _TcpPeer:
    """A reader's connection to one owner: a DEALER socket plus a monitor that reports connection state."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.RCVBUF, SOCKET_BUFFER_BYTES), (zmq.SNDBUF, SOCKET_BUFFER_BYTES),
                           (zmq.RCVHWM, 0), (zmq.RECONNECT_IVL, 100)):
            self.sock.setsockopt(opt, value)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED)
        self.sock.connect(address)
        self.ids = itertools.count(1)
        self.connected, self.lost = False, ""
        self.lock = threading.Lock()  # NOTE: ZeroMQ sockets are not thread-safe: one batch per peer at a time
        self.closed = False

    def note_events(self) -> None:
        """Fold pending monitor events into `connected`/`lost`."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected, self.lost = True, ""
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected, self.lost = False, "connection lost"
            elif event == zmq.EVENT_CONNECT_RETRIED and not self.connected:
                self.lost = "connection refused"

    def wait(self, deadline: Deadline) -> None:
        """Block until a reply is ready; PeerUnavailable if the connection drops, TransferTimeout at the deadline.

        Polls the data socket alone (the hot path) in slices of at most WATCH_SLICE_MS and reads the monitor between
        slices, so a dropped connection is noticed within one slice.
        """
        while True:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise TransferTimeout(f"no reply from {self.address} before the deadline")
            if self.sock.poll(min(WATCH_SLICE_MS, int(remaining * 1000) + 1), zmq.POLLIN):
                return
            self.note_events()
            if self.lost:
                raise PeerUnavailable(f"owner at {self.address}: {self.lost}")

    def close(self) -> None:
        self.closed = True
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


@register_backend("tcp")
class TcpAgent(TransferAgent):
    """Owner (a ROUTER server thread over its registered regions) and reader (DEALER sockets to peers)."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self._config = config or TransferConfig(backend="tcp")
        self._ctx = zmq.Context(io_threads=1)
        self._regions: dict[str, MemoryRegion] = {}
        self._lock = threading.Lock()
        self._leases = LeaseBook()
        self._server = TcpServer(self._ctx, self._config.host, self._config.port, self._regions, self._lock,
                                 self._leases)
        host = self._config.host if self._config.host not in ("0.0.0.0", "*", "") else socket.gethostname()
        self._address = f"{SCHEME}{host}:{self._server.port}"
        self._peers: dict[str, _TcpPeer] = {}
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    # ---- owner ------------------------------------------------------------------------------------------------
    def register(self, region: MemoryRegion) -> RegionHandle:
        with self._lock:
            if region.region_id in self._regions:
                raise ValueError(f"region {region.region_id!r} is already registered")
            self._regions[region.region_id] = region
        return RegionHandle(self._address, region.region_id, region.length)

    def unregister(self, region_id: str) -> None:
        with self._lock:
            if self._regions.pop(region_id, None) is None:
                raise UnknownRegion(f"region {region_id!r} is not registered")
        self._leases.drop_region(region_id)

    def grant_lease(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        with self._lock:
            region = self._regions.get(region_id)
        if region is None:
            raise UnknownRegion(f"region {region_id!r} is not registered")
        return self._leases.grant(region_id, region.length, ranges, ttl_s)

    def release(self, lease_id: LeaseId) -> bool:
        return self._leases.release(lease_id)

    # ---- reader -----------------------------------------------------------------------------------------------
    def read(self, descs: Sequence[Descriptor], dst_bufs: Sequence[Any], deadline_s: float) -> ReadResult:
        start, deadline = time.perf_counter(), Deadline(deadline_s)
        views = byte_views(dst_bufs, descs)
        by_peer: dict[str, list[int]] = {}
        for i, desc in enumerate(descs):
            if desc.offset < 0 or desc.length < 0:
                raise OutOfBounds(f"descriptor {i} has a negative offset or length", i)
            by_peer.setdefault(desc.agent, []).append(i)
        for address, indices in by_peer.items():
            self._read_from(address, self._requests(descs, views, indices), deadline)
        return ReadResult(len(descs), sum(d.length for d in descs), time.perf_counter() - start)

    def _read_from(self, address: str, requests: list[_Request], deadline: Deadline) -> None:
        while True:
            peer = self._peer(address)
            with peer.lock:
                if peer.closed:  # another thread's failed read replaced this connection while we waited
                    continue
                try:
                    return self._exchange(peer, requests, deadline)
                except BaseException:
                    self._drop(address)  # NOTE: replies may still be in flight; a fresh socket never sees stale ones
                    raise

    def _requests(self, descs: Sequence[Descriptor], views: list[memoryview], indices: list[int]) -> list[_Request]:
        """Split descriptors into pieces of at most chunk_bytes and pack pieces into requests of at most that many.

            desc 0: |---- chunk ----|---- chunk ----|-- rest --|      desc 1: |-small-|   desc 2: |-small-|
            requests:  [d0 p0]  [d0 p1]  [d0 p2, d1, d2]
        """
        chunk = self._config.chunk_bytes
        requests, current, size = [], _Request([], [], []), 0
        for i in indices:
            desc, view = descs[i], views[i]
            for pos in range(0, desc.length, chunk) if desc.length else (0,):
                n = min(chunk, desc.length - pos)
                if current.reads and size + n > chunk:
                    requests.append(current)
                    current, size = _Request([], [], []), 0
                current.reads.append([desc.region_id, desc.offset + pos, n, desc.lease_id])
                current.dsts.append(view[pos:pos + n])
                current.indices.append(i)
                size += n
        if current.reads:
            requests.append(current)
        return requests

    def _exchange(self, peer: _TcpPeer, requests: list[_Request], deadline: Deadline) -> None:
        """Pipeline the requests (a window of max_inflight_chunks) and land every reply in its buffers."""
        pending: dict[int, _Request] = {}
        queue = iter(requests)
        for request in itertools.islice(queue, self._config.max_inflight_chunks):
            self._send(peer, request, pending)
        while pending:
            if not peer.sock.get(zmq.EVENTS) & zmq.POLLIN:  # a reply already queued needs no poll round
                peer.wait(deadline)
            elif time.monotonic() > deadline.at:
                raise TransferTimeout(f"deadline passed while reading from {peer.address}")
            self._receive(peer, pending)
            request = next(queue, None)
            if request is not None:
                self._send(peer, request, pending)

    @staticmethod
    def _send(peer: _TcpPeer, request: _Request, pending: dict[int, _Request]) -> None:
        request_id = next(peer.ids)
        pending[request_id] = request
        peer.sock.send(msgpack.packb([request_id, request.reads]), copy=True)

    @staticmethod
    def _receive(peer: _TcpPeer, pending: dict[int, _Request]) -> None:
        request_id, error = msgpack.unpackb(peer.sock.recv())
        request = pending.pop(request_id, None)
        if request is None:
            raise TransferError(f"unexpected reply {request_id} from {peer.address}")
        if error is not None:
            name, message, index = error
            desc_index = request.indices[index] if index is not None else None
            raise ERRORS.get(name, TransferError)(f"{peer.address}: {message}", desc_index)
        for dst, read in zip(request.dsts, request.reads):
            if not peer.sock.get(zmq.RCVMORE):
                raise TransferError(f"reply {request_id} from {peer.address} is missing payload frames")
            _recv_payload(peer.sock, dst, read[2])

    def _peer(self, address: str) -> _TcpPeer:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                if not address.startswith(SCHEME):
                    raise PeerUnavailable(f"{address!r} is not a tcp agent address ({SCHEME}host:port)")
                peer = self._peers[address] = _TcpPeer(self._ctx, address)
        return peer

    def _drop(self, address: str) -> None:
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            peer.close()  # NOTE: callers hold peer.lock, or are closing the agent

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for address in list(self._peers):
            self._drop(address)
        stopped = self._server.stop()
        with self._lock:
            self._regions.clear()
        if stopped:  # NOTE: term() would block on a socket a stuck server thread still holds
            self._ctx.term()


def _recv_payload(sock: zmq.Socket, dst: memoryview, length: int) -> None:
    """One copy from ZeroMQ's message into the caller's buffer."""
    if _HAS_RECV_INTO:
        got = sock.recv_into(dst) if length else sock.recv_into(bytearray())
    else:
        frame = sock.recv(copy=False)
        got = len(frame)
        if got == length:
            dst[:length] = frame.buffer
    if got != length:
        raise TransferError(f"payload of {got} bytes where {length} were expected")
