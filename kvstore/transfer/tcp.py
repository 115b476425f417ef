"""`tcp` backend: one-sided reads from any host over plain TCP (DESIGN §7).

The owner runs `TcpServer` (`tcp_server.py`): a thread per connection that checks a batch of reads (region, bounds,
lease) and splices the region's pages into the socket (`page_splice`: no copy on the owner). The reader keeps one
connection per owner, sends a whole batch as one request and receives every payload straight into the caller's
buffers with `recvmsg_into`: one kernel copy in all (a bare socket makes two) and none in user space.

    reader                               owner
    [proof] [id, [[region, off, len, lease], ..]] ->  check the proof and every read (each needs a live lease), then
                                         <-  [id, None] + bytes of read 0, read 1, ... (spliced region pages)
                                         <-  [id, [error, message, index]]     (nothing sent when a check fails)

Deadlines bound every socket wait through the kernel's socket timeouts (`Bounded`: no poll before each call), as
`TransferTimeout`; a refused, reset or closed connection is `PeerUnavailable`
at once. After any failure the connection is dropped, so a late reply can never land in a later read. An owner
closes a connection idle past its `idle_timeout_s` (`tcp_server.py`); before each request the reader checks that
its pooled connection has nothing to read (an idle one never has: readable means closed) and reconnects if so.

Owner options (`TransferConfig.options`): `recv_timeout_s` (default 30; a started request must arrive within it)
and `idle_timeout_s` (default 600; between requests), both in seconds.
An earlier version spoke ZeroMQ: its I/O thread received each frame into a message that `recv_into` then copied
again, which held 4-16 MiB reads at 0.23-0.35x memcpy against a bare socket's 0.50-0.66x (same run).
"""
from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from typing import Any, Sequence

import msgpack

from kvstore.transfer.base import (Deadline, Descriptor, LeaseId, MemoryRegion, ReadResult, RegionHandle,
                                   TransferAgent, TransferConfig, byte_views, register_backend)
from kvstore.transfer.errors import OutOfBounds, PeerUnavailable, TransferError, TransferTimeout, UnknownRegion
from kvstore.transfer.lease import LeaseBook
from kvstore.transfer.tcp_request import MAX_READS_PER_REQUEST, encode_request, secret_key
from kvstore.transfer.tcp_server import (ERRORS, IDLE_TIMEOUT_S, LENGTH, RECV_TIMEOUT_S, Bounded, TcpServer, TlsBounded,
                                         close_socket, recv_header, send_message, tune, wait_readable)
from kvstore.transfer.tcp_tls import client_context, send_tls, server_context, tls_failure

SCHEME = "tcp://"


class _TcpPeer:
    """A reader's connection to one owner; one batch at a time (`lock`)."""

    def __init__(self, address: str, deadline: Deadline, key: bytes = b"", tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the reader's TLS context (`tcp_tls.client_context`); set, the connection shakes hands first."""
        self.address, self.key, self.tls = address, key, tls is not None
        host, _, port = address[len(SCHEME):].rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=max(deadline.remaining(), 0.001))
            tune(self.sock)
            if tls is not None:  # the handshake runs under the connect timeout: the deadline bounds it too
                self.sock = tls.wrap_socket(self.sock, server_hostname=host.strip("[]"))
        except socket.timeout:
            raise TransferTimeout(f"connecting to {address} took past the deadline") from None
        except ssl.SSLError as e:  # the owner's certificate is not the fleet's, or it refused ours
            raise tls_failure(e, f"TLS handshake with the owner at {address} failed") from None
        except (OSError, ValueError) as e:
            raise PeerUnavailable(f"cannot connect to the owner at {address}: {e}") from None
        self.bounded = TlsBounded(self.sock) if tls is not None else Bounded(self.sock)
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.closed = False

    def exchange(self, descs: Sequence[Descriptor], views: list[memoryview], indices: list[int],
                 deadline: Deadline) -> None:
        """One request for the descriptors at `indices`; their bytes land in `views`."""
        request_id = next(self.ids)
        reads = [[descs[i].region_id, descs[i].offset, descs[i].length, descs[i].lease_id] for i in indices]
        try:
            self.bounded.check(deadline.at)
            message = encode_request(request_id, reads, self.key)
            if self.tls:
                send_tls(self.sock, LENGTH.pack(len(message)) + message)
            else:
                send_message(self.sock, message)
            header = recv_header(self.sock, fill=lambda view: self.bounded.recv_all([view], deadline.at))
            reply_id, error = msgpack.unpackb(header)
            if reply_id not in (request_id, None) or (reply_id is None and error is None):
                raise TransferError(f"reply {reply_id} from {self.address} to request {request_id}")
            if error is not None:  # NOTE: an id of None answers a request the owner could not read (no proof...)
                name, message, index = error
                at = indices[index] if isinstance(index, int) and 0 <= index < len(indices) else None
                raise ERRORS.get(name, TransferError)(f"{self.address}: {message}", at)
            self.bounded.recv_all([views[i][:descs[i].length] for i in indices], deadline.at)
        except (socket.timeout, BlockingIOError):  # BlockingIOError: SO_SNDTIMEO ran out mid-request
            raise TransferTimeout(f"deadline passed while reading from {self.address}") from None
        except ssl.SSLError as e:  # TLS 1.3: an owner refuses the reader's certificate after the reader's handshake
            raise tls_failure(e, f"TLS with the owner at {self.address} failed") from None
        except OSError as e:  # refused, reset, closed (ConnectionClosed) mid-reply
            raise PeerUnavailable(f"owner at {self.address}: {e}") from None
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise TransferError(f"malformed reply from {self.address}: {e}") from None

    def went_away(self) -> bool:
        """Whether the owner closed this connection while it idled (`idle_timeout_s`): between exchanges nothing is
        owed to us, so anything readable is an EOF (or a broken owner) and the connection cannot carry a request."""
        return wait_readable(self.sock, 0)

    def close(self) -> None:
        self.closed = True
        close_socket(self.sock)


@register_backend("tcp")
class TcpAgent(TransferAgent):
    """Owner (a server thread per connection over its registered regions) and reader (one connection per owner)."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self._config = config or TransferConfig(backend="tcp")
        self._regions: dict[str, MemoryRegion] = {}
        self._lock = threading.Lock()
        self._leases = LeaseBook()
        self._key = secret_key(self._config.secret)
        self._tls = client_context(self._config)            # None: plain tcp (the zero-copy path)
        self._server = TcpServer(self._config.host, self._config.port, self._regions, self._lock, self._leases,
                                 self._key, server_context(self._config), **_timeouts(self._config))
        host = self._config.host
        if host in ("0.0.0.0", "*", "", "::"):   # a wildcard bind: peers need a name they can reach
            host = self._config.advertise_host or socket.gethostname()
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
            for start in range(0, len(indices), MAX_READS_PER_REQUEST):  # the owner refuses bigger requests
                self._read_from(address, descs, views, indices[start:start + MAX_READS_PER_REQUEST], deadline)
        return ReadResult(len(descs), sum(d.length for d in descs), time.perf_counter() - start)

    def _read_from(self, address: str, descs: Sequence[Descriptor], views: list[memoryview], indices: list[int],
                   deadline: Deadline) -> None:
        while True:
            peer = self._peer(address, deadline)
            with peer.lock:
                if peer.closed:  # another thread's failed read replaced this connection while we waited
                    continue
                if peer.went_away():  # the owner closed it while it idled: a fresh one carries this read
                    self._drop(address)
                    continue
                try:
                    return peer.exchange(descs, views, indices, deadline)
                except BaseException:
                    self._drop(address)  # NOTE: a reply may be half read; a fresh connection never sees it
                    raise

    def _peer(self, address: str, deadline: Deadline) -> _TcpPeer:
        with self._lock:
            peer = self._peers.get(address)
        if peer is None:
            if not address.startswith(SCHEME):
                raise PeerUnavailable(f"{address!r} is not a tcp agent address ({SCHEME}host:port)")
            # NOTE: connect outside the lock: a slow peer stalls no other
            fresh = _TcpPeer(address, deadline, self._key, self._tls)
            with self._lock:
                peer = self._peers.setdefault(address, fresh)
            if peer is not fresh:
                fresh.close()
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
        self._server.stop()
        with self._lock:
            self._regions.clear()


def _timeouts(config: TransferConfig) -> dict[str, float]:
    """The owner's `recv_timeout_s` / `idle_timeout_s` from `config.options` (seconds; defaults where absent)."""
    options, timeouts = dict(config.options), {"recv_timeout_s": RECV_TIMEOUT_S, "idle_timeout_s": IDLE_TIMEOUT_S}
    for name in timeouts:
        if name in options:
            try:
                timeouts[name] = float(options[name])
            except ValueError:
                raise ValueError(f"transfer option {name} must be a number of seconds, got {options[name]!r}") from None
    return timeouts
