"""`draft`: a small model with the target's tokenizer, run by its own `ModelRunner` with its own paged KV cache in
the same engine process. Per proposal it catches each request up (the prompt on first sight, then whatever the
target accepted since), then drafts k tokens autoregressively, all requests batched in every forward:

    forward 1:  each request's uncomputed tokens (catch-up)       -> d_1
    forward j:  d_{j-1} of the requests still drafting             -> d_j      (j = 2..k)

The last draft is never run through the draft model (the next catch-up computes it if it was accepted). A
request the cache has no room for proposes nothing this step.
"""
from __future__ import annotations

from typing import Sequence

from engine.batch import StepBatch
from engine.config import CacheConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.spec.draft_kv import DraftDraw, DraftRun, ShadowSequences
from engine.spec.drafter import DraftInput, Drafter, Proposal


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, target_vocab_size: int,
                 max_num_seqs: int = 64, seed: int = 0, num_speculative_tokens: int = 4,
                 max_model_len: int | None = None) -> None:
        # NOTE: compiled (unless eager), the draft's one-token steps run its decode graph and its catch-ups (up
        # to k + 1 tokens: the accepted drafts and the correction) its verify graph
        self.runner = ModelRunner(model_config, CacheConfig(cache_config.block_size, cache_config.num_blocks,
                                                            enable_prefix_caching=False),
                                  max_num_seqs=max_num_seqs, speculative_tokens=num_speculative_tokens,
                                  max_model_len=max_model_len)
        if self.runner.vocab_size != target_vocab_size:
            raise ValueError(f"draft model {model_config.path!r} has vocab_size={self.runner.vocab_size}, the "
                             f"target {target_vocab_size}: a draft model must share the target's tokenizer")
        self.shadows = ShadowSequences(cache_config.num_blocks, cache_config.block_size)
        self.draw = DraftDraw(seed)

    def propose(self, inputs: Sequence[DraftInput], seeds: Sequence[int | None]) -> list[Proposal]:
        run = DraftRun(inputs, self.draw)
        active = []
        for i, item in enumerate(inputs):
            shadow = self.shadows.sync(item.request.request_id, item.request.token_ids)
            # positions up to the last token plus k - 1 drafts get KV here
            if self.shadows.reserve(shadow, item.request.num_tokens + item.num_tokens - 1):
                active.append((i, shadow))
        while active:
            batch = StepBatch([self.shadows.scheduled(shadow) for _, shadow in active])
            logits = self.runner.execute(batch)                                          # [len(active), V]
            active = [active[b] for b in run.step(logits, active)]
        return run.proposals()

    def release(self, request_id: str) -> None:
        self.shadows.release(request_id)
