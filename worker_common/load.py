"""The worker's load as the router's policy reads it (`WorkerLoad`), measured on the engine thread.

The engine loop refreshes one immutable `LoadSnapshot` after every step and every batch of commands; `Stats` and
heartbeats read the latest one from any thread, so neither waits for a step nor touches the engine.

- `pending_prefill_tokens`: tokens still to compute of every request that is prefilling or queued (a request with
  one token left is decoding). A queued request's prefix-cache hit is not known before it is scheduled, so this
  over-estimates for cached prompts.
- `running_tokens`: per running request, prefill tokens still to compute + decode context = its `num_tokens`.
- `backlog_s`: an estimate of the seconds before a new request's prefill could start: `pending_prefill_tokens`
  divided by the recent compute rate (an exponentially weighted mean of tokens computed per second of step time,
  decode tokens included). 0 (= "not estimated", so the router predicts it itself) before the first step.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from engine.request import Request, RequestStatus

_EWMA_WEIGHT = 0.2          # weight of the newest step in the compute rate


class LoadSnapshot(NamedTuple):
    """`WorkerLoad` but `kv_usage`, which the reader takes from the block pool's counters."""

    running: int = 0
    waiting: int = 0
    pending_prefill_tokens: int = 0
    running_tokens: int = 0
    backlog_s: float = 0.0


def computed_tokens(requests: Iterable[Request]) -> int:
    return sum(r.num_computed_tokens for r in requests)


class LoadTracker:
    """Engine thread: `observe_step` and `refresh`; any thread: `snapshot`."""

    def __init__(self) -> None:
        self.tokens_per_s = 0.0
        self.snapshot = LoadSnapshot()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.tokens_per_s = rate if not self.tokens_per_s else (
            _EWMA_WEIGHT * rate + (1 - _EWMA_WEIGHT) * self.tokens_per_s)

    def refresh(self, requests: Iterable[Request]) -> LoadSnapshot:
        """From the engine's unfinished requests (every one is tracked by the loop)."""
        running = waiting = pending = running_tokens = 0
        for r in requests:
            left = r.num_tokens - r.num_computed_tokens
            if left > 1:
                pending += left
            if r.status is RequestStatus.RUNNING:
                running += 1
                running_tokens += r.num_tokens
            elif r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                waiting += 1
        backlog = pending / self.tokens_per_s if self.tokens_per_s and pending else 0.0
        self.snapshot = LoadSnapshot(running, waiting, pending, running_tokens, backlog)
        return self.snapshot
