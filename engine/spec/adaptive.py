"""Adaptive speculation length: per request from its running acceptance, per batch from measured cost.

Per request, acceptance is tracked as a decayed count of accepted drafts A and of rejections R (a verify that
stopped before its last draft), giving alpha = (A + 3) / (A + R + 4) (an optimistic prior): the chance that the next draft is accepted
given the previous one was. The j-th draft is only verified if it is reached and accepted with probability
alpha**j >= `threshold`; below that for j = 1 the request does not speculate, except one probe draft every
`probe_every` steps so that it can come back.

Per batch, the controller keeps the measured time of a step in each mode by batch-size bucket (an average of
recent steps: draft + verify forward + sampling, or a plain step) and speculates when the tokens the step is
expected to emit, sum over requests of 1 + alpha + alpha**2 + ... + alpha**k (k its drafts), per second of a
speculating step beat the batch size per second of a plain one. Acceptance and timing are kept apart, so a few
bad drafts never lock speculation out and one slow step does not either. A mode not run for `explore_every`
steps runs once to refresh its time; each refresh that leaves the choice as it was doubles that wait (up to
`max_explore_every`):

    speculate(bucket) = expected_tokens / t_spec(bucket) >= batch / t_plain(bucket)   (unknown time: measure it)
"""
from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.9
_PRIOR_WEIGHT = 4.0      # a new request's prior counts as this many observations of the engine's acceptance


@dataclass
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    skipped: int = 0

    @property
    def alpha(self) -> float:
        # NOTE: an optimistic prior (3 accepted, 1 rejected: 0.75): a request whose drafts were never verified
        # gets verified, so its acceptance is learned; a pessimistic one would never speculate to find out
        return (self.accepted + 3.0) / (self.accepted + self.rejected + 4.0)


@dataclass
class _StepTime:
    seconds: float = 0.0
    weight: float = 0.0

    def add(self, seconds: float) -> None:
        self.seconds = self.seconds * _DECAY + seconds
        self.weight = self.weight * _DECAY + 1.0

    @property
    def mean(self) -> float:
        return self.seconds / self.weight


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify of k drafts emits on average when each is accepted with probability alpha."""
    return sum(alpha ** j for j in range(k + 1))


def bucket(num_requests: int) -> int:
    b = 1
    while b < num_requests:
        b *= 2
    return b


class AdaptiveLength:
    def __init__(self, max_tokens: int, enabled: bool = True, threshold: float = 0.25, probe_every: int = 8,
                 explore_every: int = 64, max_explore_every: int = 4096) -> None:
        self.max_tokens, self.enabled = max_tokens, enabled
        self.threshold, self.probe_every, self.explore_every = threshold, probe_every, explore_every
        self.max_explore_every = max_explore_every
        self._requests: dict[str, _Acceptance] = {}
        self._global = _Acceptance()               # every request's verifies: the prior of a new request
        self._times: dict[tuple[int, bool], _StepTime] = {}
        self._since_other: dict[int, int] = {}
        self._wait: dict[int, int] = {}            # bucket -> steps before the next probe of the other mode
        self._choice: dict[int, bool] = {}         # bucket -> the mode that won the last comparison

    # ----- per request

    def length(self, request_id: str) -> int:
        """Drafts to propose for this request now (0: not this step)."""
        if not self.enabled:
            return self.max_tokens
        state = self._state(request_id)
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

    def _state(self, request_id: str) -> _Acceptance:
        """A new request starts from the engine's recent acceptance, weighted as a few observations (a prior that
        a request of the same workload is likely to share), not from a fixed guess."""
        state = self._requests.get(request_id)
        if state is None:
            g = self._global
            scale = min(1.0, _PRIOR_WEIGHT / max(g.accepted + g.rejected, 1e-9))
            state = self._requests[request_id] = _Acceptance(g.accepted * scale, g.rejected * scale)
        return state

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        rejected = 1.0 if accepted < proposed else 0.0
        for state in (self._state(request_id), self._global):
            state.accepted = state.accepted * _DECAY + accepted
            state.rejected = state.rejected * _DECAY + rejected

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def batch_may_pay(self, num_requests: int) -> bool:
        """`speculate_batch` with every request drafting `max_tokens` at the engine's recent acceptance: O(1), so a
        batch where speculation is out of reach pays nothing per request to find out."""
        return self.speculate_batch(num_requests, num_requests * expected_tokens(self._global.alpha, self.max_tokens))

    def expected(self, request_id: str, num_drafts: int) -> float:
        return expected_tokens(self._state(request_id).alpha, num_drafts)

    # ----- per batch

    def speculate_batch(self, num_requests: int, expected: float | None = None) -> bool:
        """Whether a pure-decode step of `num_requests` requests, expected to emit `expected` tokens when it
        speculates (None: not known yet), should speculate."""
        if not self.enabled:
            return True
        if expected is not None and expected <= num_requests:
            return False                                      # nothing proposed: nothing to gain
        b = bucket(num_requests)
        spec, plain = self._times.get((b, True)), self._times.get((b, False))
        if spec is None:
            spec = self._scaled_from_smaller(b)
        if spec is None:
            return True
        if plain is None:
            return False
        better = self._better(b, num_requests, expected)
        if self._since_other.get(b, 0) >= self._wait.get(b, self.explore_every):
            return not better                                 # refresh the other mode's time
        return better

    def seed(self, plain: dict[int, float], speculating: dict[int, float]) -> None:
        """Step times measured before serving, per batch size (the compiled steps' warm-up: a plain decode step and
        a verify step, forwards only), as each bucket's first estimate of both modes, counted as one observation
        (serving's own steps soon outweigh it): a bucket where speculation cannot pay does not pay a probe to find
        out, and the first refresh of the losing mode waits as long as after a measured comparison."""
        for size in sorted(plain.keys() & speculating.keys()):
            b = bucket(size)
            if (b, True) in self._times or (b, False) in self._times:
                continue
            self._times[(b, False)], self._times[(b, True)] = _StepTime(), _StepTime()
            self._times[(b, False)].add(plain[size])
            self._times[(b, True)].add(speculating[size])
            self._since_other[b] = 0
            self._wait[b] = int(self.explore_every * max(1.0, speculating[size] / max(plain[size], 1e-9)))

    def _scaled_from_smaller(self, b: int) -> _StepTime | None:
        """A first estimate of a speculating step at bucket b from the largest smaller bucket that measured one,
        scaled by the batch sizes (a verify's work grows with the tokens it verifies): a large batch need not pay
        a probe that the estimate says cannot win. Replaced by a measurement at the first refresh."""
        smaller = max((s for s, spec in self._times if spec and s < b), default=None)
        if smaller is None:
            return None
        estimate = _StepTime()
        estimate.add(self._times[(smaller, True)].mean * b / smaller)
        self._times[(b, True)] = estimate
        self._since_other[b] = 0
        plain = self._times.get((smaller, False))
        self._wait[b] = int(self.explore_every * max(1.0, estimate.mean / plain.mean)) if plain else self.explore_every
        return estimate

    def _better(self, b: int, num_requests: int, expected: float | None) -> bool:
        if expected is None:
            return self._choice.get(b, True)
        return expected / self._times[(b, True)].mean >= num_requests / self._times[(b, False)].mean

    def record_step(self, num_requests: int, speculated: bool, seconds: float, expected: float | None = None) -> None:
        """A timed pure-decode step of `num_requests` requests in `seconds`."""
        b = bucket(num_requests)
        self._times.setdefault((b, speculated), _StepTime()).add(seconds)
        if (b, not speculated) not in self._times:
            return
        better = self._better(b, num_requests, expected) if speculated or expected is not None \
            else self._choice.get(b, False)
        if speculated != better:            # the other mode's refresh: if the choice stands, wait longer
            self._since_other[b] = 0
            stands = self._choice.get(b) == better
            # NOTE: the wait also grows with what a refresh costs (a verify step worth 6 plain ones waits 6x as
            # long), so refreshing a losing mode stays a few percent of the steps at any batch size
            ratio = max(1.0, self._times[(b, True)].mean / self._times[(b, False)].mean)
            base = int(self.explore_every * ratio)
            self._wait[b] = min(self.max_explore_every, max(2 * self._wait.get(b, base), base)) if stands \
                else base
        else:
            self._since_other[b] = self._since_other.get(b, 0) + 1
        self._choice[b] = better
