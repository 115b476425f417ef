"""One request, driven by counters (DESIGN §8): prefill, chunked prefill, decode and speculative verify are one sum.

    token_ids:  | prompt ............................ | outputs ........... |
                0                num_computed_tokens ^            num_tokens ^
                |<- KV in the cache (num_cached_tokens of it came from the prefix cache) ->|

A step computes `token_ids[num_computed_tokens : num_computed_tokens + n]`; when that reaches `num_tokens`, the step
also samples the next token, which is appended (not yet computed). Preemption by recompute only resets
`num_computed_tokens` to 0: the outputs stay, so the request resumes by prefilling prompt + outputs.
Bookkeeping only: no tensors.
"""
from __future__ import annotations

import enum
from typing import NewType

from engine.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"    # eos, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"      # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"    # abort(request_id)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """The scheduler's unit of work. `hash_root` overrides the engine's namespace (e.g. a tenant's salted one)."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "token_ids", "params", "status",
                 "num_computed_tokens", "num_cached_tokens", "num_preemptions", "arrival_index", "hash_root",
                 "block_hashes", "output_logprobs", "prompt_logprobs", "preloaded_kv", "freed_block_ids",
                 "spec_token_ids")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int = 0, hash_root: bytes | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
        self.request_id = RequestId(request_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)       # prompt + outputs, appended in place
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0                    # prefix-cache hit tokens at the first allocation
        self.num_preemptions = 0
        self.arrival_index = arrival_index            # smaller = older; preemption picks the largest
        self.hash_root = hash_root
        self.block_hashes: list[bytes] = []           # chained hashes of full blocks of token_ids, filled lazily
        self.output_logprobs: list | None = None      # engine.outputs.TokenLogprobs per output sampled here
        self.prompt_logprobs: list = []               # TokenLogprobs of prompt tokens 1.. (params.prompt_logprobs)
        # KV for the partial block right after the full blocks of the prompt, computed elsewhere (a prefill
        # worker's hand-off): (tensor [layers, 2, block_size, kv_heads, head_dim], tokens it holds). Installed once
        # when the request is first allocated right behind those full blocks; otherwise those tokens are computed.
        self.preloaded_kv: tuple | None = None
        self.freed_block_ids: list[int] = []          # the table it held when freed (readable until reallocated)
        self.spec_token_ids: list[int] = []           # proposed for the next step (engine/spec), not yet verified

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """'stop' | 'length' | 'abort', or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (they need every prompt position computed here)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def truncate_outputs(self, num_outputs: int) -> None:
        """Drop outputs past the first `num_outputs` (a stop string matched inside a multi-token step)."""
        drop = self.num_output_tokens - num_outputs
        if drop > 0:
            del self.output_token_ids[num_outputs:]
            del self.token_ids[len(self.token_ids) - drop:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, outputs={self.num_output_tokens})")
