"""The engine loop both workers share: schedule, run, sample, postprocess (DESIGN §8).

`engine` never imports `kvstore`: the caller injects the block hash function and the namespace root (and, for the
store and the router's index, the `on_block_stored` / `on_block_removed` hooks).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Protocol, Sequence

import torch

from engine.batch import StepBatch
from engine.block_manager import BlockManager, Hasher, OnBlockStored, PrefixCacheStats
from engine.block_pool import OnBlockRemoved
from engine.detokenizer import Detokenizer, decode_final
from engine.outputs import Prefix, RequestOutput, TokenLogprobs
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, SeenTokens, token_logprobs
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import RequestUpdate, ScheduledStep, Scheduler
from engine.config import CacheConfig, SchedulerConfig
from engine.spec.drafter import StepFeatures
from engine.spec.speculation import Speculation


class Runner(Protocol):
    num_blocks: int

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [sum(seq.num_logits), vocab], rows in batch order (each seq's last positions)."""
        ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite whole cache blocks with `data` [n, layers, 2, block_size, kv_heads, head_dim]."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: str): ...  # list[int] (engine.tokenizer) or an Encoding with .ids (tokenizers)
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class LLMEngine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer | None, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, hasher: Hasher, hash_root: bytes,
                 eos_token_ids: Sequence[int] | None = None, *, seed: int = 0,
                 on_block_stored: OnBlockStored | None = None,
                 on_block_removed: OnBlockRemoved | None = None,
                 speculation: Speculation | None = None) -> None:
        """`speculation`: speculative decoding (engine/spec, `build_speculation`); None: off."""
        self.runner = runner
        self.speculation = speculation
        self.tokenizer = tokenizer
        num_blocks = getattr(runner, "num_blocks", None) or cache_config.num_blocks
        self.block_manager = BlockManager(num_blocks, cache_config.block_size, hasher, hash_root,
                                          cache_config.enable_prefix_caching, on_block_stored, on_block_removed)
        if eos_token_ids is None:  # default: the tokenizer's (engine.tokenizer.Tokenizer knows them)
            eos_token_ids = getattr(tokenizer, "eos_token_ids", ())
        self.scheduler = Scheduler(scheduler_config, self.block_manager, eos_token_ids)
        self.sampler = Sampler(seed, tuple(eos_token_ids))   # bans eos before min_tokens
        self._detokenizers: dict[str, Detokenizer] = {}
        self._pending_logprobs: dict[str, TokenLogprobs] = {}  # sampled this step, taken by _output
        self._num_generate_calls = 0
        self.group_idle = True       # expert parallel: no rank of the group ran a forward in the last step

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_manager.stats

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    *, hash_root: bytes | None = None) -> Request:
        """Queue a request; `prompt` is text (tokenized here) or token ids. Raises ValueError on bad input."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt token ids instead")
            encoded = self.tokenizer.encode(prompt)
            prompt = encoded.ids if hasattr(encoded, "ids") else encoded  # `tokenizers.Tokenizer` or ours
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if self.speculation is not None:
            self.speculation.check(params)
        elif params.speculative not in (None, "off"):
            raise ValueError(f"speculative={params.speculative!r} is not available here: this server runs without "
                             f"speculative decoding (start it with --speculative {params.speculative}) or 'off'")
        salt = self._prefix_salt(len(prompt))
        if salt:   # e.g. dynamic NTK past max_position_embeddings: the prompt's KV depends on its length
            hash_root = self.block_manager.salted_root(hash_root, salt)
        request = Request(request_id, list(prompt), params, hash_root=hash_root)
        self.scheduler.add_request(request)
        # NOTE: a FINAL_ONLY request's text is decoded once at the end, unless stop strings need it every step
        if self.tokenizer is not None and (params.output_kind is RequestOutputKind.CUMULATIVE or params.stop):
            self._detokenizers[request_id] = Detokenizer(self.tokenizer, request.prompt_token_ids, params)
        return request

    def _prefix_salt(self, prompt_len: int) -> str:
        spec = getattr(self.runner, "spec", None)        # a ModelSpec (tests may run a runner without one)
        return spec.prefix_cache_salt(prompt_len) if spec is not None else ""

    def abort(self, request_id: str) -> bool:
        self._detokenizers.pop(request_id, None)
        self.sampler.release(request_id)
        if self.speculation is not None:
            self.speculation.release(request_id)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        spec = self.speculation
        if spec is not None:
            spec.propose(self.scheduler.decoding())   # sets each decoding request's spec_token_ids
        step = self.scheduler.schedule()
        if self.lockstep:
            return self._step_expert_parallel(step)
        if not step.batch.seqs:
            return []
        return self._run(step)

    @property
    def lockstep(self) -> bool:
        """Expert parallel: `step` must run on every loop turn, with or without requests (a collective)."""
        return getattr(self.runner, "ep", None) is not None

    def _step_expert_parallel(self, step: ScheduledStep) -> list[RequestOutput]:
        """Every rank joins every step; a rank without a batch still joins the sparse layers' exchanges."""
        self.group_idle = not self.runner.ep_begin(step.batch)
        if self.group_idle:
            return []                   # no rank has work this step
        try:
            if not step.batch.seqs:
                self.runner.ep_idle()
                return []
            return self._run(step)
        finally:
            self.runner.ep_end()

    def _run(self, step: ScheduledStep) -> list[RequestOutput]:
        spec = self.speculation
        if step.preloads:  # KV computed elsewhere for blocks this step's requests now own
            self.runner.write_blocks([b for b, _ in step.preloads], torch.stack([kv for _, kv in step.preloads]))
        if spec is not None and spec.needs_features:
            logits, hidden = self.runner.execute_features(step.batch)  # [N, vocab], [T, H] before the final norm
        else:
            logits, hidden = self.runner.execute(step.batch), None   # [sum(num_logits), vocab]
        sampled = self._sample(step, logits)
        updates = self.scheduler.update(step, sampled)
        if spec is not None:
            self._after_speculation(step, sampled, hidden)
        outputs = [output for output in map(self._output, updates) if output is not None]
        self._pending_logprobs.clear()
        return outputs

    def _after_speculation(self, step: ScheduledStep, sampled: list[list[int]], hidden: torch.Tensor | None) -> None:
        """Time the step for the adaptive length, and hand the target's features of the verified positions (each
        sequence's computed tokens less its rejected drafts) to the drafters that read them."""
        seqs = step.batch.seqs
        pure_decode = all(len(s.token_ids) == 1 + s.num_draft and s.num_logits for s in seqs)
        self.speculation.check_shadows(seqs, sampled)
        self.speculation.finish_step(seqs, sum(map(len, sampled)), pure_decode)
        if hidden is None:
            return
        ids, starts, rows, counts, row = [], [], [], [], 0
        for seq, tokens in zip(seqs, sampled):
            ids.append(seq.request_id)
            starts.append(seq.start_pos)
            rows.append(row)
            counts.append(seq.num_computed(len(tokens)))
            row += len(seq.token_ids)
        self.speculation.observe(StepFeatures(ids, starts, rows, counts, hidden))

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; the final output of each, in prompt order (`RequestOutputKind.FINAL_ONLY`:
        no text is decoded before a request ends)."""
        each = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        self._num_generate_calls += 1
        ids = [f"generate-{self._num_generate_calls}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, each):
            final_only = dataclasses.replace(p or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
            self.add_request(request_id, prompt, final_only)
        final: dict[str, RequestOutput] = {}
        # NOTE: expert parallel: every rank calls generate (maybe with no prompts) and steps until a step in which
        # no rank ran a forward, so all ranks leave at the same step.
        while self.has_unfinished() or self.lockstep:
            final.update((o.request_id, o) for o in self.step() if o.finished)
            if self.lockstep and self.group_idle and not self.has_unfinished():
                break
        return [final[i] for i in ids]

    def _sample(self, step: ScheduledStep, logits: torch.Tensor) -> list[list[int]]:
        if any(seq.num_draft for seq in step.batch.seqs):
            return self._sample_verify(step, logits)
        if any(r.needs_prompt_logprobs for r in step.requests):
            # rows per prompt position; a sequence samples only where its chunk reaches the end of its tokens
            logits, rows = self._prompt_logprobs(step, logits)
        else:
            rows = [i for i, seq in enumerate(step.batch.seqs) if seq.num_logits]
        requests = [step.requests[i] for i in rows]
        params = [r.params for r in requests]
        # NOTE: keyed by request id, the sampler keeps penalty counts across steps (released when a request ends)
        seen = [SeenTokens(r.prompt_token_ids, r.output_token_ids, r.request_id) for r in requests] \
            if any(p.penalized for p in params) else None
        tokens = self.sampler.sample(logits, params, [r.num_output_tokens for r in requests], seen)
        if any(p.logprobs is not None for p in params):
            self._token_logprobs(logits, requests, tokens)
        if len(rows) == len(step.batch.seqs):
            return [[token_id] for token_id in tokens]
        sampled: list[list[int]] = [[] for _ in step.batch.seqs]
        for i, token_id in zip(rows, tokens):
            sampled[i] = [token_id]
        return sampled

    def _sample_verify(self, step: ScheduledStep, logits: torch.Tensor) -> list[list[int]]:
        """A step with speculating sequences: their k + 1 rows are verified (engine/spec/verify.py), the other
        sequences sample their one row as usual; logprobs of every emitted token come from its own row."""
        if any(r.needs_prompt_logprobs for r in step.requests):
            self._prompt_logprobs(step, logits)
        groups, base = [], 0
        for seq, request in zip(step.batch.seqs, step.requests):
            n = seq.num_logits
            final = n and seq.start_pos + len(seq.token_ids) - seq.num_draft == request.num_tokens
            groups.append(list(range(base, base + n)) if seq.num_draft else [base + n - 1] if final else [])
            base += n
        sampled = self.speculation.sample(step.batch.seqs, step.requests, groups, logits, self.sampler)
        for request, group, tokens in zip(step.requests, groups, sampled):
            if tokens and request.params.logprobs is not None:
                rows = torch.tensor(group[:len(tokens)], device=logits.device)
                entries = token_logprobs(logits.index_select(0, rows), tokens,
                                         [request.params.logprobs] * len(tokens))
                self._pending_logprobs[request.request_id] = [TokenLogprobs(*e) for e in entries]
        return sampled

    def _token_logprobs(self, logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> None:
        """Logprobs of the sampled tokens for the requests that ask, for `_output` to take."""
        wanted = [j for j, r in enumerate(requests) if r.params.logprobs is not None]
        # NOTE: from the raw logits (the sampler works on a penalised copy): vLLM's default logprobs mode
        index = torch.tensor(wanted, device=logits.device)
        computed = token_logprobs(logits.index_select(0, index), [tokens[j] for j in wanted],
                                  [requests[j].params.logprobs for j in wanted])
        for j, entry in zip(wanted, computed):
            self._pending_logprobs[requests[j].request_id] = [TokenLogprobs(*entry)]

    def _prompt_logprobs(self, step: ScheduledStep, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Record the prompt logprobs of the rows that predict prompt tokens; the logits rows to sample from and
        their sequences' indices. A sequence's rows are its chunk's positions p (predicting token p + 1)."""
        sample_rows, seq_indices, base = [], [], 0
        for i, (seq, request) in enumerate(zip(step.batch.seqs, step.requests)):
            n = seq.num_logits
            if seq.num_draft:           # a verify (the caller samples it): its rows predict no prompt token
                base += n
                continue
            if n > 1 or (n == 1 and request.needs_prompt_logprobs):
                first = seq.start_pos + len(seq.token_ids) - n                       # position of the first row
                prompt = request.prompt_token_ids
                end = min(first + n, len(prompt) - 1)                            # rows predicting prompt tokens
                have = len(request.prompt_logprobs)      # NOTE: > first when a preempted request recomputes
                assert have >= first, "prompt chunks run in order from position 0 (no prefix hit)"
                if have < end:
                    rows = logits[base + have - first:base + end - first]
                    entries = token_logprobs(rows, prompt[have + 1:end + 1],
                                             [request.params.prompt_logprobs] * len(rows))
                    request.prompt_logprobs.extend(TokenLogprobs(*e) for e in entries)
            if n and seq.start_pos + len(seq.token_ids) == request.num_tokens:
                sample_rows.append(base + n - 1)
                seq_indices.append(i)
            base += n
        return logits[torch.tensor(sample_rows, dtype=torch.long, device=logits.device)], seq_indices

    def _output(self, update: RequestUpdate) -> RequestOutput | None:
        """The step's output for a request; None for an unfinished FINAL_ONLY one. Cumulative fields are `Prefix`
        snapshots of the request's append-only lists (read on demand), not copies."""
        request, new_ids = update
        params = request.params
        new_text, stop_reason, new_ids = self._detokenize(request, new_ids)
        new_logprobs = None if params.logprobs is None else self._record_logprobs(request, new_ids)
        finished = request.is_finished
        if finished:
            self.sampler.release(request.request_id)
            if self.speculation is not None:
                self.speculation.release(request.request_id)
            if stop_reason is None and request.status is RequestStatus.FINISHED_STOPPED:
                stop_reason = request.output_token_ids[-1]
        if params.output_kind is RequestOutputKind.FINAL_ONLY:
            return self._final_output(request, stop_reason) if finished else None
        detokenizer = (self._detokenizers.pop if finished else self._detokenizers.get)(request.request_id, None)
        text = functools.partial(detokenizer.text_upto, detokenizer.num_released) if detokenizer else ""
        logprobs = None if new_logprobs is None else Prefix(request.output_logprobs, len(request.output_logprobs))
        prompt_logprobs = None if params.prompt_logprobs is None else self._prompt_logprobs_out(request, lazy=True)
        return RequestOutput(request.request_id, new_ids, new_text,
                             Prefix(request.output_token_ids, request.num_output_tokens), text, finished,
                             request.finish_reason, request.num_cached_tokens, request.num_prompt_tokens,
                             stop_reason, new_logprobs, logprobs, prompt_logprobs)

    def _final_output(self, request: Request, stop_reason: str | int | None) -> RequestOutput:
        """Everything at once: the new fields hold every output too (nothing was handed out before)."""
        detokenizer = self._detokenizers.pop(request.request_id, None)
        if detokenizer is not None:
            text = detokenizer.text
        elif self.tokenizer is not None:
            text = decode_final(self.tokenizer, request.prompt_token_ids, request.output_token_ids)
        else:
            text = ""
        logprobs = list(request.output_logprobs) if request.params.logprobs is not None else None
        return RequestOutput(request.request_id, list(request.output_token_ids), text,
                             list(request.output_token_ids), text, True, request.finish_reason,
                             request.num_cached_tokens, request.num_prompt_tokens, stop_reason, logprobs,
                             None if logprobs is None else list(logprobs), self._prompt_logprobs_out(request))

    def _record_logprobs(self, request: Request, new_ids: list[int]) -> list[TokenLogprobs]:
        """The new tokens' logprobs (sampled this step), appended to the request's."""
        new_logprobs = self._pending_logprobs.pop(request.request_id)[:len(new_ids)] if new_ids else []
        if request.output_logprobs is None:
            request.output_logprobs = []
        request.output_logprobs.extend(new_logprobs)
        return new_logprobs

    @staticmethod
    def _prompt_logprobs_out(request: Request, lazy: bool = False) -> list | Callable[[], list] | None:
        """One per prompt token (None for the first), once all are computed; `lazy`: built when read."""
        if request.params.prompt_logprobs is None or request.needs_prompt_logprobs:
            return None
        entries = functools.partial(_first_none, request.prompt_logprobs)
        return entries if lazy else entries()

    def _detokenize(self, request: Request, new_ids: list[int]) -> tuple[str, str | None, list[int]]:
        """(text released by the new tokens, the stop string that matched, the new tokens it kept): a stop string
        inside a multi-token (speculative) step drops the tokens after it, as one token per step would."""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            return "", None, new_ids
        (new_text, stop), used = detokenizer.push_until_stop(new_ids)
        if used < len(new_ids):
            request.truncate_outputs(request.num_output_tokens - (len(new_ids) - used))
            new_ids = new_ids[:used]
        if stop is not None:
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED  # a stop string beats 'length' in the same step
            else:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished:
            new_text += detokenizer.flush()
        return new_text, stop, new_ids


def _first_none(entries: list) -> list:
    return [None, *entries]
