"""`ShmExchange`: the all-to-all of an expert-parallel group whose ranks share one host, through shared memory.

gloo's collectives go through loopback TCP: ~0.2-0.7 ms each on a loaded 2-core machine, two per sparse layer and
one per step, which is most of an expert-parallel step for a small model. Ranks on one host can instead post their
blocks in one shared segment and read their peers' directly (as vLLM's CPU shared-memory all-reduce and DeepEP's
intra-node buffers do):

    segment:  | control: per rank, `posted` and `done` sequence numbers (own cache lines) |
              | rank 0: buffer A | buffer B | rank 1: buffer A | buffer B | ...                  |

    exchange number s (every rank, same order, same size):
      1. wait until every peer is done with exchange s-2 (it used this rank's buffer s % 2 then)
      2. write the send blocks into own buffer s % 2; posted = s
      3. for each peer j: wait until posted[j] >= s, copy block `rank` of j's buffer s % 2
      4. done = s

A wait spins briefly, then yields, then sleeps in short steps; it checks the peers' processes every ~0.1 s, so a
dead peer is an `EPGroupError` at once, and a hung one after the group's timeout. The segment's name is unlinked as
soon as every rank has mapped it, so a killed rank leaves nothing in /dev/shm.

NOTE: correctness rests on x86's store order (a rank's data copy is visible before its `posted` store); elsewhere
the group keeps gloo. An exchange larger than a buffer also goes through gloo (all ranks decide alike: sizes agree).
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import _posixshmem
import numpy as np
import torch

_CONTROL_BYTES = 128            # per rank: posted at +0, done at +64 (separate cache lines)
_SPIN_S = 50e-6
_YIELD_S = 1e-3
_CHECK_PEERS_S = 0.1


def supported(segment_bytes: int) -> bool:
    """x86 (see the NOTE above) with room for the segment in /dev/shm."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.isdir("/dev/shm"):
        return False
    stat = os.statvfs("/dev/shm")
    return stat.f_bavail * stat.f_frsize >= 2 * segment_bytes


def segment_bytes(world_size: int, capacity: int) -> int:
    return world_size * (_CONTROL_BYTES + 2 * capacity)


def process_alive(pid: int) -> bool:
    """Not gone and not a zombie (a dead child its parent has not reaped still answers kill(pid, 0)).

    NOTE: `kvstore.transfer.segment` has a kill(pid, 0) check of its own; `engine` may not import `kvstore`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class ShmExchangeError(RuntimeError):
    """A peer died or did not post in time."""


class ShmExchange:
    def __init__(self, rank: int, world_size: int, name: str, capacity: int, create: bool,
                 peer_pids: list[int], timeout_s: float) -> None:
        """`capacity`: bytes per buffer (the largest exchange this path takes, all blocks together)."""
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        self.peer_pids, self.timeout_s = peer_pids, timeout_s
        self.name = name
        size = segment_bytes(world_size, capacity)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR if create else os.O_RDWR
        fd = _posixshmem.shm_open(name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        control = np.frombuffer(self._mmap, dtype=np.int64, count=world_size * _CONTROL_BYTES // 8)
        self._posted = control[0::_CONTROL_BYTES // 8]                  # [N] views into the segment
        self._done = control[_CONTROL_BYTES // 16::_CONTROL_BYTES // 8]
        data = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=world_size * _CONTROL_BYTES,
                                count=world_size * 2 * capacity)
        self._buffers = data.view(world_size, 2, capacity)             # [N, 2, capacity]
        self.seq = 0

    @staticmethod
    def fresh_name() -> str:
        return f"/st-ep-{os.getpid():x}-{secrets.token_hex(4)}"

    def unlink(self) -> None:
        """Remove the name (the mappings stay): call once every rank has mapped the segment."""
        try:
            _posixshmem.shm_unlink(self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._posted = self._done = self._buffers = None
        try:
            self._mmap.close()
        except BufferError:         # NOTE: a tensor view still alive; the mapping goes with the process
            pass

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity and nbytes % self.world_size == 0

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """`send [N, ...]` contiguous, `fits(send.nbytes)`: block j to rank j; returns block j from rank j."""
        s = self.seq + 1
        flat = send.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        block = nbytes // self.world_size
        self._wait(self._done, s - 2, "finish reading")
        self._buffers[self.rank, s % 2, :nbytes].copy_(flat)
        self._posted[self.rank] = s
        recv = torch.empty_like(send)
        out = recv.reshape(-1).view(torch.uint8)
        me = self.rank * block
        for j in range(self.world_size):
            self._wait_one(self._posted, j, s, "post")
            out[j * block:(j + 1) * block].copy_(self._buffers[j, s % 2, me:me + block])
        self._done[self.rank] = s
        self.seq = s
        return recv

    def _wait(self, counters: np.ndarray, at_least: int, what: str) -> None:
        for j in range(self.world_size):
            self._wait_one(counters, j, at_least, what)

    def _wait_one(self, counters: np.ndarray, j: int, at_least: int, what: str) -> None:
        if counters[j] >= at_least:
            return
        started = time.monotonic()
        checked = started
        while counters[j] < at_least:
            now = time.monotonic()
            waited = now - started
            if waited < _SPIN_S:
                continue
            time.sleep(0 if waited < _YIELD_S else 20e-6)
            if now - checked > _CHECK_PEERS_S:
                checked = now
                self._check_peer(j, waited, what)

    def _check_peer(self, j: int, waited: float, what: str) -> None:
        pid = self.peer_pids[j]
        if not process_alive(pid):
            raise ShmExchangeError(f"rank {j} (pid {pid}) is gone")
        if waited > self.timeout_s:
            raise ShmExchangeError(f"rank {j} did not {what} exchange {self.seq + 1} within {self.timeout_s} s")
