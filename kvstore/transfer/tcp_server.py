"""The tcp owner's server: a ZeroMQ ROUTER thread that answers batched read requests out of registered memory.

Wire format (msgpack header, raw payload frames, no pickle):

    request : [header]                 header = [request_id, [[region_id, offset, length, lease_id|None], ...]]
    reply   : [header, payload...]     header = [request_id, None]; one payload frame per read, in order
    error   : [header]                 header = [request_id, [error_name, message, index]]

Payload frames are memoryview slices of the region sent with copy=False: ZeroMQ's I/O thread writes them to the
kernel straight from the region memory (zero-copy on the owner side).
"""
from __future__ import annotations

import threading
from typing import Any

import msgpack
import zmq

from kvstore.transfer.base import MemoryRegion
from kvstore.transfer.errors import LeaseExpired, OutOfBounds, TransferError, UnknownRegion
from kvstore.transfer.lease import LeaseBook, check_lease

SOCKET_BUFFER_BYTES = 8 << 20
_POLL_MS = 50


class TcpServer:
    """Serves `regions` (shared with the agent, guarded by `lock`) until `stop()`."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, regions: dict[str, MemoryRegion],
                 lock: threading.Lock, leases: LeaseBook) -> None:
        self._regions, self._lock, self._leases = regions, lock, leases
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
        self._sock.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"strata-transfer-tcp:{port}", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop serving; whether the thread has finished (and closed its socket)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        return not self._thread.is_alive()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):
                    self._drain()
        finally:
            self._sock.close(linger=0)

    def _drain(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._sock.send_multipart(self._answer(frames), copy=False)

    def _answer(self, frames: list[bytes]) -> list[Any]:
        identity, request_id = frames[0], None
        try:
            request_id, reads = msgpack.unpackb(frames[-1])
            payload = [self._slice(i, *read) for i, read in enumerate(reads)]
        except TransferError as e:
            return [identity, msgpack.packb([request_id, [type(e).__name__, str(e), e.desc_index]])]
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            return [identity, msgpack.packb([request_id, ["TransferError", f"malformed request: {e}", None]])]
        return [identity, msgpack.packb([request_id, None]), *payload]

    def _slice(self, index: int, region_id: str, offset: int, length: int, lease_id: int | None) -> memoryview:
        with self._lock:
            region = self._regions.get(region_id)
        if region is None:
            raise UnknownRegion(f"region {region_id!r} is not registered", index)
        if offset < 0 or length < 0 or offset + length > region.length:
            raise OutOfBounds(f"({offset}, {length}) is outside region {region_id!r} of {region.length} bytes", index)
        if lease_id is not None:
            check_lease(self._leases.get(lease_id), lease_id, region_id, offset, length, index)
        # NOTE: the slice is sent later by ZeroMQ's I/O thread; the lease is what keeps those bytes unchanged.
        return region.buffer[offset:offset + length]


ERRORS: dict[str, type[TransferError]] = {
    cls.__name__: cls for cls in (TransferError, UnknownRegion, OutOfBounds, LeaseExpired)
}
