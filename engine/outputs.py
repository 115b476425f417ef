"""What `LLMEngine.step()` hands back for each request that produced tokens (or finished) in the step."""
from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
