"""The router's worker registry (issue 5 item 5): membership, liveness, load, draining.

Bookkeeping only: ids, strings, numbers and a clock; no sockets (the gRPC `Registry` service and the router's
probe of `--worker` addresses call in), no protos.

    register ──> READY ──drain──> DRAINING ──deregister──> (gone)
                   │                  │
                   └── silence past heartbeat_timeout, or a failed call ──> DEAD ──(kept keep_dead_s)──> (gone)

A DEAD worker's heartbeat is refused (`UnknownWorker`): it registers again, which brings it back READY. Listeners
hear `on_up(record)` after a (re)registration and `on_down(worker_id)` when a worker stops being trusted (dead,
deregistered, or replaced by a restart), so the prefix index and the event feed follow membership.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

from router.cost_model import MeasuredCosts
from router.index import WorkerId
from router.load import LoadView, WorkerLoad

Role = Literal["prefill", "decode", "both"]
State = Literal["ready", "draining", "dead"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")


class UnknownWorker(KeyError):
    """No live worker with this id (never registered, deregistered, or declared dead: register again)."""


@dataclass(frozen=True)
class RegistryConfig:
    heartbeat_interval_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    keep_dead_s: float = 600.0          # how long a DEAD worker stays listed for operators
    busy_half_life_s: float = 30.0      # decay of the recent-work sum the load guard balances

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ms < 1:
            raise ValueError(f"heartbeat_interval_ms must be >= 1, got {self.heartbeat_interval_ms}")
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(f"heartbeat_timeout_ms must be > heartbeat_interval_ms "
                             f"({self.heartbeat_interval_ms}), got {self.heartbeat_timeout_ms}")
        if self.keep_dead_s < 0 or self.busy_half_life_s <= 0:
            raise ValueError(f"keep_dead_s must be >= 0 and busy_half_life_s > 0, got {self.keep_dead_s}, "
                             f"{self.busy_half_life_s}")


@dataclass(frozen=True)
class ModelFacts:
    """The model a worker serves, as it declares it (ModelInfo without the proto)."""

    id: str
    max_model_len: int = 0
    model_fingerprint: str = ""
    kv_layout: str = ""
    kv_dtype: str = ""
    block_size: int = 0

    def kv_compatible(self, model_fingerprint: str, kv_dtype: str) -> bool:
        """Whether this worker's KV can serve a model hashed with that fingerprint and KV dtype: a worker with
        other weights (or another weight quantization) or another KV cache dtype never takes its requests, so a
        prefill worker never hands fp8 KV to a bf16 decoder. A fact the worker left empty (a probed worker)
        does not exclude it: its blocks are still verified one by one."""
        return (not self.model_fingerprint or self.model_fingerprint == model_fingerprint) and \
            (not self.kv_dtype or self.kv_dtype == kv_dtype)


@dataclass(frozen=True)
class WorkerRecord:
    """A worker as it describes itself. `probed`: the router found it at a `--worker` address and polls it,
    rather than the worker registering and heartbeating itself."""

    id: WorkerId
    role: Role
    address: str
    model: ModelFacts
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    transfer_backends: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    probed: bool = False
    speculative_methods: tuple[str, ...] = ()   # drafters a request may ask for here (none: it never speculates)

    def __post_init__(self) -> None:
        for name in ("id", "address"):
            if not getattr(self, name):
                raise ValueError(f"worker.{name} must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"worker.role must be one of {ROLES}, got {self.role!r}")
        if not self.model.id:
            raise ValueError("worker.model.id must not be empty")


@dataclass(frozen=True)
class LoadFigures:
    """The load a worker reports (WorkerLoad without the proto), with the costs it measured, if any."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    pending_prefill_tokens: int = 0
    running_tokens: int = 0
    backlog_s: float = 0.0
    measured: MeasuredCosts | None = None


@dataclass(frozen=True)
class SpecFigures:
    """A worker's speculative decoding as it reports it (SpeculativeStats without the proto); counters since its
    start."""

    method: str
    num_speculative_tokens: int = 0
    verifies: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted_tokens / self.verifies if self.verifies else 0.0


@dataclass(frozen=True)
class WorkerView:
    """A consistent snapshot of one entry."""

    record: WorkerRecord
    state: State
    load: LoadFigures
    last_heartbeat_unix_ms: int
    inflight: int                 # requests the router has on it now
    recent_busy_s: float
    last_kv_event_seq: int | None
    speculative: SpecFigures | None = None   # the last heartbeat's; None: it does not speculate (or said nothing yet)


@dataclass
class _Entry:
    record: WorkerRecord
    state: State = "ready"
    load: LoadFigures = field(default_factory=LoadFigures)
    last_seen: float = 0.0                    # monotonic clock
    last_heartbeat_unix_ms: int = 0
    dead_since: float | None = None
    inflight: int = 0
    busy_s: float = 0.0                       # decayed sum, as of busy_at
    busy_at: float = 0.0
    sent_prefill_s: float = 0.0               # prefill work sent since the worker's last load report, as of sent_at
    sent_at: float = 0.0
    last_kv_event_seq: int | None = None
    speculative: SpecFigures | None = None


Listener = Callable[..., None]


class WorkerRegistry:
    """Thread-safe. Listeners run outside the lock, in the caller's thread."""

    def __init__(self, config: RegistryConfig = RegistryConfig(), clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.config = config
        self._clock, self._wall_ms = clock, wall_ms
        self._entries: dict[WorkerId, _Entry] = {}
        self._lock = threading.Lock()
        self._on_up: list[Callable[[WorkerRecord], None]] = []
        self._on_down: list[Callable[[WorkerId], None]] = []

    def add_listener(self, on_up: Callable[[WorkerRecord], None] | None = None,
                     on_down: Callable[[WorkerId], None] | None = None) -> None:
        if on_up:
            self._on_up.append(on_up)
        if on_down:
            self._on_down.append(on_down)

    # ---- membership ---------------------------------------------------------------------------------------------

    def register(self, record: WorkerRecord) -> bool:
        """Add or replace (a restart); True when an entry with that id was replaced."""
        now = self._clock()
        with self._lock:
            old = self._entries.get(record.id)
            self._entries[record.id] = _Entry(record, last_seen=now, busy_at=now,
                                              last_heartbeat_unix_ms=self._wall_ms())
        if old is not None:
            self._notify_down([record.id])
        for fn in self._on_up:
            fn(record)
        return old is not None

    def heartbeat(self, worker_id: WorkerId, load: LoadFigures | None = None,
                  last_kv_event_seq: int | None = None, speculative: SpecFigures | None = None) -> State:
        """Refresh liveness (and load, speculative counters); the state to tell the worker. `UnknownWorker` for
        unknown or dead ids."""
        with self._lock:
            entry = self._live(worker_id)
            entry.last_seen, entry.last_heartbeat_unix_ms = self._clock(), self._wall_ms()
            if load is not None:
                entry.load, entry.sent_prefill_s = load, 0.0
            if speculative is not None:
                entry.speculative = speculative
            if last_kv_event_seq is not None:
                entry.last_kv_event_seq = last_kv_event_seq
            return entry.state

    def drain(self, worker_id: WorkerId) -> WorkerView:
        """No new requests to the worker. Idempotent."""
        with self._lock:
            entry = self._live(worker_id)
            entry.state = "draining"
            return self._view(entry)

    def deregister(self, worker_id: WorkerId) -> bool:
        """Remove now; False for an unknown id (not an error)."""
        with self._lock:
            entry = self._entries.pop(worker_id, None)
        if entry is not None and entry.state != "dead":
            self._notify_down([worker_id])
        return entry is not None

    def report_failure(self, worker_id: WorkerId, reason: str = "") -> None:
        """A call to the worker failed as if it were gone (connection refused, UNAVAILABLE): stop routing to it
        until it registers again (or the probe finds it back)."""
        with self._lock:
            entry = self._entries.get(worker_id)
            if entry is None or entry.state == "dead":
                return
            entry.state, entry.dead_since = "dead", self._clock()
        self._notify_down([worker_id])

    def sweep(self) -> list[WorkerId]:
        """Declare silent workers DEAD and forget long-dead ones; the newly dead ids."""
        now = self._clock()
        timeout_s = self.config.heartbeat_timeout_ms / 1000.0
        died: list[WorkerId] = []
        with self._lock:
            for wid, entry in list(self._entries.items()):
                if entry.state != "dead" and now - entry.last_seen > timeout_s:
                    entry.state, entry.dead_since = "dead", now
                    died.append(wid)
                elif entry.state == "dead" and now - (entry.dead_since or now) > self.config.keep_dead_s:
                    del self._entries[wid]
        self._notify_down(died)
        return died

    # ---- routing accounting ---------------------------------------------------------------------------------

    def begin(self, worker_id: WorkerId, work_s: float = 0.0, prefill_s: float = 0.0) -> None:
        """The router sent a step to the worker, predicted to take `work_s` seconds of its time, `prefill_s` of them
        (fetch and prefill) ahead of any prefill sent after it: until the worker's next load report counts it, the
        policy sees it added to the reported backlog. Without that, every request between two heartbeats (a
        second apart) would go to the worker whose last report was lowest."""
        with self._lock:
            entry = self._entries.get(worker_id)
            if entry is not None:
                entry.inflight += 1
                entry.busy_s = self._decayed(entry) + max(0.0, work_s)
                entry.busy_at = self._clock()
                entry.sent_prefill_s, entry.sent_at = self._sent(entry) + max(0.0, prefill_s), entry.busy_at

    def end(self, worker_id: WorkerId) -> None:
        with self._lock:
            entry = self._entries.get(worker_id)
            if entry is not None:
                entry.inflight = max(0, entry.inflight - 1)

    def load_view(self, model_id: str | None = None, exclude: Iterable[WorkerId] = (),
                  kv: tuple[str, str] | None = None, speculative: str | None = None) -> LoadView:
        """The READY workers (of a model; with `kv` = (model fingerprint, kv dtype), only those whose KV is
        compatible: `ModelFacts.kv_compatible`; with `speculative` = a drafter, only the decode workers that loaded
        it, prefill workers all the same), as the policy sees them."""
        skip = set(exclude)
        with self._lock:
            loads = [self._policy_load(e) for e in self._entries.values()
                     if e.state == "ready" and e.record.id not in skip
                     and (model_id is None or e.record.model.id == model_id)
                     and (kv is None or e.record.model.kv_compatible(*kv))
                     and (speculative is None or e.record.role == "prefill"
                          or speculative in e.record.speculative_methods)]
        return LoadView.of(loads)

    def speculative_methods(self, model_id: str) -> set[str] | None:
        """The drafters the READY decode workers of a model loaded, together; None when no decode worker is READY
        (routing then answers UNAVAILABLE, whatever the request asks for)."""
        with self._lock:
            decoders = [e.record for e in self._entries.values() if e.state == "ready"
                        and e.record.role in ("decode", "both") and e.record.model.id == model_id]
        return None if not decoders else {m for r in decoders for m in r.speculative_methods}

    # ---- queries --------------------------------------------------------------------------------------------

    def get(self, worker_id: WorkerId) -> WorkerView:
        with self._lock:
            entry = self._entries.get(worker_id)
            if entry is None:
                raise UnknownWorker(worker_id)
            return self._view(entry)

    def workers(self, role: Role | None = None, include_dead: bool = False) -> list[WorkerView]:
        """Sorted by id. A `both` worker is listed under either role."""
        with self._lock:
            views = [self._view(e) for e in self._entries.values()
                     if (include_dead or e.state != "dead")
                     and (role is None or e.record.role in (role, "both"))]
        return sorted(views, key=lambda v: v.record.id)

    def check_integrity(self) -> None:
        with self._lock:
            for wid, e in self._entries.items():
                assert wid == e.record.id, "entry keyed by another id"
                assert e.inflight >= 0, "negative in-flight count"
                assert (e.state == "dead") == (e.dead_since is not None), "dead_since set iff dead"

    # ---- internals --------------------------------------------------------------------------------------------

    def _live(self, worker_id: WorkerId) -> _Entry:
        entry = self._entries.get(worker_id)
        if entry is None or entry.state == "dead":
            raise UnknownWorker(worker_id)
        return entry

    def _decayed(self, entry: _Entry) -> float:
        elapsed = max(0.0, self._clock() - entry.busy_at)
        return entry.busy_s * math.pow(0.5, elapsed / self.config.busy_half_life_s)

    def _sent(self, entry: _Entry) -> float:
        """Prefill work sent since the last load report. It also halves every two heartbeat intervals, so a worker
        whose reports carry no load (a vLLM worker without /metrics) is not charged its sends forever."""
        elapsed = max(0.0, self._clock() - entry.sent_at)
        return entry.sent_prefill_s * math.pow(0.5, elapsed / (2e-3 * self.config.heartbeat_interval_ms))

    def _policy_load(self, e: _Entry) -> WorkerLoad:
        # NOTE: the router's own in-flight count is fresher than the last heartbeat; take the larger of the two.
        queue_len = max(e.load.running + e.load.waiting, e.inflight)
        return WorkerLoad(e.record.id, e.record.role, queue_len=queue_len, running_tokens=e.load.running_tokens,
                          backlog_s=max(0.0, e.load.backlog_s) + self._sent(e), recent_busy_s=self._decayed(e),
                          measured=e.load.measured)

    def _view(self, e: _Entry) -> WorkerView:
        return WorkerView(e.record, e.state, e.load, e.last_heartbeat_unix_ms, e.inflight, self._decayed(e),
                          e.last_kv_event_seq, e.speculative)

    def _notify_down(self, worker_ids: list[WorkerId]) -> None:
        for wid in worker_ids:
            for fn in self._on_down:
                fn(wid)


__all__ = ["LoadFigures", "ModelFacts", "RegistryConfig", "SpecFigures", "UnknownWorker", "WorkerRecord",
           "WorkerRegistry", "WorkerView", "ROLES"]
