"""Tier health, the tiered store's policy for failing tiers (background writes: `kvstore/write_behind.py`).

- `TierHealth`: a tier that fails is skipped until its retry time; each further failure doubles the wait (capped);
  one success makes it healthy again.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


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
