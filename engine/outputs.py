"""What `LLMEngine.step()` hands back for each request that produced tokens (or finished) in the step."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple


class TokenLogprobs(NamedTuple):
    """Log probabilities at one output position, from the model's raw distribution (log-softmax of the logits,
    before temperature, penalties, top-k and top-p; vLLM's default)."""

    token_id: int                       # the sampled token
    logprob: float                      # its log probability
    rank: int                           # 1 = the most likely token
    top: list[tuple[int, float]]        # the `SamplingParams.logprobs` most likely (token id, logprob), best first


class Prefix(NamedTuple):
    """The first `length` items of an append-only `source` (a list, or anything that slices), read when called:
    a snapshot that costs nothing until someone reads it."""

    source: Any
    length: int

    def __call__(self) -> Any:
        return self.source[:self.length]


_FIELDS = ("request_id", "new_token_ids", "new_text", "token_ids", "text", "finished", "finish_reason",
           "num_cached_tokens", "prompt_tokens", "stop_reason", "new_logprobs", "logprobs", "prompt_logprobs")


class RequestOutput:
    """One request's output of one step (or its only output, for `RequestOutputKind.FINAL_ONLY`).

    The cumulative fields (`token_ids`, `text`, `logprobs`, `prompt_logprobs`) may be given as a zero-argument
    callable (e.g. a `Prefix` of the request's append-only lists): they are built on first read and kept, so a
    step's output costs O(1) however long the request is. `completion_tokens` never builds the list.
    """

    __slots__ = ("request_id", "new_token_ids", "new_text", "_token_ids", "_text", "finished", "finish_reason",
                 "num_cached_tokens", "prompt_tokens", "stop_reason", "new_logprobs", "_logprobs",
                 "_prompt_logprobs", "_num_tokens")

    def __init__(self, request_id: str, new_token_ids: list[int], new_text: str,
                 token_ids: list[int] | Callable[[], list[int]], text: str | Callable[[], str], finished: bool,
                 finish_reason: str | None, num_cached_tokens: int, prompt_tokens: int,
                 stop_reason: str | int | None = None, new_logprobs: list[TokenLogprobs] | None = None,
                 logprobs: list[TokenLogprobs] | Callable[[], list[TokenLogprobs]] | None = None,
                 prompt_logprobs: list[TokenLogprobs | None] | Callable[[], list] | None = None) -> None:
        self.request_id = request_id
        self.new_token_ids = new_token_ids          # sampled this step (FINAL_ONLY: every output token)
        self.new_text = new_text                    # text released this step (complete characters; stop strings cut)
        self._token_ids = token_ids                 # every output token so far
        self._text = text                           # every output character released so far
        self.finished = finished
        self.finish_reason = finish_reason          # 'stop' | 'length' | 'abort' once finished
        self.num_cached_tokens = num_cached_tokens  # prompt tokens served from the prefix cache
        self.prompt_tokens = prompt_tokens          # prompt length in tokens
        self.stop_reason = stop_reason              # the stop string or stop token id that ended it, if any
        self.new_logprobs = new_logprobs            # one per new token, when params.logprobs is set
        self._logprobs = logprobs                   # one per output token so far, when params.logprobs is set
        self._prompt_logprobs = prompt_logprobs     # one per prompt token (None for the first one)
        self._num_tokens = token_ids.length if isinstance(token_ids, Prefix) else None

    @property
    def token_ids(self) -> list[int]:
        return self._read("_token_ids")

    @property
    def text(self) -> str:
        return self._read("_text")

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self._read("_logprobs")

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        return self._read("_prompt_logprobs")

    @property
    def completion_tokens(self) -> int:
        return self._num_tokens if self._num_tokens is not None else len(self.token_ids)

    def _read(self, slot: str) -> Any:
        value = getattr(self, slot)
        if callable(value):
            value = value()
            setattr(self, slot, value)
        return value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    __hash__ = None  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return "RequestOutput(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS) + ")"
