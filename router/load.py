"""The router's load view: per-worker load figures as plain data, a snapshot the policy reads and never changes.

The live router fills it from worker heartbeats and its own in-flight accounting; `benchmarks/routing_sim.py`
fills it from its simulated queues. Either way the policy sees the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping

from router.cost_model import MeasuredCosts
from router.index import WorkerId

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load at the moment of the snapshot.

    queue_len:        requests waiting or running on the worker
    running_tokens:   tokens of the requests it is running (prefill tokens still to compute + decode context)
    backlog_s:        predicted seconds before it can start a new request (the queue wait the policy charges): the
                      worker's last reported backlog plus the prefill work the router sent it since that report
    recent_busy_s:    seconds of work assigned to it recently (an exponentially decayed sum, queued work included):
                      the long-run share the load guard balances
    measured:         its own prefill rate and tier read costs, when it reports them (the cost model prices this
                      worker with them: `CostModelConfig.with_measured`)
    """

    worker_id: WorkerId
    role: Role = "both"
    queue_len: int = 0
    running_tokens: int = 0
    backlog_s: float = 0.0
    recent_busy_s: float = 0.0
    measured: MeasuredCosts | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.queue_len < 0 or self.running_tokens < 0:
            raise ValueError(f"queue_len and running_tokens must be >= 0, got {self.queue_len}, {self.running_tokens}")
        if self.backlog_s < 0 or self.recent_busy_s < 0:
            raise ValueError(f"backlog_s and recent_busy_s must be >= 0, got {self.backlog_s}, {self.recent_busy_s}")

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class LoadView:
    """Every routable worker's load, ordered by worker id (so iteration order, and hence ties, are deterministic)."""

    workers: tuple[WorkerLoad, ...]

    def __post_init__(self) -> None:
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        object.__setattr__(self, "workers", tuple(sorted(self.workers, key=lambda w: w.worker_id)))

    @classmethod
    def of(cls, loads: Iterable[WorkerLoad]) -> "LoadView":
        return cls(tuple(loads))

    def by_id(self) -> Mapping[WorkerId, WorkerLoad]:
        return {w.worker_id: w for w in self.workers}

    def prefill_workers(self) -> tuple[WorkerLoad, ...]:
        return tuple(w for w in self.workers if w.can_prefill)

    def decode_workers(self) -> tuple[WorkerLoad, ...]:
        return tuple(w for w in self.workers if w.can_decode)
