"""What `LLMEngine.step()` hands back for each request that produced tokens (or finished) in the step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """Log probabilities at one output position, from the model's raw distribution (log-softmax of the logits,
    before temperature, penalties, top-k and top-p; vLLM's default)."""

    token_id: int                       # the sampled token
    logprob: float                      # its log probability
    rank: int                           # 1 = the most likely token
    top: list[tuple[int, float]]        # the `SamplingParams.logprobs` most likely (token id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]        # sampled this step
    new_text: str                   # text released this step (complete characters; stop strings cut)
    token_ids: list[int]            # every output token so far
    text: str                       # every output character released so far
    finished: bool
    finish_reason: str | None       # 'stop' | 'length' | 'abort' once finished
    num_cached_tokens: int          # prompt tokens served from the prefix cache
    prompt_tokens: int              # prompt length in tokens
    stop_reason: str | int | None = None   # the stop string or stop token id that ended it, if any
    new_logprobs: list[TokenLogprobs] | None = None   # one per new token, when params.logprobs is set
    logprobs: list[TokenLogprobs] | None = None       # one per output token so far, when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first one)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
