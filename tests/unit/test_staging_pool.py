"""`StagingPool` hands out the smallest idle buffer that fits, whatever its place among the idle ones (a regression:
removing it by `==` compared tensors elementwise and raised once two or more buffers were idle)."""
from __future__ import annotations

from worker_common.staging import StagingPool


def test_the_smallest_fitting_idle_buffer_is_taken_from_any_position():
    pool = StagingPool(max_free=8)
    held = [pool.acquire(1, n << 20) for n in (10, 5, 8)]
    for staging in held:
        staging.release()
    staging = pool.acquire(1, 6 << 20)   # the 8 MiB buffer: neither first nor last among the idle ones
    assert staging.tensor.shape == (1, 6 << 20)
    staging.release()
