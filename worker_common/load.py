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
- `prefill_tokens_per_s`, `prefill_rate_samples`: the measured prefill rate the router's cost model uses for this
  worker: prompt tokens computed (prefix-cache hits and installed blocks excluded) per second of the steps that
  computed them, as a ratio of decayed sums, and how many steps went into it.
- `<tier>_read_*`: the store tiers' measured read costs, added at read time by `tier_reads` (set by the worker that
  owns the store: `worker_common.read_costs.ReadCostMeter`), so the engine thread never reads store counters.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, NamedTuple

from engine.request import Request, RequestStatus

_EWMA_WEIGHT = 0.2          # weight of the newest step in the compute rate
_PREFILL_DECAY = 0.95       # per measured step: the prefill rate remembers about the last 20 steps


class LoadSnapshot(NamedTuple):
    """`WorkerLoad` but `kv_usage`, which the reader takes from the block pool's counters. The field names are
    WorkerLoad's (the worker builds the proto as `WorkerLoad(kv_usage=..., **snapshot._asdict())`)."""

    running: int = 0
    waiting: int = 0
    pending_prefill_tokens: int = 0
    running_tokens: int = 0
    backlog_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    prefill_rate_samples: int = 0
    host_read_latency_s: float = 0.0
    host_read_bytes_per_s: float = 0.0
    host_read_samples: int = 0
    disk_read_latency_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0
    disk_read_samples: int = 0
    redis_read_latency_s: float = 0.0
    redis_read_bytes_per_s: float = 0.0
    redis_read_samples: int = 0
    s3_read_latency_s: float = 0.0
    s3_read_bytes_per_s: float = 0.0
    s3_read_samples: int = 0
    transfer_read_latency_s: float = 0.0
    transfer_read_bytes_per_s: float = 0.0
    transfer_read_samples: int = 0


def computed_tokens(requests: Iterable[Request]) -> int:
    return sum(r.num_computed_tokens for r in requests)


def prompt_tokens_computed(r: Request) -> int:
    """Prompt tokens of `r` the engine computed itself: its computed prompt tokens less its prefix-cache hit."""
    return max(0, min(r.num_computed_tokens, r.num_prompt_tokens) - r.num_cached_tokens)


class LoadTracker:
    """Engine thread: `observe_step` and `refresh`; any thread: `snapshot`.

    NOTE: `refresh` runs after every step and every batch of commands, so the requests it saw last are exactly those
    the next step runs: `observe_step` compares them after the step (finished ones included) to count the prompt
    tokens that step computed.
    """

    def __init__(self) -> None:
        self.tokens_per_s = 0.0
        self.tier_reads: Callable[[], Mapping[str, float]] | None = None  # `<tier>_read_*` figures, any thread
        self._snapshot = LoadSnapshot()
        self._before: list[tuple[Request, int]] = []
        self._prefill_tokens = self._prefill_s = 0.0   # decayed sums
        self._prefill_samples = 0

    @property
    def snapshot(self) -> LoadSnapshot:
        """The engine thread's latest figures, with the store tiers' read costs as of now."""
        if self.tier_reads is None:
            return self._snapshot
        return self._snapshot._replace(**self.tier_reads())

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_tokens / self._prefill_s if self._prefill_s else 0.0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self._observe_prefill(seconds)
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.tokens_per_s = rate if not self.tokens_per_s else (
            _EWMA_WEIGHT * rate + (1 - _EWMA_WEIGHT) * self.tokens_per_s)

    def _observe_prefill(self, seconds: float) -> None:
        # NOTE: a preempted request's counter went back to 0: it computed nothing new here (never negative).
        computed = sum(max(0, prompt_tokens_computed(r) - before) for r, before in self._before)
        if computed <= 0 or seconds <= 0:
            return
        self._prefill_tokens = _PREFILL_DECAY * self._prefill_tokens + computed
        self._prefill_s = _PREFILL_DECAY * self._prefill_s + seconds
        self._prefill_samples += 1

    def refresh(self, requests: Iterable[Request]) -> LoadSnapshot:
        """From the engine's unfinished requests (every one is tracked by the loop)."""
        running = waiting = pending = running_tokens = 0
        before = []
        for r in requests:
            before.append((r, prompt_tokens_computed(r)))
            left = r.num_tokens - r.num_computed_tokens
            if left > 1:
                pending += left
            if r.status is RequestStatus.RUNNING:
                running += 1
                running_tokens += r.num_tokens
            elif r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                waiting += 1
        self._before = before
        backlog = pending / self.tokens_per_s if self.tokens_per_s and pending else 0.0
        self._snapshot = LoadSnapshot(running, waiting, pending, running_tokens, backlog,
                                      self.prefill_tokens_per_s, self._prefill_samples)
        return self._snapshot
