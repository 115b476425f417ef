"""Send region bytes into a socket without copying them on the owner: `vmsplice` the pages into a pipe, `splice` the
pipe into the socket (Linux). The socket's buffers then hold references to the region's pages instead of a copy, so
a same-host read costs one kernel copy (into the reader's buffer) instead of two, and a cross-host read leaves the
owner's CPU out of the data path.

The kernel keeps those page references until the reader has received the bytes, so what it receives is what the
region holds *then*, not at the lease check. That is the `shm` backend's contract too: the lease is what keeps a block
unchanged, and the reader verifies every block (codec checksum, chained hash) before using it, so a block reused
under an expired lease is a checksum mismatch and a recompute, never wrong KV.

`PageSender` falls back to `sendmsg` (one kernel copy on the owner) wherever vmsplice is missing or refused.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket
import sys
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

PIPE_BYTES = 1 << 20             # one vmsplice/splice round; the unprivileged default of /proc/sys/fs/pipe-max-size
SPLICE_MIN_BYTES = 1 << 20        # below this pinning pages costs what the copy saves (transfer_ab: 256 KiB
                                 # reads 0.91-0.94x as fast spliced as copied, 1 MiB 0.99-1.01x, 16 MiB 1.31-1.40x)
_F_SETPIPE_SZ = 1031
_SPLICE_F_MOVE, _SPLICE_F_NONBLOCK, _SPLICE_F_MORE = 1, 2, 4
IOV_MAX = 1024                   # buffers per vmsplice / sendmsg / recvmsg call (Linux)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_vmsplice():
    if not sys.platform.startswith("linux") or not hasattr(os, "splice"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice  # NOTE: CDLL calls release the GIL
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


_vmsplice = _load_vmsplice()


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if view.nbytes else 0


class PageSender:
    """One connection's sender: a private pipe, or `sendmsg` when splicing is unavailable (`zero_copy` False)."""

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None
        if _vmsplice is not None:
            try:
                read_end, write_end = os.pipe2(os.O_CLOEXEC)
            except OSError as e:
                log.info("no pipe for zero-copy sends (%s): copying instead", e)
            else:
                self._pipe = (read_end, write_end)
                try:
                    fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_BYTES)
                except OSError:  # over the user's pipe-buffer allowance: the default size (64 KiB) still works
                    pass

    @property
    def zero_copy(self) -> bool:
        return self._pipe is not None

    def send(self, sock: socket.socket, header: bytes, views: Sequence[memoryview],
             addresses: Sequence[int]) -> None:
        """Send `header` and then every view's bytes in order; `addresses[i]` is where `views[i]` starts
        (`address_of`). Payloads under `SPLICE_MIN_BYTES` are copied: one sendmsg costs less than pinning pages."""
        spans: list[tuple[int, int]] = []
        for view, address in zip(views, addresses):
            if spans and spans[-1][0] + spans[-1][1] == address:  # adjacent in memory: one span
                spans[-1] = (spans[-1][0], spans[-1][1] + view.nbytes)
            elif view.nbytes:
                spans.append((address, view.nbytes))
        if self._pipe is not None and sum(n for _, n in spans) >= SPLICE_MIN_BYTES:
            sock.sendall(header, socket.MSG_MORE)
            try:
                return self._splice(sock, spans)
            except _Refused as e:
                log.warning("vmsplice refused (%s): copying from now on", e)
                self.close()
            return send_views(sock, list(views))
        send_views(sock, [memoryview(header), *views])

    def _splice(self, sock: socket.socket, spans: list[tuple[int, int]]) -> None:
        read_end, write_end = self._pipe
        iov = (_IoVec * len(spans))(*spans)
        first, total, sent_total = 0, sum(n for _, n in spans), 0
        fd, base, step = sock.fileno(), ctypes.addressof(iov), ctypes.sizeof(_IoVec)
        while first < len(spans):
            count = min(len(spans) - first, IOV_MAX)
            moved = _vmsplice(write_end, base + first * step, count, _SPLICE_F_NONBLOCK)
            if moved < 0:
                err = ctypes.get_errno()
                if sent_total == 0:  # nothing of this message left yet: the caller can still copy it
                    raise _Refused(os.strerror(err))
                raise OSError(err, f"vmsplice: {os.strerror(err)}")
            # advance the iovecs past the bytes now in the pipe
            left = moved
            while left:
                entry = iov[first]
                if left >= entry.len:
                    left -= entry.len
                    first += 1
                else:
                    entry.base += left
                    entry.len -= left
                    left = 0
            sent_total += moved
            more = _SPLICE_F_MORE if sent_total < total else 0
            while moved:
                moved -= os.splice(read_end, fd, moved, flags=_SPLICE_F_MOVE | more)

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None


class _Refused(Exception):
    pass


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """`sendmsg` until every view is sent (a call may send part): the kernel copies them."""
    views = [v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + IOV_MAX])
        while sent:
            if sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
