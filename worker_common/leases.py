"""Worker-level KV leases (DESIGN §2 step 3): the blocks of one KvHandle stay pinned until ReleaseKv or the TTL.

A worker lease wraps one transfer-agent lease over the handle's byte ranges (so reads fail explicitly once it
ends) plus the hand-off slots it pins. It ends no earlier than the transfer lease: the slots are unpinned only
after a reader can no longer read them under the lease.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable, NamedTuple, Sequence

from kvstore.transfer import TransferAgent
from worker_common.handoff_pool import REGION_ID, HandoffPool

log = logging.getLogger(__name__)


class Lease(NamedTuple):
    lease_id: str
    transfer_lease_id: int
    slots: list[int]
    expires_at: float           # time.monotonic()
    deadline_unix_ms: int


class LeaseTable:
    def __init__(self, agent: TransferAgent, pool: HandoffPool, sweep_interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._agent, self._pool, self._clock = agent, pool, clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.num_granted = self.num_released = self.num_expired = 0
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_forever, args=(sweep_interval_s,),
                                         name="lease-sweeper", daemon=True)
        self._sweeper.start()

    def grant(self, slots: Sequence[int], ttl_s: float) -> Lease:
        """Lease already-pinned `slots` for `ttl_s` seconds (the lease now owns those pins)."""
        ranges = [self._pool.range_of(s) for s in slots]
        transfer_lease = self._agent.grant_lease(REGION_ID, ranges, ttl_s)
        # NOTE: computed after the agent's grant, so this lease never ends before the transfer lease does.
        expires_at = self._clock() + ttl_s
        lease = Lease(uuid.uuid4().hex, int(transfer_lease), list(slots), expires_at,
                      int((time.time() + ttl_s) * 1000))
        with self._lock:
            self._leases[lease.lease_id] = lease
            self.num_granted += 1
        return lease

    def release(self, lease_id: str) -> bool:
        """End a lease early; False for an unknown, released or expired one (idempotent)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._agent.release(lease.transfer_lease_id)
        self._pool.unpin(lease.slots)
        with self._lock:
            self.num_released += 1
        return True

    @property
    def num_live(self) -> int:
        return len(self._leases)

    def sweep(self) -> int:
        """Expire the leases past their TTL; how many."""
        now = self._clock()
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.lease_id]
            self.num_expired += len(expired)
        for lease in expired:
            self._pool.unpin(lease.slots)
        return len(expired)

    def close(self) -> None:
        self._stop.set()
        self._sweeper.join(1.0)

    def _sweep_forever(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - keep sweeping
                log.exception("lease sweep failed")
