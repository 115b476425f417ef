"""`Speculation`: the engine's side of speculative decoding. Before a step it asks the drafters for proposals
(`propose`); after the verify forward it turns the logits rows of each speculating request into the tokens it
emits (`sample`), exactly distributed as the target's (verify.py); it times steps for the adaptive length
(adaptive.py) and keeps the counters operators read (`SpecStats`).

    step():  propose(decoding requests) -> schedule (verify = last token + drafts) -> forward (k + 1 logits rows)
             -> sample (accept / correct / bonus) -> update (accepted KV only) -> observe (features, counters)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from engine.batch import ScheduledSeq
from engine.config import SpeculativeConfig
from engine.penalties import SeenTokens
from engine.request import Request
from engine.sampler import Sampler, seeded_uniform
from engine.sampling_params import SamplingParams
from engine.spec.adaptive import AdaptiveLength
from engine.spec.drafter import DraftInput, Drafter, StepFeatures
from engine.spec.verify import ACCEPT_STREAM, RESIDUAL_STREAM, verify_point_masses, verify_sampled

_CHEAP = ("ngram",)     # drafters that cost next to nothing: they propose before the batch decides
SHADOW_EVERY = 2        # `_shadow_probe`: every this many steps in a row that run no drafter,
SHADOW_REQUESTS = 2     # for this many requests of the batch, in turn


@dataclass
class SpecStats:
    """Counters since start (Prometheus counters; rates are derived)."""

    method: str = ""
    num_verifies: int = 0          # request-steps that verified at least one draft
    num_draft_tokens: int = 0      # drafts verified
    num_accepted_tokens: int = 0   # drafts accepted
    num_emitted_tokens: int = 0    # tokens those verifies emitted (accepted + one correction or bonus each)
    draft_seconds: float = 0.0     # in the drafters
    verify_seconds: float = 0.0    # the rest of the steps that verified drafts (forward, verification, update)
    plain_seconds: float = 0.0     # the same for steps without drafts
    num_verify_steps: int = 0
    num_plain_steps: int = 0
    by_method: dict = field(default_factory=dict)   # method -> [verifies, drafts, accepted]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify of one request (accepted drafts + 1), vLLM's 'mean acceptance length'."""
        return self.num_emitted_tokens / self.num_verifies if self.num_verifies else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "by_method"}
        out.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                   by_method={m: dict(zip(("verifies", "drafts", "accepted"), v)) for m, v in self.by_method.items()})
        return out


class Speculation:
    def __init__(self, config: SpeculativeConfig, drafters: dict[str, Drafter], seed: int = 0) -> None:
        assert config.method in drafters, f"the server's drafter {config.method!r} is not loaded"
        self.config, self.drafters = config, drafters
        self.controller = AdaptiveLength(config.num_speculative_tokens, config.adaptive)
        self.stats = SpecStats(method=config.method or "")
        self._q: dict[str, torch.Tensor] = {}          # request id -> q rows of its current sampled drafts
        self._method: dict[str, str] = {}               # request id -> the drafter of its current drafts
        self._rng = np.random.default_rng(seed + 1)
        self._step_started = 0.0
        self._step_decoding = 0
        self._step_draft = 0.0
        self._step_expected: float | None = None
        self._shadow: dict[str, int] = {}   # request id -> its cheap drafter's first draft, not verified this step
        self._idle_steps = 0                # steps in a row that ran no drafter at all

    @property
    def needs_features(self) -> bool:
        return any(d.needs_features for d in self.drafters.values())

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError when a request asks for a drafter this engine did not load."""
        wanted = params.speculative
        if wanted not in (None, "off") and wanted not in self.drafters:
            raise ValueError(f"speculative={wanted!r} is not available here: this server runs "
                             f"{sorted(self.drafters)} (start it with --speculative {wanted}) or 'off'")

    def method_of(self, request: Request) -> str | None:
        wanted = request.params.speculative
        return None if wanted == "off" else (wanted or self.config.method)

    # ----- before the step

    def propose(self, decoding: Sequence[Request]) -> None:
        """Set `spec_token_ids` of the decoding requests (empty where they do not speculate this step). Cheap
        drafters (n-gram) propose first, so the batch decision knows what their requests can gain; model drafters
        run only once the batch decided to speculate."""
        started = time.perf_counter()
        self._step_started, self._step_decoding, self._step_draft = started, len(decoding), 0.0
        self._step_expected = None
        self._shadow.clear()
        for request in decoding:
            request.spec_token_ids = []
        if not decoding:
            return
        if not self.controller.batch_may_pay(len(decoding)):
            self._shadow_probe(decoding)
            return
        plans: dict[str, list[DraftInput]] = {}
        upper = 0.0                     # expected tokens if every request got all its drafts
        for request in decoding:
            method = self.method_of(request)
            room = request.params.max_tokens - request.num_output_tokens - 1
            k = min(self.controller.length(request.request_id), room) if method else 0
            upper += self.controller.expected(request.request_id, k)
            if k > 0:
                plans.setdefault(method, []).append(DraftInput(request, k, not request.params.greedy))
        if not self.controller.speculate_batch(len(decoding), upper):
            self._shadow_probe(decoding)  # cannot pay even with every draft: skip the drafters altogether
            return
        self._idle_steps = 0
        cheap = {m: plans.pop(m) for m in [m for m in plans if m in _CHEAP]}
        self._draft(cheap)
        drafts = {i.request.request_id: i.num_tokens for group in plans.values() for i in group}
        expected = sum(self.controller.expected(r.request_id, drafts.get(r.request_id, len(r.spec_token_ids)))
                       for r in decoding)
        self._step_expected = expected
        if self.controller.speculate_batch(len(decoding), expected):
            self._draft(plans)
        else:
            for request in decoding:
                if request.spec_token_ids:
                    self._shadow[request.request_id] = request.spec_token_ids[0]
                request.spec_token_ids = []
                self._q.pop(request.request_id, None)
        self._step_draft = time.perf_counter() - started
        self.stats.draft_seconds += self._step_draft

    def _shadow_probe(self, decoding: Sequence[Request]) -> None:
        """On every `SHADOW_EVERY`-th step in a row that runs no drafter, the cheap drafters propose one token for
        `SHADOW_REQUESTS` of the requests (in turn) anyway, not verified: `check_shadows` compares it with the
        token the request emits. A new request starts from the engine's acceptance, which these keep current.

        NOTE: a request learns its acceptance only from drafts that were checked. Without this, a plain-decoding
        batch never checks one, and a few early rejections keep it plain. Measured (`spec_bench.py --drafters ngram
        --batches 1,32 --workloads heldout --rounds 2`, bf16): n-gram at batch 1 on held-out text sped up 2.12x with
        speculation forced on, but the adaptive controller stayed at 0.96x; it speculated in 1% of steps. With
        shadow drafts every 8 idle steps: 1.70x (45% of steps); every 2: 1.84-1.85x (73-75%), but batch 8 0.86-0.96x
        (8 lookups a probe); every 2 for 2 requests: batch 1 1.83-1.95x, batch 8 0.96-1.03x, batch 32 0.99x
        greedy and 0.99-1.00x at T 0.7 (two runs each). An n-gram draft is a point mass, so it is accepted with the
        target's probability of that token, which is also the chance that the emitted token equals it. The shadow
        check therefore estimates the same acceptance, at the cost of a lookup, without a verify."""
        self._idle_steps += 1
        if self._idle_steps % SHADOW_EVERY:
            return
        inputs = {}
        start = self._idle_steps // SHADOW_EVERY * SHADOW_REQUESTS
        for i in range(min(SHADOW_REQUESTS, len(decoding))):
            request = decoding[(start + i) % len(decoding)]
            method = self.method_of(request)
            room = request.params.max_tokens - request.num_output_tokens - 1
            if method in _CHEAP and room > 0:
                inputs.setdefault(method, []).append(DraftInput(request, 1, False))
        for method, group in inputs.items():
            for item, proposal in zip(group, self.drafters[method].propose(group, [None] * len(group))):
                if proposal.token_ids:
                    self._shadow[item.request.request_id] = proposal.token_ids[0]

    def _draft(self, groups: dict[str, list[DraftInput]]) -> None:
        for method, inputs in groups.items():
            proposals = self.drafters[method].propose(inputs, [i.request.params.seed for i in inputs])
            for item, proposal in zip(inputs, proposals):
                rid = item.request.request_id
                item.request.spec_token_ids = proposal.token_ids[:item.num_tokens]
                self._method[rid] = method
                if proposal.probs is not None and proposal.token_ids:
                    self._q[rid] = proposal.probs
                else:
                    self._q.pop(rid, None)

    # ----- after the forward

    def sample(self, seqs: Sequence[ScheduledSeq], requests: Sequence[Request], groups: Sequence[list[int]],
               logits: torch.Tensor, sampler: Sampler) -> list[list[int]]:
        """The tokens each sequence emits; `groups[i]` are its logits rows (a verify: k + 1 of them)."""
        rows, params, positions, seen = self._rows(requests, seqs, groups)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        picked = logits.index_select(0, index)                                         # [rows, V]
        draws = sampler.sample(picked, params, positions, seen)
        out: list[list[int]] = []
        at = 0
        for seq, request, group in zip(seqs, requests, groups):
            n = len(group)
            if not seq.num_draft:
                out.append(draws[at:at + n])
            else:
                out.append(self._verify(seq, request, draws[at:at + n], picked[at:at + n - 1], params[at:at + n - 1],
                                        positions[at:at + n - 1], None if seen is None else seen[at:at + n - 1],
                                        sampler))
            at += n
        return out

    def _rows(self, requests: Sequence[Request], seqs: Sequence[ScheduledSeq], groups: Sequence[list[int]]):
        """Per logits row: its params, output position and (for penalties) the tokens seen before it (a draft row
        j has seen the outputs and drafts 1..j)."""
        rows: list[int] = []
        params: list[SamplingParams] = []
        positions: list[int] = []
        penalized = any(r.params.penalized for r, g in zip(requests, groups) if g)
        seen: list | None = [] if penalized else None
        for request, seq, group in zip(requests, seqs, groups):
            drafts = seq.token_ids[1:] if seq.num_draft else []
            for j, row in enumerate(group):
                rows.append(row)
                params.append(request.params)
                positions.append(request.num_output_tokens + j)
                if seen is not None:
                    outputs = request.output_token_ids if j == 0 else [*request.output_token_ids, *drafts[:j]]
                    seen.append(SeenTokens(request.prompt_token_ids, outputs))
        return rows, params, positions, seen

    def _verify(self, seq: ScheduledSeq, request: Request, draws: list[int], p_logits: torch.Tensor,
                params: list[SamplingParams], positions: list[int], seen: list | None,
                sampler: Sampler) -> list[int]:
        drafts = seq.token_ids[1:]
        rid, k = request.request_id, seq.num_draft
        q = self._q.pop(rid, None)
        if q is None or request.params.greedy:
            verdict = verify_point_masses(drafts, draws)
        else:
            p = sampler.probabilities(p_logits, params, positions, seen)                # [k, V]
            verdict = verify_sampled(drafts, q[:k].to(p.device), p, draws[k],
                                     self._uniforms(request, positions, ACCEPT_STREAM),
                                     self._uniforms(request, positions, RESIDUAL_STREAM))
        self.controller.record(rid, k, verdict.num_accepted)
        self._count(self._method.get(rid, self.config.method or ""), k, verdict.num_accepted)
        return verdict.token_ids

    def _uniforms(self, request: Request, positions: list[int], stream: int) -> list[float]:
        seed = request.params.seed
        if seed is None:
            return self._rng.random(len(positions)).tolist()
        return [seeded_uniform(seed, pos, stream) for pos in positions]

    def _count(self, method: str, proposed: int, accepted: int) -> None:
        s = self.stats
        s.num_verifies += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        s.num_emitted_tokens += accepted + 1
        per = s.by_method.setdefault(method, [0, 0, 0])
        per[0] += 1
        per[1] += proposed
        per[2] += accepted

    # ----- after the step

    def check_shadows(self, seqs: Sequence[ScheduledSeq], sampled: Sequence[list[int]]) -> None:
        """Score each unverified draft of this step (`_shadow_probe`) against the token its request emitted."""
        if not self._shadow:
            return
        for seq, tokens in zip(seqs, sampled):
            shadow = self._shadow.pop(seq.request_id, None)
            if shadow is not None and tokens and not seq.num_draft:
                self.controller.record(seq.request_id, 1, int(tokens[0] == shadow))
        self._shadow.clear()

    def finish_step(self, seqs: Sequence[ScheduledSeq], emitted: int, pure_decode: bool) -> None:
        """Time the step (from `propose`) for the adaptive controller and the counters."""
        seconds = time.perf_counter() - self._step_started
        speculated = any(s.num_draft for s in seqs)
        if speculated:
            self.stats.num_verify_steps += 1
            self.stats.verify_seconds += seconds - self._step_draft
        else:
            self.stats.num_plain_steps += 1
            self.stats.plain_seconds += seconds
        if pure_decode and self._step_decoding:
            self.controller.record_step(len(seqs), speculated, seconds, self._step_expected)

    def observe(self, features: StepFeatures) -> None:
        for drafter in self.drafters.values():
            if drafter.needs_features:
                drafter.observe(features)

    def release(self, request_id: str) -> None:
        self._q.pop(request_id, None)
        self._method.pop(request_id, None)
        self.controller.release(request_id)
        for drafter in self.drafters.values():
            drafter.release(request_id)
