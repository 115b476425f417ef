"""The engine loop both workers share: schedule, run, sample, postprocess (DESIGN §8).

`engine` never imports `kvstore`: the caller injects the block hash function and the namespace root (and, for the
store and the router's index, the `on_block_stored` / `on_block_removed` hooks).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from engine.batch import StepBatch
from engine.block_manager import BlockManager, Hasher, OnBlockStored, PrefixCacheStats
from engine.block_pool import OnBlockRemoved
from engine.detokenizer import Detokenizer
from engine.outputs import RequestOutput, TokenLogprobs
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestUpdate, ScheduledStep, Scheduler
from engine.config import CacheConfig, SchedulerConfig


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
                 on_block_removed: OnBlockRemoved | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        num_blocks = getattr(runner, "num_blocks", None) or cache_config.num_blocks
        self.block_manager = BlockManager(num_blocks, cache_config.block_size, hasher, hash_root,
                                          cache_config.enable_prefix_caching, on_block_stored, on_block_removed)
        if eos_token_ids is None:  # default: the tokenizer's (engine.tokenizer.Tokenizer knows them)
            eos_token_ids = getattr(tokenizer, "eos_token_ids", ())
        self.scheduler = Scheduler(scheduler_config, self.block_manager, eos_token_ids)
        self.sampler = Sampler(seed)
        self._detokenizers: dict[str, Detokenizer] = {}
        self._pending_logprobs: dict[str, TokenLogprobs] = {}  # sampled this step, taken by _output
        self._num_generate_calls = 0

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
        request = Request(request_id, list(prompt), params, hash_root=hash_root)
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = Detokenizer(self.tokenizer, request.prompt_token_ids, params)
        return request

    def abort(self, request_id: str) -> bool:
        self._detokenizers.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if not step.batch.seqs:
            return []
        if step.preloads:  # KV computed elsewhere for blocks this step's requests now own
            self.runner.write_blocks([b for b, _ in step.preloads], torch.stack([kv for _, kv in step.preloads]))
        logits = self.runner.execute(step.batch)  # [sum(num_logits), vocab]
        updates = self.scheduler.update(step, self._sample(step, logits))
        outputs = [self._output(update) for update in updates]
        self._pending_logprobs.clear()
        return outputs

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; the final output of each, in prompt order."""
        each = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        self._num_generate_calls += 1
        ids = [f"generate-{self._num_generate_calls}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, each):
            self.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            final.update((o.request_id, o) for o in self.step() if o.finished)
        return [final[i] for i in ids]

    def _sample(self, step: ScheduledStep, logits: torch.Tensor) -> list[list[int]]:
        if logits.shape[0] != sum(1 for seq in step.batch.seqs if seq.num_logits):
            logits, rows = self._prompt_logprobs(step, logits)  # some sequences have a row per prompt position
        else:
            rows = [i for i, seq in enumerate(step.batch.seqs) if seq.num_logits]
        requests = [step.requests[i] for i in rows]
        seen = [(r.prompt_token_ids, r.output_token_ids) if r.params.penalized else None for r in requests]
        tokens = self.sampler.sample(self._ban_early_stops(logits, requests), [r.params for r in requests],
                                     [r.num_output_tokens for r in requests], seen)
        wanted = [j for j, r in enumerate(requests) if r.params.logprobs is not None]
        if wanted:
            # NOTE: from the raw logits (the sampler works on a penalised copy): vLLM's default logprobs mode
            index = torch.tensor(wanted, device=logits.device)
            computed = token_logprobs(logits.index_select(0, index), [tokens[j] for j in wanted],
                                      [requests[j].params.logprobs for j in wanted])
            for j, entry in zip(wanted, computed):
                self._pending_logprobs[requests[j].request_id] = TokenLogprobs(*entry)
        sampled: list[list[int]] = [[] for _ in step.batch.seqs]
        for i, token_id in zip(rows, tokens):
            sampled[i] = [token_id]
        return sampled

    def _prompt_logprobs(self, step: ScheduledStep, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Record the prompt logprobs of the rows that predict prompt tokens; the logits rows to sample from and
        their sequences' indices. A sequence's rows are its chunk's positions p (predicting token p + 1)."""
        sample_rows, seq_indices, base = [], [], 0
        for i, (seq, request) in enumerate(zip(step.batch.seqs, step.requests)):
            n = seq.num_logits
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

    def _ban_early_stops(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """A copy of `logits` where rows short of their min_tokens cannot draw an end-of-sequence or stop token
        (`logits` itself stays raw for logprobs)."""
        early = [(j, r.params) for j, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        if not early:
            return logits
        out = logits.clone()
        for j, p in early:
            banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else self.scheduler.eos_token_ids))
                      if t < out.shape[1]]
            if banned:
                out[j, torch.tensor(banned, dtype=torch.long, device=out.device)] = float("-inf")
        return out

    def _output(self, update: RequestUpdate) -> RequestOutput:
        request, new_ids = update
        new_text, text, stop_reason = self._detokenize(request, new_ids)
        if request.is_finished:
            self._detokenizers.pop(request.request_id, None)
            if stop_reason is None and request.status is RequestStatus.FINISHED_STOPPED:
                stop_reason = request.output_token_ids[-1]
        new_logprobs = logprobs = None
        if request.params.logprobs is not None:
            new_logprobs = [self._pending_logprobs.pop(request.request_id)] if new_ids else []
            if request.output_logprobs is None:
                request.output_logprobs = []
            request.output_logprobs.extend(new_logprobs)
            logprobs = list(request.output_logprobs)
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.needs_prompt_logprobs:
            prompt_logprobs = [None, *request.prompt_logprobs]
        return RequestOutput(request.request_id, new_ids, new_text, list(request.output_token_ids), text,
                             request.is_finished, request.finish_reason, request.num_cached_tokens,
                             request.num_prompt_tokens, stop_reason, new_logprobs, logprobs, prompt_logprobs)

    def _detokenize(self, request: Request, new_ids: list[int]) -> tuple[str, str, str | None]:
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            return "", "", None
        new_text, stop = detokenizer.push(new_ids)
        if stop is not None:
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED  # a stop string beats 'length' in the same step
            else:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished:
            new_text += detokenizer.flush()
        return new_text, detokenizer.text, stop
