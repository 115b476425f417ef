"""`kvstore.transfer.segment.populate`: the hand-off pool and the host tier fault their shared-memory pages in ahead
of the first writes (MADV_POPULATE_WRITE), without touching what is written there. Counted in minor page faults of
this process (`getrusage`), not timed."""
from __future__ import annotations

import resource
import sys
import threading

import numpy as np
import pytest

from kvstore.config import HostTierConfig
from kvstore.tiers.host_segment import Segment
from kvstore.transfer.segment import SharedSegment, _libc_madvise, fresh_name, populate
from worker_common.config import WorkerConfig
from worker_common.store_setup import store_config

SIZE = 32 << 20          # 8,192 pages of 4 KiB

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def faults_writing(buf: memoryview) -> int:
    """Minor page faults this process takes writing one byte into every 4 KiB page of `buf`."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.frombuffer(buf, dtype=np.uint8)[::4096] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_populated_segment_takes_no_page_fault_per_page_and_keeps_its_bytes():
    cold, warm = SharedSegment.create(SIZE), SharedSegment.create(SIZE)
    try:
        assert faults_writing(cold.buf) >= SIZE // 4096 // 2          # unpopulated: about one fault per page
        warm.buf[:5] = b"kept!"
        assert _libc_madvise() is not None                              # the call that lets go of the GIL
        assert populate(warm._mmap, chunk=4 << 20)
        assert bytes(warm.buf[:5]) == b"kept!"                        # populating writes nothing
        assert faults_writing(warm.buf) < 64
    finally:
        cold.close(unlink=True)
        warm.close(unlink=True)


def test_the_background_populate_of_a_host_tier_segment_finishes_and_a_closed_one_is_refused():
    segment = Segment.create(fresh_name()[1:], 64 << 10, SIZE // (64 << 10))
    try:
        segment.populate_async().join(timeout=120)
        assert faults_writing(segment.buf[segment.shape.total - SIZE:]) < 64
    finally:
        mm = segment._mmap
        segment.close()
    assert populate(mm) is False


def test_workers_populate_their_host_tier_and_the_library_default_does_not():
    assert store_config(WorkerConfig(role="prefill", model="m")).host.populate
    assert not HostTierConfig().populate


def test_a_segment_closed_while_it_is_populated_closes_and_the_populate_ends():
    """The populate thread holds no buffer export: closing the mapping under it works (no BufferError), and the
    thread ends, with True (it finished first) or False (it saw the close), never an error."""
    for _ in range(5):
        segment = SharedSegment.create(SIZE)
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(populate(segment._mmap, chunk=1 << 20)))
        thread.start()
        segment.close(unlink=True)
        thread.join(timeout=60)
        assert not thread.is_alive() and result in ([True], [False])
