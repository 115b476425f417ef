"""What the scheduler hands the model runner each step: only ints (STYLE habit 1); the runner builds tensors.

One step computes, for each scheduled sequence, `token_ids` at positions `start_pos .. start_pos+len-1`,
writing their KV into the slots given by `block_table` (slot = block_table[pos // block_size] * block_size +
pos % block_size) and attending to every earlier position of the same sequence. Prefill, chunked prefill, decode
and speculative verify are all this one shape: a verify step computes the request's last token and its drafts,

    token_ids:  | t (sampled last step) | d_1 ... d_k (proposed) |     num_logits = k + 1, num_draft = k

    positions:  0 ........ start_pos-1 | start_pos ... start_pos+len(token_ids)-1
                (already in the cache)  | (computed this step)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]        # tokens computed this step
    start_pos: int              # num_computed_tokens before this step
    block_table: list[int]      # block ids covering positions [0, start_pos + len(token_ids))
    num_logits: int = 1         # how many trailing positions need logits (0: a non-final prefill chunk)
    prompt_len: int = 0         # the request's prompt length (dynamic NTK RoPE rotates a prompt for it); 0: unknown
    num_draft: int = 0          # the last num_draft token_ids are speculative (verify: num_logits = num_draft + 1)

    def num_computed(self, num_sampled: int) -> int:
        """Positions this step computed for good, given the tokens sampled for it: all its tokens, except that a
        verify keeps its last token and the accepted drafts only (it samples the accepted drafts plus one)."""
        return len(self.token_ids) - self.num_draft + (num_sampled - 1 if self.num_draft else 0)


@dataclass(frozen=True)
class StepBatch:
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
