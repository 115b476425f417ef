"""The transfer-engine interface (DESIGN §7): registered memory regions, one-sided batched reads, deadlines, leases.

A worker *owns* regions (its host pool, its device pool) and registers them with its agent; a peer *reads*
`(agent, region, offset, length)` descriptors straight into its own buffers, like RDMA READ: the owner's code does not
run per read on the one-sided backends (shm, nixl, mooncake), and runs only a tiny server loop on `tcp`.

Every agent is both an owner (register, grant leases) and a reader (read from any peer of the same backend).
Implementations are chosen through `TRANSFER_REGISTRY` by the name users write in config (`transfer: shm`).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, NewType, Sequence

from kvstore.transfer.errors import OutOfBounds
from kvstore.transfer.segment import SharedSegment

LeaseId = NewType("LeaseId", int)

MAX_REGION_ID_BYTES = 64


class Descriptor(NamedTuple):
    """One contiguous byte range of a registered region: what a KV handle carries per block.

    `agent` is the owner's address as its agent reports it (`shm://...`, `tcp://host:port`); `lease_id`, when set,
    must name a live lease that covers the range, or the read fails with `LeaseExpired`/`OutOfBounds`.
    """

    agent: str
    region_id: str
    offset: int
    length: int
    lease_id: int | None = None


class RegionHandle(NamedTuple):
    """What `register` returns: everything a peer needs to build descriptors for the region."""

    agent: str
    region_id: str
    length: int

    def descriptor(self, offset: int, length: int, lease_id: int | None = None) -> Descriptor:
        return Descriptor(self.agent, self.region_id, offset, length, lease_id)


class ReadResult(NamedTuple):
    """A completed batched read: every descriptor was copied in full into its destination buffer."""

    num_descs: int
    nbytes: int
    elapsed_s: float


@dataclass
class MemoryRegion:
    """A span of memory to register: an id unique within its agent, and a contiguous buffer.

    `buffer` is a byte-format memoryview over the memory (a numpy array, a bytearray, an mmap, a shared-memory
    segment...). `shm_name` is set when the memory is a POSIX shared-memory segment that same-host readers can map
    (required by the `shm` backend; `MemoryRegion.shared` makes one). The region does not own foreign memory;
    `close()` unlinks only a segment that `shared` created.
    """

    region_id: str
    buffer: memoryview
    shm_name: str | None = None
    _segment: Any = None

    def __post_init__(self) -> None:
        if not self.region_id or len(self.region_id.encode()) > MAX_REGION_ID_BYTES:
            raise ValueError(f"region_id must be 1..{MAX_REGION_ID_BYTES} UTF-8 bytes, got {self.region_id!r}")

    @property
    def length(self) -> int:
        return self.buffer.nbytes

    @classmethod
    def from_buffer(cls, region_id: str, obj: Any) -> MemoryRegion:
        """Wrap any C-contiguous buffer (numpy array, bytearray, mmap) without copying."""
        view = memoryview(obj)
        if not view.c_contiguous:
            raise ValueError(f"region {region_id!r}: buffer must be C-contiguous")
        return cls(region_id, view.cast("B") if view.format != "B" or view.ndim != 1 else view)

    @classmethod
    def shared(cls, region_id: str, nbytes: int, populate: bool = False) -> MemoryRegion:
        """Create a fresh POSIX shared-memory segment of `nbytes` (zero-filled) owned by this region; `populate`:
        fault its pages in on a background thread (`segment.populate`), for memory written slot by slot."""
        if nbytes <= 0:
            raise ValueError(f"region {region_id!r}: nbytes must be > 0, got {nbytes}")
        seg = SharedSegment.create(nbytes)
        if populate:
            seg.populate_async()
        return cls(region_id, seg.buf, shm_name=seg.name, _segment=seg)

    def close(self) -> None:
        """Unlink the segment this region created (no-op for wrapped memory)."""
        if self._segment is not None:
            self._segment.close(unlink=True)
            self._segment = None


@dataclass(frozen=True)
class TransferConfig:
    """Which backend a worker uses and its limits. `port=0` picks a free port (tcp). `secret`: the fleet's shared
    secret (`WorkerConfig.cluster_secret`; empty = none): set, tcp requests carry an HMAC proof of it and the owner
    refuses those without (`AccessDenied`); readers and owners of one fleet must all be given it.
    `tls_cert_file` / `tls_key_file` / `tls_ca_file`: PEM files (all three or none; the fleet's TLS files): set, the
    tcp backend's connections are TLS both ways, the owner requiring a reader certificate the CA signed
    (`tcp_tls.py`); other backends do not cross the network (shm) or bring their own transport (nixl, mooncake)."""

    backend: str = "shm"
    host: str = "127.0.0.1"
    advertise_host: str = ""  # tcp: the host peers reach a wildcard bind at (default: this machine's name)
    port: int = 0
    max_regions: int = 64
    max_leases: int = 1024
    max_ranges_per_lease: int = 2048  # merged ranges; shm lease table is sparse (untouched slots cost nothing)
    options: tuple[tuple[str, str], ...] = ()  # backend-specific (nixl/mooncake), as (key, value) pairs
    secret: str = field(default="", repr=False)  # NOTE: out of repr, so a logged config does not leak it
    tls_cert_file: str = field(default="", repr=False)
    tls_key_file: str = field(default="", repr=False)
    tls_ca_file: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_REGISTRY:
            raise ValueError(f"transfer backend must be one of {sorted(TRANSFER_REGISTRY)}, got {self.backend!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535 (0 = any free port), got {self.port}")
        for name in ("max_regions", "max_leases", "max_ranges_per_lease"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        tls = [self.tls_cert_file, self.tls_key_file, self.tls_ca_file]
        if any(tls) and not all(tls):
            raise ValueError("tls_cert_file, tls_key_file and tls_ca_file go together: give all three or none")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)


class TransferAgent(ABC):
    """One process's endpoint. Contracts every backend keeps:

    - `register` makes a region readable by peers until `unregister`/`close`; the caller keeps the memory alive and
      unchanged where leased. Registering an id twice raises ValueError.
    - `read` is batched and one-sided: it copies each descriptor's bytes into the matching caller buffer (exactly
      `length` bytes at the buffer's start) and returns only when all are in place. It validates every descriptor
      before copying. On failure it raises a `TransferError` subclass: `UnknownRegion`, `OutOfBounds`,
      `LeaseExpired`, `PeerUnavailable` (owner dead or closed) or `TransferTimeout` (past `deadline_s`, seconds from
      the call). It never blocks past the deadline by more than one descriptor's memcpy (shm) or one poll tick
      (tcp). After a failure the destination bytes are unspecified. One agent may serve reads from several
      threads; reads to the same tcp peer are serialised.
    - A lease (`grant_lease`) pins ranges of one region for `ttl_s`; reads carrying its id fail with `LeaseExpired`
      once it has run out or been released. A read without a lease id fails with `LeaseRequired` where the owner
      serves it (tcp); where the reader maps the memory itself (shm, nixl, mooncake) it is unchecked (the caller
      vouches for it: the owner granted it that memory when it shared it).
    - `close` unregisters everything, stops serving and detaches from peers; later reads from peers of this agent
      fail with `PeerUnavailable`. It is idempotent.
    - Backends whose reads never reach owner code and that cannot look the owner up themselves (nixl, mooncake)
      need its metadata out of band: `export_metadata` on the owner, `add_peer` on the reader before reading.
      Elsewhere the first returns b"" and the second ignores it.
    """

    backend: str = "abstract"

    @property
    @abstractmethod
    def address(self) -> str:
        """Where peers reach this agent; descriptors carry it."""

    @abstractmethod
    def register(self, region: MemoryRegion) -> RegionHandle:
        """Make `region` readable by peers."""

    @abstractmethod
    def unregister(self, region_id: str) -> None:
        """Stop serving a region (its leases end); UnknownRegion if it is not registered."""

    @abstractmethod
    def grant_lease(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        """Pin `(offset, length)` ranges of a registered region for `ttl_s` seconds; returns the lease id."""

    @abstractmethod
    def release(self, lease_id: LeaseId) -> bool:
        """End a lease early; True if it was still live."""

    @abstractmethod
    def read(self, descs: Sequence[Descriptor], dst_bufs: Sequence[Any], deadline_s: float) -> ReadResult:
        """Copy every descriptor's bytes into its destination buffer (see the class contract)."""

    @abstractmethod
    def close(self) -> None:
        """Unregister everything and release sockets, mappings and segments."""

    def export_metadata(self, lease_ids: Sequence[int] | None = None) -> bytes:
        """What a reader must `add_peer` before reading from this agent (only `lease_ids` of its leases, when
        given); b"" when readers find the owner by its address alone."""
        return b""

    def add_peer(self, address: str, snapshot: bytes) -> None:
        """Import an owner's `export_metadata()`; a no-op where readers need none."""

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TRANSFER_REGISTRY: dict[str, Callable[..., TransferAgent]] = {}


def register_backend(name: str):
    """Class decorator: make a backend choosable by `name` in config."""

    def wrap(cls):
        cls.backend = name
        TRANSFER_REGISTRY[name] = cls
        return cls

    return wrap


def create_agent(config: TransferConfig) -> TransferAgent:
    """The agent of the configured backend (optional backends raise BackendUnavailable here, not at import)."""
    return TRANSFER_REGISTRY[config.backend](config)


def byte_views(dst_bufs: Sequence[Any], descs: Sequence[Descriptor]) -> list[memoryview]:
    """Flat byte views of the destination buffers, each checked to hold its descriptor's length."""
    if len(dst_bufs) != len(descs):
        raise ValueError(f"{len(descs)} descriptors but {len(dst_bufs)} destination buffers")
    views = []
    for i, (buf, desc) in enumerate(zip(dst_bufs, descs)):
        fast = type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous
        view = buf if fast else flat_view(buf)
        if view.readonly:
            raise ValueError(f"destination buffer {i} is read-only")
        if view.nbytes < desc.length:
            raise OutOfBounds(f"destination buffer {i} holds {view.nbytes} bytes, descriptor needs {desc.length}", i)
        views.append(view)
    return views


def flat_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("destination buffers must be C-contiguous")
    return view.cast("B")


def pack_views(buf: Any, descs: Sequence[Descriptor]) -> list[memoryview]:
    """Slices of one big destination laid end to end, one per descriptor, for a batched read into one buffer.

    buf: |desc0.length|desc1.length|...|   (unused tail allowed)
    """
    view, out, pos = flat_view(buf), [], 0
    for desc in descs:
        out.append(view[pos:pos + desc.length])
        pos += desc.length
    if pos > view.nbytes:
        raise OutOfBounds(f"destination holds {view.nbytes} bytes, descriptors need {pos}")
    return out


def start_deadline(deadline_s: float) -> float:
    """The monotonic-clock time a read started now must finish by."""
    if deadline_s is None or not deadline_s >= 0:
        raise ValueError(f"deadline_s must be a number of seconds >= 0, got {deadline_s!r}")
    return time.monotonic() + deadline_s


class Deadline:
    """A point in time on the monotonic clock, made from `deadline_s` seconds at the start of a read."""

    __slots__ = ("at",)

    def __init__(self, deadline_s: float) -> None:
        self.at = start_deadline(deadline_s)

    def remaining(self) -> float:
        return self.at - time.monotonic()
