"""Adaptive speculation length: per request from its running acceptance, per batch from measured cost.

Per request, acceptance is tracked as a decayed count of accepted drafts A and of rejections R (a verify that
stopped before its last draft), giving alpha = (A + 1) / (A + R + 2): the chance that the next draft is accepted
given the previous one was. The j-th draft is only verified if it is reached and accepted with probability
alpha**j >= `threshold`; below that for j = 1 the request does not speculate, except one probe draft every
`probe_every` steps so that it can come back.

Per batch, steps are timed (draft + verify forward + sampling, or a plain step) by batch-size bucket; when the
measured tokens per second of speculating steps fall below those of plain steps, the batch stops speculating,
and every `explore_every` steps the other mode runs once to keep both figures current.

    decision(bucket):  spec_rate >= plain_rate ? speculate : plain       (unknown rate: try that mode)
"""
from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.9


@dataclass
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    skipped: int = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * _DECAY + tokens
        self.seconds = self.seconds * _DECAY + seconds

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def bucket(num_requests: int) -> int:
    b = 1
    while b < num_requests:
        b *= 2
    return b


class AdaptiveLength:
    def __init__(self, max_tokens: int, enabled: bool = True, threshold: float = 0.25, probe_every: int = 8,
                 explore_every: int = 16) -> None:
        self.max_tokens, self.enabled = max_tokens, enabled
        self.threshold, self.probe_every, self.explore_every = threshold, probe_every, explore_every
        self._requests: dict[str, _Acceptance] = {}
        self._rates: dict[tuple[int, bool], _Rate] = {}
        self._since_other: dict[int, int] = {}

    # ----- per request

    def length(self, request_id: str) -> int:
        """Drafts to propose for this request now (0: not this step)."""
        if not self.enabled:
            return self.max_tokens
        state = self._requests.setdefault(request_id, _Acceptance())
        alpha, k = state.alpha, 0
        reach = 1.0
        while k < self.max_tokens:
            reach *= alpha
            if reach < self.threshold:
                break
            k += 1
        if k == 0:
            state.skipped += 1
            if state.skipped >= self.probe_every:
                state.skipped, k = 0, 1
        return k

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        state = self._requests.setdefault(request_id, _Acceptance())
        state.accepted = state.accepted * _DECAY + accepted
        state.rejected = state.rejected * _DECAY + (1.0 if accepted < proposed else 0.0)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ----- per batch

    def speculate_batch(self, num_requests: int) -> bool:
        """Whether a pure-decode step of this many requests should speculate."""
        if not self.enabled:
            return True
        b = bucket(num_requests)
        spec, plain = self._rates.get((b, True)), self._rates.get((b, False))
        if spec is None:
            return True
        if plain is None:
            return False
        better = spec.per_second >= plain.per_second
        since = self._since_other.get(b, 0)
        if since >= self.explore_every:
            return not better
        return better

    def record_step(self, num_requests: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A timed pure-decode step: `tokens` emitted for `num_requests` requests in `seconds`."""
        b = bucket(num_requests)
        self._rates.setdefault((b, speculated), _Rate()).add(tokens, seconds)
        spec, plain = self._rates.get((b, True)), self._rates.get((b, False))
        better = spec is None or plain is None or spec.per_second >= plain.per_second
        self._since_other[b] = 0 if speculated != better else self._since_other.get(b, 0) + 1

    def rates(self) -> dict[int, tuple[float, float]]:
        """bucket -> (speculative, plain) tokens per second as measured (0 where not yet measured)."""
        out: dict[int, tuple[float, float]] = {}
        for (b, spec), rate in self._rates.items():
            s, p = out.get(b, (0.0, 0.0))
            out[b] = (rate.per_second, p) if spec else (s, rate.per_second)
        return out
