"""What the model-based drafters share: each request's shadow sequence in the drafter's own paged KV cache, and
the draw of a draft token (greedy, or sampled from q with the request's settings).

A shadow is an engine `Request` the drafter's `BlockManager` allocates for: its `token_ids` are the drafter's view
of the request (verified tokens, then the drafts it proposed) and `num_computed_tokens` how many have KV in the
drafter's cache. Before each proposal it is synced with the request: the KV of the common prefix stays, the rest
(rejected drafts) is recomputed:

    shadow:   | verified at the last sync ......... | d_1 d_2 d_3 (drafted) |
    request:  | verified at the last sync ......... | d_1 x | (one accepted, x the target's correction)
    kept KV:  |<------------------------------------------>|   recompute from x on
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from engine.batch import ScheduledSeq
from engine.block_manager import BlockManager, PrefixMatch
from engine.request import Request
from engine.sampler import Sampler, seeded_uniform
from engine.sampling_params import SamplingParams
from engine.spec.drafter import DraftInput, Proposal
from engine.spec.verify import DRAFT_STREAM


def _no_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return parent   # prefix caching is off in a drafter's cache: nothing is ever hashed


class ShadowSequences:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_manager = BlockManager(num_blocks, block_size, _no_hash, b"", enable_prefix_caching=False)
        self._shadows: dict[str, Request] = {}
        self._synced: dict[str, int] = {}    # request tokens seen at the last sync

    def sync(self, request_id: str, tokens: list[int], valid: int | None = None) -> Request:
        """The shadow of `request_id` with `tokens` as its view; KV kept for the common prefix (and at most `valid`
        positions, for a drafter whose KV at later positions is not a function of the tokens alone)."""
        shadow = self._shadows.get(request_id)
        if shadow is None:
            shadow = self._shadows[request_id] = Request(request_id, tokens[:1], SamplingParams())
            shadow.token_ids, self._synced[request_id] = list(tokens), len(tokens)
            return shadow
        have, synced = shadow.token_ids, self._synced[request_id]
        common = min(synced, len(tokens))
        while common < min(len(have), len(tokens)) and have[common] == tokens[common]:
            common += 1
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common,
                                         len(tokens) if valid is None else valid)
        del have[common:]
        have.extend(tokens[common:])
        self._synced[request_id] = len(tokens)
        return shadow

    def reserve(self, shadow: Request, num_positions: int) -> bool:
        """Make the shadow's table cover `num_positions` positions; False (nothing changed) when out of blocks."""
        if not self.block_manager.block_table(shadow.request_id):     # first sight: nothing computed yet
            return self.block_manager.allocate(shadow, PrefixMatch([], 0), num_positions)
        return self.block_manager.append_slots(shadow, num_positions - shadow.num_computed_tokens)

    def scheduled(self, shadow: Request) -> ScheduledSeq:
        """The step that computes the shadow's uncomputed tokens, with logits for the last."""
        start = shadow.num_computed_tokens
        return ScheduledSeq(shadow.request_id, shadow.token_ids[start:], start,
                            self.block_manager.table_snapshot(shadow.request_id), 1)

    def release(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)


class DraftDraw:
    """Draft tokens from draft logits: the argmax for a greedy request; for a sampling one a draw from q = the
    request's own filtered distribution (temperature, top-k/p, min-p) of the draft logits, U(seed, position,
    DRAFT_STREAM) for a seeded request."""

    def __init__(self, seed: int = 0) -> None:
        self._sampler = Sampler()
        self._rng = np.random.default_rng(seed + 2)

    def __call__(self, logits: torch.Tensor, inputs: Sequence[DraftInput],
                 positions: Sequence[int]) -> tuple[list[int], list[torch.Tensor | None]]:
        """logits [rows, V] for `inputs` (a row each); `positions[i]`: the output position being drafted."""
        tokens = logits.argmax(dim=-1).tolist()
        q_rows: list[torch.Tensor | None] = [None] * len(inputs)
        sampled = [i for i, item in enumerate(inputs) if item.sampled]
        if not sampled:
            return tokens, q_rows
        index = torch.tensor(sampled, device=logits.device)
        params = [_plain(inputs[i].request.params) for i in sampled]
        q = self._sampler.probabilities(logits.index_select(0, index).float(), params,
                                        [positions[i] for i in sampled])                 # [s, V]
        cdf = q.double().cumsum(dim=-1)
        for j, i in enumerate(sampled):
            seed = inputs[i].request.params.seed
            u = seeded_uniform(seed, positions[i], DRAFT_STREAM) if seed is not None else float(self._rng.random())
            target = torch.tensor([u * float(cdf[j, -1])], dtype=cdf.dtype)
            tokens[i] = int(torch.searchsorted(cdf[j], target, right=True).clamp_(max=cdf.shape[1] - 1))
            q_rows[i] = q[j]
        return tokens, q_rows


def _plain(params: SamplingParams) -> SamplingParams:
    """The request's settings less what needs the seen tokens (penalties, bans, bias): q may be any distribution."""
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, max_tokens=params.max_tokens)


class DraftRun:
    """One proposal round of a model drafter: per input the drafts so far (and the q each was drawn from), the
    autoregressive loop's bookkeeping shared by the draft model and the EAGLE head. `active` lists (input index,
    shadow) of the sequences still drafting."""

    def __init__(self, inputs: Sequence[DraftInput], draw: DraftDraw) -> None:
        self.inputs, self.draw = inputs, draw
        self.drafts: list[list[int]] = [[] for _ in inputs]
        self.q_rows: list[list[torch.Tensor]] = [[] for _ in inputs]

    def step(self, logits: torch.Tensor, active: list[tuple[int, Request]]) -> list[int]:
        """Draw each active sequence's next draft from its logits row, append it to the shadow (whose tokens so
        far are now computed); the positions in `active` of those that still draft."""
        rows = [self.inputs[i] for i, _ in active]
        positions = [self.inputs[i].request.num_output_tokens + len(self.drafts[i]) for i, _ in active]
        tokens, q = self.draw(logits, rows, positions)
        keep = []
        for b, ((i, shadow), token, q_row) in enumerate(zip(active, tokens, q)):
            shadow.num_computed_tokens = shadow.num_tokens
            shadow.token_ids.append(token)
            self.drafts[i].append(token)
            if q_row is not None:
                self.q_rows[i].append(q_row)
            if len(self.drafts[i]) < self.inputs[i].num_tokens:
                keep.append(b)
        return keep

    def proposals(self) -> list[Proposal]:
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(self.drafts, self.q_rows)]
