"""The two policies of the tiered store that are not bookkeeping of blocks: tier health and background writes.

- `TierHealth`: a tier that fails is skipped until its retry time; each further failure doubles the wait (capped);
  one success makes it healthy again.
- `BackgroundWriter`: a bounded queue drained by one thread in batches; `submit` never blocks (a full queue is a
  dropped write the caller counts).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, NamedTuple

log = logging.getLogger(__name__)


class TierHealth:
    """Exponential backoff for one tier. `clock` is injectable so tests control time."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._initial, self._max, self._clock = initial_s, max_s, clock
        self._lock = threading.Lock()
        self.healthy = True
        self.failures = 0
        self.retry_at = 0.0

    def available(self) -> bool:
        """Healthy, or unhealthy but due for a retry."""
        with self._lock:
            return self.healthy or self._clock() >= self.retry_at

    def backoff_s(self) -> float:
        with self._lock:
            return 0.0 if self.healthy else min(self._max, self._initial * 2 ** (self.failures - 1))

    def failed(self) -> None:
        with self._lock:
            self.healthy = False
            self.failures += 1
            self.retry_at = self._clock() + min(self._max, self._initial * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        with self._lock:
            self.healthy, self.failures, self.retry_at = True, 0, 0.0


class WriteTask(NamedTuple):
    """Store `data` under `key` in `tier` ("demote" resolves the tier below `source` when it runs)."""

    kind: str  # "write_through" | "demote"
    tier: str  # the target for write_through; the tier the block left for demote
    key: bytes
    data: bytes


_STOP = object()


class BackgroundWriter:
    """One thread applying `handle(batch)` to up to `max_batch` queued tasks at a time."""

    def __init__(self, depth: int, handle: Callable[[list[WriteTask]], None], max_batch: int = 32) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._handle, self._max_batch = handle, max_batch
        self._thread = threading.Thread(target=self._run, name="strata-store-writer", daemon=True)
        self._thread.start()

    def submit(self, task: WriteTask) -> bool:
        """Queue a task; False (and nothing queued) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(task)
            return True
        except queue.Full:
            return False

    def pending(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued task has been handled; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self._max_batch and batch[-1] is not _STOP:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            tasks = [t for t in batch if t is not _STOP]
            try:
                if tasks:
                    self._handle(tasks)
            except Exception:  # noqa: BLE001 - the writer thread must outlive one bad batch; the handler counts
                log.exception("background store write failed")
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(tasks) != len(batch):
                return
