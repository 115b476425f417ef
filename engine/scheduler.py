"""Continuous batching with chunked prefill and preemption by recompute (DESIGN §8). Bookkeeping only.

Each `schedule()` fills one token budget (`max_num_batched_tokens`):

    1. running requests, decodes first, then unfinished (chunked) prefills, oldest first within each group;
       when blocks run out, the newest running request is preempted (blocks freed, re-queued at the front);
    2. waiting requests in order (preempted ones first), each taking its prefix-cache hit and a first chunk,
       while the budget, `max_num_seqs` and the free blocks allow; skipped in a step that preempted.

A decoding request with proposed tokens (`request.spec_token_ids`) is scheduled as a verify: its last token and
its drafts, `1 + k` tokens and logits, trimmed to the budget and to what max_tokens / max_model_len leave.

`update(step, sampled)` advances the counters of what ran (of a verify, the accepted drafts only), indexes newly full blocks, appends sampled tokens and
finishes requests on eos / stop_token_ids / max_tokens / max_model_len. Stop strings are the caller's (text side),
which ends a request with `finish_request`.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable, NamedTuple, Sequence

from engine.batch import ScheduledSeq, StepBatch
from engine.block_manager import BlockManager, cdiv
from engine.request import Request, RequestStatus
from engine.config import SchedulerConfig


class ScheduledStep(NamedTuple):
    batch: StepBatch
    requests: list[Request]      # parallel to batch.seqs
    preempted: list[Request]     # preempted while building this step (now waiting)
    preloads: Sequence[tuple[int, object]] = ()   # (block id, KV tensor) to write before the step runs


class RequestUpdate(NamedTuple):
    request: Request
    new_token_ids: list[int]     # appended by this step (the request may now be finished)


class _Plan:
    __slots__ = ("budget", "planned", "preempted", "preloads")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.planned: dict[Request, int] = {}    # request -> tokens this step, in batch order
        self.preempted: list[Request] = []
        self.preloads: list[tuple[int, object]] = []


def _arrival(request: Request) -> int:
    return request.arrival_index


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self._requests: dict[str, Request] = {}     # every unfinished request
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []           # sorted by arrival_index
        self._next_arrival = 0

    # ----- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for a duplicate id or one that could never fit."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self._check_fits(request)
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request at any time ('abort'); None if it is unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        assert status.is_finished, f"{status} is not a finished status"
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ----- one step

    def schedule(self) -> ScheduledStep:
        plan = _Plan(self.config.max_num_batched_tokens)
        for request in self._decodes_first():
            if plan.budget == 0:
                break
            if request.status is RequestStatus.RUNNING:   # not preempted earlier in this loop
                self._schedule_running(request, plan)
        if not plan.preempted or not self._running:
            self._admit_waiting(plan)
        return self._build(plan)

    def update(self, step: ScheduledStep, sampled_token_ids: Sequence[Sequence[int]]) -> list[RequestUpdate]:
        """`sampled_token_ids[i]` are the tokens sampled for `step.batch.seqs[i]` ([] where num_logits == 0)."""
        updates: list[RequestUpdate] = []
        for request, seq, sampled in zip(step.requests, step.batch.seqs, sampled_token_ids):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted since schedule()
            # NOTE: a verify's rejected drafts do not count: their slots are rewritten later
            request.num_computed_tokens += seq.num_computed(len(sampled))
            self.block_manager.commit(request)
            if seq.num_logits:
                updates.append(RequestUpdate(request, self._append(request, sampled)))
        return updates

    # ----- steps of schedule()

    def decoding(self) -> list[Request]:
        """Running requests whose next step is a decode (one token left to compute): the ones that may speculate."""
        return [r for r in self._running if r.num_computed_tokens == r.num_tokens - 1]

    def _decodes_first(self) -> list[Request]:
        """A copy of the running requests (preemption edits the list), decodes first, arrival order within each."""
        prefills = [r for r in self._running if r.num_computed_tokens < r.num_tokens - 1]
        if not prefills:
            return self._running[:]
        return [r for r in self._running if r.num_computed_tokens >= r.num_tokens - 1] + prefills

    def _schedule_running(self, request: Request, plan: _Plan) -> None:
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = min(remaining, plan.budget)
        if num_new < remaining and not self.config.enable_chunked_prefill:
            return
        if remaining == 1 and request.spec_token_ids:   # verify: the last token and the drafts the budget allows
            num_new = min(1 + self._num_drafts(request), plan.budget)
        while not self.block_manager.append_slots(request, num_new):
            if num_new > remaining:     # drafts never preempt anyone: verify without them
                num_new = remaining
                continue
            victim = self._running[-1]    # the newest request gives its blocks back
            self._preempt(victim)
            plan.preempted.append(victim)
            plan.budget += plan.planned.pop(victim, 0)
            if victim is request:
                return
        plan.planned[request] = num_new
        plan.budget -= num_new

    def _num_drafts(self, request: Request) -> int:
        """Drafts worth verifying: never past max_tokens (the bonus token is the last output) or max_model_len, so
        a verify step needs no KV slot `_check_fits` did not count."""
        room = min(request.params.max_tokens - request.num_output_tokens,
                   self.config.max_model_len - request.num_tokens + 1) - 1
        return max(0, min(len(request.spec_token_ids), room))

    def _admit_waiting(self, plan: _Plan) -> None:
        bm, chunked = self.block_manager, self.config.enable_chunked_prefill
        while self._waiting and plan.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            prefix = bm.match_prefix(request)
            preload = self._usable_preload(request, prefix.num_tokens)
            remaining = request.num_tokens - prefix.num_tokens - preload
            num_new = min(remaining, plan.budget)
            if num_new < remaining and not chunked:
                return
            if not bm.allocate(request, prefix, preload + num_new):
                return
            if preload:
                request.num_computed_tokens += preload
                block_id = bm.block_table(request.request_id)[len(prefix.block_ids)]
                plan.preloads.append((block_id, request.preloaded_kv[0]))
            request.preloaded_kv = None  # one chance: after a preemption those tokens are computed
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self._running, request, key=_arrival)
            plan.planned[request] = num_new
            plan.budget -= num_new

    def _build(self, plan: _Plan) -> ScheduledStep:
        seqs: list[ScheduledSeq] = []
        table = self.block_manager.table_snapshot   # copied only when it grew, never changed afterwards
        for request, num_new in plan.planned.items():
            start = request.num_computed_tokens
            num_draft = max(0, start + num_new - request.num_tokens)    # verify: the last token, then drafts
            if num_draft:
                seqs.append(ScheduledSeq(request.request_id, [request.token_ids[start],
                                                              *request.spec_token_ids[:num_draft]], start,
                                         table(request.request_id), num_draft + 1, request.num_prompt_tokens,
                                         num_draft))
                continue
            final = start + num_new == request.num_tokens
            # every position of a prompt chunk when its prompt logprobs are wanted, else the last one to sample
            num_logits = num_new if request.needs_prompt_logprobs else 1 if final else 0
            seqs.append(ScheduledSeq(request.request_id, request.token_ids[start:start + num_new], start,
                                     table(request.request_id), num_logits, request.num_prompt_tokens))
        return ScheduledStep(StepBatch(seqs), list(plan.planned), plan.preempted, plan.preloads)

    def _usable_preload(self, request: Request, prefix_tokens: int) -> int:
        """Tokens of `request.preloaded_kv` that can be installed: its block must follow the prefix hit exactly and
        leave at least one token to compute (the one whose logits are sampled)."""
        if request.preloaded_kv is None:
            return 0
        num_tokens = request.preloaded_kv[1]
        full = (request.num_prompt_tokens // self.block_manager.block_size) * self.block_manager.block_size
        if prefix_tokens != full or not 0 < num_tokens < self.block_manager.block_size \
                or full + num_tokens >= request.num_tokens:
            return 0
        return num_tokens

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._waiting.appendleft(request)

    # ----- finishing

    def _append(self, request: Request, sampled: Sequence[int]) -> list[int]:
        new: list[int] = []
        for token_id in sampled:
            request.append_output(token_id)
            new.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status)
                break
        return new

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens > params.min_tokens and (
                (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
        del self._requests[request.request_id]

    def _check_fits(self, request: Request) -> None:
        max_len = self.config.max_model_len
        if request.num_tokens > max_len:
            raise ValueError(f"request {request.request_id!r}: {request.num_tokens} prompt tokens exceed "
                             f"max_model_len={max_len}")
        # The last sampled token never needs a KV slot.
        max_kv = min(request.num_tokens + request.params.max_tokens - 1, max_len)
        need = cdiv(max_kv, self.block_manager.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request {request.request_id!r} needs up to {need} KV blocks, the cache has "
                             f"{self.block_manager.num_blocks}: lower max_tokens or the prompt length")

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        assert all(r.status is RequestStatus.RUNNING for r in self._running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self._waiting)
        assert len(self._running) + len(self._waiting) == len(self._requests)
        assert [r.arrival_index for r in self._running] == sorted(r.arrival_index for r in self._running)
