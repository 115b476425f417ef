"""Failure behaviour of both transfer backends with real owner processes: killed, stalled, past the deadline.

Every failure must be an explicit TransferError within the read's deadline (plus a small scheduling slack), never a
hang: the decode worker relies on it to fall back to the store or to recompute (DESIGN §2, step 4).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.transfer import (LeaseExpired, MemoryRegion, PeerUnavailable, TransferConfig, TransferError,
                              TransferTimeout, create_agent)
from kvstore.transfer.owner_process import OwnerProcess, region_bytes

SLACK_S = 1.0  # scheduling slack on a loaded 2-core CI machine
BACKENDS = ["shm", "tcp"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def reader_for(backend: str):
    return create_agent(TransferConfig(backend=backend))


def whole_lease(owner: OwnerProcess, region_id: str = "pool") -> int:
    """A long lease over the whole region: a tcp owner serves only leased ranges."""
    return owner.grant(region_id, [(0, owner.sizes[region_id])], ttl_s=600.0)


def test_owner_killed_mid_session_gives_explicit_error_within_deadline(backend):
    with OwnerProcess(backend, {"pool": 4 << 20}) as owner, reader_for(backend) as reader:
        desc = owner.handles["pool"].descriptor(0, 1 << 20, whole_lease(owner))
        reader.read([desc], [bytearray(1 << 20)], deadline_s=5.0)
        owner.kill()
        start = time.monotonic()
        with pytest.raises((PeerUnavailable, TransferTimeout)):
            reader.read([desc], [bytearray(1 << 20)], deadline_s=2.0)
        assert time.monotonic() - start < 2.0 + SLACK_S


def test_owner_killed_during_a_stream_of_reads_never_hangs(backend):
    """A reader thread reads 8 MiB batches back to back; SIGKILL lands mid-stream; the next failing read raises."""
    with OwnerProcess(backend, {"pool": 16 << 20}) as owner, reader_for(backend) as reader:
        desc = owner.handles["pool"].descriptor(0, 8 << 20, whole_lease(owner))
        dst = np.zeros(8 << 20, np.uint8)
        outcome = {}

        def stream() -> None:
            try:
                while True:
                    reader.read([desc], [dst], deadline_s=3.0)
                    outcome["ok"] = outcome.get("ok", 0) + 1
            except TransferError as e:
                outcome["error"], outcome["at"] = e, time.monotonic()

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        wait_until = time.monotonic() + 20.0
        while not outcome and time.monotonic() < wait_until:  # at least one whole read before the kill
            time.sleep(0.01)
        owner.kill()
        killed = time.monotonic()
        thread.join(3.0 + 2 * SLACK_S)
        assert not thread.is_alive(), "read hung after the owner died"
        assert isinstance(outcome["error"], (PeerUnavailable, TransferTimeout))
        assert outcome["at"] - killed < 3.0 + SLACK_S and outcome.get("ok", 0) >= 1


def test_stalled_tcp_owner_gives_transfer_timeout_at_the_deadline():
    with OwnerProcess("tcp", {"pool": 1 << 20}) as owner, reader_for("tcp") as reader:
        desc = owner.handles["pool"].descriptor(0, 4096, whole_lease(owner))
        reader.read([desc], [bytearray(4096)], deadline_s=5.0)
        owner.pause()  # SIGSTOP: the connection stays up, nothing answers
        try:
            start = time.monotonic()
            with pytest.raises(TransferTimeout):
                reader.read([desc], [bytearray(4096)], deadline_s=0.5)
            elapsed = time.monotonic() - start
        finally:
            owner.resume()
        assert 0.45 <= elapsed < 0.5 + SLACK_S
        dst = bytearray(4096)  # the owner is back: a fresh read works again
        reader.read([desc], [dst], deadline_s=15.0)
        assert bytes(dst) == region_bytes("pool", 1 << 20)[:4096].tobytes()


def test_a_short_deadline_does_not_cut_a_later_longer_one_short():
    """The reader's socket keeps the kernel's timeout from an earlier read; a later read with more time waits its
    own deadline out (the owner stalls 0.6 s) instead of failing at the earlier one's 0.1 s."""
    with OwnerProcess("tcp", {"pool": 1 << 20}) as owner, reader_for("tcp") as reader:
        desc = owner.handles["pool"].descriptor(0, 4096, whole_lease(owner))
        for _ in range(3):
            reader.read([desc], [bytearray(4096)], deadline_s=0.1)
        owner.pause()
        timer = threading.Timer(0.6, owner.resume)
        timer.start()
        try:
            dst = bytearray(4096)
            start = time.monotonic()
            reader.read([desc], [dst], deadline_s=10.0)
            assert time.monotonic() - start >= 0.5
        finally:
            timer.join()
        assert bytes(dst) == region_bytes("pool", 1 << 20)[:4096].tobytes()


def test_stalled_shm_owner_does_not_block_one_sided_reads():
    """shm reads never run owner code: a SIGSTOPped (but live) owner still serves its leased bytes."""
    with OwnerProcess("shm", {"pool": 1 << 20}) as owner, reader_for("shm") as reader:
        lease = owner.grant("pool", [(0, 4096)], ttl_s=30.0)
        owner.pause()
        try:
            dst = bytearray(4096)
            reader.read([owner.handles["pool"].descriptor(0, 4096, lease)], [dst], deadline_s=1.0)
        finally:
            owner.resume()
        assert bytes(dst) == region_bytes("pool", 1 << 20)[:4096].tobytes()


def test_deadline_passing_during_a_large_shm_batch_gives_transfer_timeout():
    with OwnerProcess("shm", {"pool": 16 << 20}) as owner, reader_for("shm") as reader:
        descs = [owner.handles["pool"].descriptor(0, 16 << 20)] * 8
        dsts = [np.zeros(16 << 20, np.uint8) for _ in descs]
        with pytest.raises(TransferTimeout):
            reader.read(descs, dsts, deadline_s=0.0005)


def test_deadline_passing_during_a_large_tcp_batch_gives_transfer_timeout():
    with OwnerProcess("tcp", {"pool": 16 << 20}) as owner, reader_for("tcp") as reader:
        descs = [owner.handles["pool"].descriptor(0, 16 << 20, whole_lease(owner))] * 4
        dsts = [np.zeros(16 << 20, np.uint8) for _ in descs]
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            reader.read(descs, dsts, deadline_s=0.005)
        assert time.monotonic() - start < 0.005 + SLACK_S


def test_shm_lease_released_during_the_copy_voids_the_read():
    """Validation passed, then the owner released the lease before the copy finished: the read must fail."""
    with create_agent(TransferConfig(backend="shm")) as owner, create_agent(TransferConfig(backend="shm")) as reader:
        region = MemoryRegion.shared("pool", 1 << 20)
        try:
            handle = owner.register(region)
            lease = owner.grant_lease("pool", [(0, 4096)], ttl_s=30.0)
            _, leases = reader._plan([handle.descriptor(0, 4096, lease)], [bytearray(4096)])
            owner.release(lease)
            with pytest.raises(LeaseExpired):
                reader._recheck_leases(leases)
        finally:
            owner.close()
            region.close()
