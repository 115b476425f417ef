"""POSIX shared-memory segments (the memory `shm` regions and lease tables live in).

Written on `_posixshmem` + mmap rather than `multiprocessing.shared_memory` because the latter registers every
attachment with the resource tracker, which unlinks the owner's segment when a *reader* exits (Python < 3.13).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
import secrets
import threading
import weakref
from typing import Callable

import _posixshmem

# NOTE: macOS caps POSIX shm names at 31 bytes: "/st-" + pid (hex, <= 8) + "-" + 12 hex stays under it.
NAME_PREFIX = "/st-"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"st-([0-9a-f]{1,8})-[0-9a-f]{12}")


# Linux's MADV_POPULATE_WRITE (5.14+; Python's mmap module does not name it before 3.13): fault every page of a range
# in, writable, without writing to it, so the first write into a fresh slot does not pay a page fault per 4 KiB.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_POPULATE_CHUNK = 16 << 20


@functools.lru_cache(maxsize=1)
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which lets go of the GIL during the call (`mmap.madvise` holds it: populating
    512 MiB kept every other thread of the process waiting ~0.3 s); None where there is no such libc."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _address(mm: mmap.mmap) -> int:
    """Where `mm` is mapped (the buffer export ends at once, so `mm` can still be closed)."""
    view = (ctypes.c_char * 1).from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def populate(mm: mmap.mmap, chunk: int = _POPULATE_CHUNK) -> bool:
    """Fault in every page of `mm`, a chunk per call, without the GIL where libc's madvise can be called (the
    process's other threads run meanwhile), else through `mmap.madvise` (which holds it). The contents are not
    touched, so it is safe while others write. False where the kernel cannot (not Linux, before 5.14) or once the
    mapping is closed.
    NOTE: a close between the closed check and a chunk's call leaves that call an unmapped range (ENOMEM, the
    end) or, were the range mapped again meanwhile, pages faulted in that nothing reads: no byte changes."""
    if not hasattr(mm, "madvise"):
        return False
    madvise = _libc_madvise()
    try:
        size = len(mm)
        base = _address(mm) if madvise is not None and size else 0
        for start in range(0, size, chunk):
            length = min(chunk, size - start)
            if madvise is None:
                mm.madvise(MADV_POPULATE_WRITE, start, length)
            elif mm.closed:
                return False
            elif madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
    except (OSError, ValueError, TypeError):   # EINVAL: an older kernel; ValueError: closed meanwhile
        return False
    return True


def populate_in_background(mm: mmap.mmap, name: str) -> threading.Thread:
    """`populate` on a daemon thread: the process starts at once, and the pages are in long before most slots are.
    Measured (shm hand-off pool and host tier of 256 MiB each, 125 blocks of a 2,000-token prompt): the prefill
    worker's encode-and-store before the first token went from 21-24 ms to 6-10 ms."""
    thread = threading.Thread(target=populate, args=(mm,), name=f"populate-{name}", daemon=True)
    thread.start()
    return thread


def fresh_name() -> str:
    """A new segment name that records the creating process, so orphans of a killed process can be found."""
    return f"{NAME_PREFIX}{os.getpid():x}-{secrets.token_hex(6)}"


def reap_orphaned_segments() -> list[str]:
    """Unlink segments whose creating process is gone (SIGKILL skips every cleanup); returns their names.

    Opt-in, for a supervisor or a restarted worker: only safe where every process that can create segments in
    this /dev/shm shares our pid namespace (not with `--ipc=host` containers in separate pid namespaces).
    """
    if not os.path.isdir(SHM_DIR):
        return []
    reaped = []
    for entry in os.listdir(SHM_DIR):
        match = _NAME_RE.fullmatch(entry)
        if match is None or _alive(int(match.group(1), 16)):
            continue
        unlink_quietly("/" + entry)
        reaped.append("/" + entry)
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class SharedSegment:
    """A mapped POSIX shared-memory segment. `buf` is a writable byte memoryview over all of it."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self.name, self.size, self.owner = name, size, owner
        self._mmap = mm
        self.buf = memoryview(mm)
        # An owner that exits (or drops the segment) without close() still unlinks its name; only SIGKILL leaks.
        self._unlinker = weakref.finalize(self, unlink_quietly, name) if owner else None

    @classmethod
    def create(cls, size: int, name: str | None = None) -> SharedSegment:
        name = name or fresh_name()
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(name)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        """Map an existing segment; FileNotFoundError if the owner never made it or has unlinked it."""
        fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=False)

    def populate_async(self) -> threading.Thread:
        """Fault every page in on a background thread (`populate`): for memory that will be written slot by slot."""
        return populate_in_background(self._mmap, self.name)

    def close(self, unlink: bool = False) -> None:
        """Unmap (once no view is exported any more; until then the GC unmaps) and optionally unlink the name."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass  # NOTE: a view handed out (numpy, a pending zero-copy send) still uses the pages; the GC unmaps.
        if unlink:
            unlink_quietly(self.name)
            if self._unlinker is not None:
                self._unlinker.detach()


def unlink_quietly(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass
