"""Admission at the router (issue 15 item 1): bounded queues, so overload is refused at the door with a retry hint
instead of piling up requests that would miss their deadlines.

    new request ─> the model's requests in flight >= max_queue_per_worker × its ready decode workers?
                     yes: RESOURCE_EXHAUSTED (HTTP 429) + retry hint                      (`check_fleet`)
                 ─route─> decode workers that can take it: every one holds >= max_queue_per_worker requests?
                     yes: the same refusal; no: routed among those with room              (`with_room`)

The first bound counts every request the router admitted and has not finished, wherever it waits (a prefill
worker's queue included); the second keeps one worker from taking more than its share. A worker's queue is the
larger of what its last heartbeat said (running + waiting) and the router's own count of steps in flight there
(fresher). Only a request's first routing is bounded: a retry or a migration of a request already admitted is never
refused for load. Bookkeeping only.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from router.load import LoadView, WorkerLoad
from router.validation import ApiError


@dataclass(frozen=True)
class AdmissionConfig:
    """`max_queue_per_worker`: requests a decode worker may hold (running + waiting) before the router refuses new
    ones; 0 = no bound. `retry_after_s`: the hint sent with a refusal, scaled up by how far past the bound the
    least loaded worker is (at most `max_retry_after_s`)."""

    max_queue_per_worker: int = 256
    retry_after_s: float = 1.0
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_queue_per_worker < 0:
            raise ValueError(f"max_queue_per_worker must be >= 0 (0 = no bound), got {self.max_queue_per_worker}")
        if not 0 < self.retry_after_s <= self.max_retry_after_s:
            raise ValueError(f"retry_after_s must be in (0, max_retry_after_s={self.max_retry_after_s}], "
                             f"got {self.retry_after_s}")


def check_fleet(in_flight: int, num_decoders: int, config: AdmissionConfig, model_id: str) -> None:
    """RESOURCE_EXHAUSTED when the model's requests in flight fill every ready decode worker's share (no decode
    worker at all is left for routing to answer UNAVAILABLE)."""
    limit = config.max_queue_per_worker * num_decoders
    if limit == 0 or in_flight < limit:
        return
    retry = min(config.max_retry_after_s, config.retry_after_s * in_flight / limit)
    raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"model {model_id!r} has {in_flight} requests in flight, the limit of its {num_decoders} decode "
                   f"workers (the router's --max-queue-per-worker {config.max_queue_per_worker} each); retry after "
                   f"{retry:.0f} s", retry_after_s=retry)


def with_room(view: LoadView, config: AdmissionConfig, model_id: str) -> LoadView:
    """The view without the decode workers whose queue is full; RESOURCE_EXHAUSTED when no decoder has room
    (a view with no decoder at all is left for routing to answer UNAVAILABLE)."""
    limit = config.max_queue_per_worker
    decoders = view.decode_workers()
    if limit == 0 or not decoders:
        return view
    full = {w.worker_id for w in decoders if w.queue_len >= limit}
    if len(full) < len(decoders):
        return LoadView.of(w for w in view.workers if w.worker_id not in full)
    raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"every decode worker of model {model_id!r} holds {limit} or more requests (the router's "
                   f"--max-queue-per-worker); retry after {_retry_after(decoders, config):.0f} s",
                   retry_after_s=_retry_after(decoders, config))


def _retry_after(decoders: tuple[WorkerLoad, ...], config: AdmissionConfig) -> float:
    over = min(w.queue_len for w in decoders) / config.max_queue_per_worker    # >= 1
    return min(config.max_retry_after_s, config.retry_after_s * over)


__all__ = ["AdmissionConfig", "check_fleet", "with_room"]
