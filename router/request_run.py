"""One request's run through the workers (DESIGN §2 steps 3-5), streamed back as `GenerateResponse`s.

    disaggregated:  PrefillStream(p) ─first token─> client, then KvHandle;  Decode(d, KvHandle) ─tokens─> client
    local:          Generate(d) ─tokens─> client                          (conditional disaggregation)

A step that fails (worker gone, UNAVAILABLE, RESOURCE_EXHAUSTED, INTERNAL) is retried on another worker; when no
attempt is left (or no other worker), the client gets an error status, INTERNAL when the last worker failed the
request itself, else UNAVAILABLE: a failed request never ends with a finish reason. A request that two workers
failed themselves (INTERNAL, UNKNOWN) fails with that error rather than meet more workers. One failed step never
takes a worker out of routing: the worker's `Health` is asked, and only a worker that does not answer is reported
gone (heartbeats do the rest).

Every request runs with a seed (drawn by validation when the caller set none) and sampling is keyed by (seed, output
position), so a request migrates: after tokens reached the client, a retry sends `Generate` with those tokens as
`resume_output_ids` to another decode worker, which computes prompt + them (from the store where it holds them) and
samples on from the next position; the router forwards only what the client does not have yet:

    client has:  | t0 t1 t2 |                    d2 resumes:   | t0 t1 t2 | t3 t4 ... |
                                                              (computed)  (forwarded)

Cancellation: `cancel()` (client gone, deadline) cancels the worker call in flight and tells the worker to Abort;
`abort()` (the `Abort` RPC) asks the worker to Abort, so its stream ends with FINISH_REASON_ABORT, which is forwarded
as the last chunk (the call is cancelled after a grace period if it does not end by itself).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import grpc

from kvstore.hashing import hash_blocks
from router.policy import RouteDecision
from router.served_model import ServedModel
from router.validation import ApiError, GenerateParams
from strata.v1 import common_pb2, strata_pb2, worker_pb2
from worker_common.convert import sampling_to_proto

if TYPE_CHECKING:
    from router.dispatch import Dispatcher

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}
# NOTE: not INTERNAL: a worker that answers INTERNAL is alive and failed one request (a request that breaks every
# worker it meets must not take them all out of routing).
# The worker failed this request itself (its handler or engine step raised): two of these end the request.
_REQUEST_FAULT = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
_MAX_REQUEST_FAULTS = 2
_CONFIRM_GONE_S = 2.0
_ABORT_GRACE_S = 2.0
UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


class StepFailed(Exception):
    def __init__(self, worker_id: str, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{worker_id}: {code.name}: {detail}")
        self.worker_id, self.code = worker_id, code


@dataclass
class _Progress:
    """What the client already has: a retry forwards only what lies beyond it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)   # common_pb2.TokenLogprobs per token, when asked for
    text: str = ""
    first_chunk_sent: bool = False
    prompt_logprobs_sent: bool = False
    first_token_at: float | None = None


class RequestRun:
    """One in-flight request. `events()` yields `GenerateResponse`s; `cancel()` / `abort()` from other threads."""

    def __init__(self, dispatcher: "Dispatcher", params: GenerateParams, model: ServedModel, prompt: list[int],
                 sampling, salt: str, timeout_s: float, door: str) -> None:
        self.d, self.params, self.model, self.prompt, self.door = dispatcher, params, model, prompt, door
        self.sampling = sampling_to_proto(sampling)
        self.salt = salt
        self.request_id = params.request_id
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.hashes = hash_blocks(model.namespace.with_salt(salt).fingerprint(), prompt, model.block_size)
        self.progress = _Progress()
        self.retries = 0
        self.migrations = 0                    # retries that resumed after tokens the client already had
        self.client = ""                       # who sent it, for per-client limits (set by the dispatcher)
        self.route = ""
        self.cancelled = threading.Event()
        self.aborted = threading.Event()
        self._lock = threading.Lock()
        self._call = None                      # the worker call in flight (future or stream)
        self._call_worker: tuple[str, str] | None = None  # (worker id, address)

    # ---- control, any thread ------------------------------------------------------------------------------------

    def cancel(self) -> None:
        """The client is gone (or its deadline passed): stop the worker call and free the worker's KV."""
        self.cancelled.set()
        self._stop_worker(cancel_call=True)

    def abort(self) -> None:
        """`Abort` RPC: the worker ends the stream with FINISH_REASON_ABORT; cancel it if it does not in time."""
        self.aborted.set()
        self._stop_worker(cancel_call=False)

    def _stop_worker(self, cancel_call: bool) -> None:
        with self._lock:
            call, worker = self._call, self._call_worker
        if worker is not None:
            future = self.d.channels.stub(worker[1]).Abort.future(
                worker_pb2.WorkerAbortRequest(request_id=self.request_id), timeout=_ABORT_GRACE_S)
            future.add_done_callback(lambda f: f.exception() and log.info("Abort on %s: %s", worker[0], f.exception()))
        if call is not None:
            if cancel_call:
                call.cancel()
            else:
                threading.Timer(_ABORT_GRACE_S, call.cancel).start()

    def _attach(self, call, worker_id: str, address: str) -> None:
        with self._lock:
            self._call, self._call_worker = call, (worker_id, address)
        if self.cancelled.is_set():
            call.cancel()
        elif self.aborted.is_set():
            self._stop_worker(cancel_call=False)

    def _detach(self) -> None:
        with self._lock:
            self._call, self._call_worker = None, None

    # ---- the stream ---------------------------------------------------------------------------------------------

    def events(self) -> Iterator[strata_pb2.GenerateResponse]:
        outcome, last = "error", None
        try:
            for chunk in self._attempts():
                last = chunk
                yield chunk
            if last is not None and last.finish_reason != UNSET:
                outcome = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        except ApiError as exc:
            outcome = exc.code.name.lower()
            raise
        finally:
            if outcome == "error" and self.cancelled.is_set():
                outcome = "cancelled"
            self.d.finish(self, outcome, last.usage if last is not None and last.HasField("usage") else None)

    def _attempts(self) -> Iterator[strata_pb2.GenerateResponse]:
        excluded: set[str] = set()
        last: StepFailed | None = None
        faults = 0
        for _ in range(self.d.config.max_attempts):
            decision = self._route(excluded, last)
            self.route = "disaggregated" if decision.disaggregated else "local"
            try:
                if decision.disaggregated and not self.progress.token_ids:
                    yield from self._disaggregated(decision)
                else:
                    yield from self._local(decision)
                return
            except _Aborted:
                # NOTE: the worker's own ABORT chunk did not arrive in time (the call was cancelled after the
                # grace period): end the stream the way the contract says anyway.
                yield self._final(common_pb2.FINISH_REASON_ABORT, common_pb2.Usage(
                    prompt_tokens=len(self.prompt), completion_tokens=len(self.progress.token_ids)))
                return
            except StepFailed as failed:
                self._check_stopped()
                excluded.add(failed.worker_id)
                self._confirm_gone(failed)
                last = failed
                faults += failed.code in _REQUEST_FAULT
                if faults >= _MAX_REQUEST_FAULTS:
                    raise _failed(f"request failed on {faults} workers", last)
                self.retries += 1
                log.warning("request %s: step failed (%s); retrying on another worker", self.request_id, failed)
        raise _failed(f"request failed on {self.d.config.max_attempts} workers", last)

    def _confirm_gone(self, failed: StepFailed) -> None:
        """A failed step names a suspect: ask its `Health` (in the background) and report it gone only when it does
        not answer, so one request's error never takes a healthy worker out of routing."""
        try:
            address = self.d.address_of(failed.worker_id)
        except StepFailed:
            return  # already out of the registry

        def answered(future) -> None:
            if future.cancelled() or future.exception() is not None:
                self.d.registry.report_failure(failed.worker_id, str(failed))
        future = self.d.channels.stub(address).Health.future(worker_pb2.HealthRequest(), timeout=_CONFIRM_GONE_S)
        future.add_done_callback(answered)

    def _route(self, excluded: set[str], last: StepFailed | None) -> RouteDecision:
        """The next worker(s) to try; after a failed step, no worker left is that step's failure."""
        try:
            return self.d.route(self, excluded)
        except ApiError as exc:
            if last is None or exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            raise _failed(exc.message, last) from None

    def _disaggregated(self, decision: RouteDecision) -> Iterator[strata_pb2.GenerateResponse]:
        p, d = decision.prefill_worker, decision.decode_worker
        answers = self._prefill(decision)
        try:
            first = next(answers)
            if first.finish_reason == common_pb2.FINISH_REASON_ABORT:
                yield self._final(common_pb2.FINISH_REASON_ABORT, common_pb2.Usage(prompt_tokens=len(self.prompt)))
                return
            chunk = self._chunk([first.first_token_id], first.first_text_delta,
                                [first.first_logprobs] if first.HasField("first_logprobs") else (),
                                first.prompt_logprobs)
            if first.finish_reason != UNSET:
                chunk.finish_reason = first.finish_reason
                chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(self.prompt), completion_tokens=1,
                                                      cached_tokens=first.cached_tokens))
                _copy_stop(first, chunk)
                self._metrics(chunk, p, d, True, first.timings, None)
                yield chunk
                return
            yield chunk                       # the first token leaves before the hand-off is ready
            handoff = next(answers, None)
        finally:
            answers.close()                   # the prefill call is over: its worker's backlog ends here
        if handoff is not None and handoff.finish_reason == common_pb2.FINISH_REASON_ABORT:   # Abort, meanwhile
            yield self._final(common_pb2.FINISH_REASON_ABORT,
                              common_pb2.Usage(prompt_tokens=len(self.prompt), completion_tokens=1))
            return
        if handoff is None:
            self._check_stopped()
            raise StepFailed(p, grpc.StatusCode.UNAVAILABLE, "PrefillStream ended without the KV handle")
        timings = common_pb2.Timings()
        timings.CopyFrom(first.timings)
        timings.store_ms = handoff.timings.store_ms
        request = worker_pb2.DecodeRequest(
            request_id=self.request_id, token_ids=self.prompt, first_token_id=first.first_token_id,
            kv=self._own_handle(p, handoff.kv),
            sampling=self.sampling, cache_salt=self.salt, skip_text=self.params.skip_text,
            cached_tokens=first.cached_tokens)
        yield from self._stream(d, "Decode", request, prefill=(p, timings), work_s=self._decode_work_s())

    def _prefill(self, decision: RouteDecision) -> Iterator[worker_pb2.PrefillResponse]:
        """Prefill on the decision's prefill worker, charging it the plan's work (fetch + prefill: its own seconds,
        not the queue wait) and passing the plan's cap on store reads. Yields the first token's answer, then
        (unless that ends the request) the one with the KV handle: `PrefillStream`'s two messages, or `Prefill`'s
        one answer twice for a worker without it."""
        p = decision.prefill_worker
        address = self.d.address_of(p)
        request = worker_pb2.PrefillRequest(request_id=self.request_id, token_ids=self.prompt, sampling=self.sampling,
                                            cache_salt=self.salt, lease_ms=self.d.config.lease_ms,
                                            decode_worker_id=decision.decode_worker,
                                            max_load_blocks=decision.max_load_blocks,
                                            expected_cached_blocks=self._expected_blocks(decision))
        stub = self.d.channels.stub(address)
        self.d.registry.begin(p, decision.work_s, prefill_s=decision.work_s)
        call, done = None, False
        try:
            if address not in self.d.unary_prefill:
                call = stub.PrefillStream(request, timeout=self._remaining())
                self._attach(call, p, address)
                try:
                    first = next(call, None)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    self.d.unary_prefill.add(address)      # an older worker: Prefill from now on
                    call = None
                else:
                    if first is None:
                        self._check_stopped()
                        raise StepFailed(p, grpc.StatusCode.UNAVAILABLE, "PrefillStream ended without an answer")
                    done = first.finish_reason != UNSET      # the stream's last answer
                    yield first
                    if done:
                        return
                    handoff = next(call, None)
                    done = True
                    if handoff is not None:
                        self.d.check_namespace(p, handoff.kv, self.salt, self.model)
                        yield handoff
                    return
            future = stub.Prefill.future(request, timeout=self._remaining())
            self._attach(future, p, address)
            response = future.result()
            done = True
            self.d.check_namespace(p, response.kv, self.salt, self.model)
            yield response
            yield response
        except grpc.RpcError as exc:
            raise self._translate(exc, p) from None
        finally:
            if call is not None and not done:
                call.cancel()   # the consumer stopped early (client gone) or the step failed: free the worker
            self._detach()
            self.d.registry.end(p)

    def _own_handle(self, worker_id: str, kv: common_pb2.KvHandle) -> common_pb2.KvHandle:
        """The handle as the decode worker may use it: its blocks must be the prefill worker's own, and ReleaseKv
        goes to that worker's registered address (never to a peer the handle names). A handle that names another
        worker's blocks is dropped: the decode worker then recomputes the prompt."""
        kv.lease_worker_address = self.d.address_of(worker_id) if kv.lease_id else ""
        locations = [*kv.blocks, *([kv.tail] if kv.HasField("tail") else [])]
        if all(b.worker_id == worker_id for b in locations):
            return kv
        log.warning("request %s: prefill worker %s answered a KV handle naming other workers' blocks; dropped "
                    "(the decode worker recomputes)", self.request_id, worker_id)
        return common_pb2.KvHandle(namespace_fingerprint=kv.namespace_fingerprint, block_size=kv.block_size)

    def _local(self, decision: RouteDecision) -> Iterator[strata_pb2.GenerateResponse]:
        """`Generate` on the decision's decode worker: the whole request, or its migration (resume after the
        tokens the client has)."""
        request = worker_pb2.WorkerGenerateRequest(request_id=self.request_id, token_ids=self.prompt,
                                                   sampling=self.sampling, cache_salt=self.salt,
                                                   skip_text=self.params.skip_text,
                                                   max_load_blocks=decision.max_load_blocks,
                                                   expected_cached_blocks=self._expected_blocks(decision),
                                                   resume_output_ids=self.progress.token_ids)
        if self.progress.token_ids:
            self.migrations += 1
        yield from self._stream(decision.decode_worker, "Generate", request, prefill=None,
                                work_s=decision.work_s + self._decode_work_s(), prefill_s=decision.work_s)

    def _expected_blocks(self, decision: RouteDecision) -> int:
        """Leading blocks the plan loads rather than computes (the worker's shared-tier index may lag behind)."""
        return decision.cached_tokens // self.model.block_size

    def _decode_work_s(self) -> float:
        return self.sampling.max_tokens * self.d.config.decode_s_per_token

    def _stream(self, worker_id: str, method: str, request, prefill, work_s: float,
                prefill_s: float = 0.0) -> Iterator[strata_pb2.GenerateResponse]:
        """Forward a worker's TokenChunk stream, skipping what the client already has (a rerun after a retry)."""
        address = self.d.address_of(worker_id)
        # What the worker's stream continues from: Decode after the first token (its text is the client's); a
        # migrated Generate after every token the client has, its first text_delta starting with their text.
        resumed = 1 if method == "Decode" else len(request.resume_output_ids)
        rerun_tokens: list[int] = list(self.progress.token_ids[:resumed])
        rerun_logprobs: list = list(self.progress.logprobs[:resumed])
        rerun_text = self.progress.text if method == "Decode" else ""
        prompt_logprobs: Sequence = ()
        self.d.registry.begin(worker_id, work_s, prefill_s)
        call, finished = None, False
        try:
            call = getattr(self.d.channels.stub(address), method)(request, timeout=self._remaining())
            self._attach(call, worker_id, address)
            for wc in call:
                rerun_tokens.extend(wc.token_ids)
                rerun_logprobs.extend(wc.logprobs)
                prompt_logprobs = prompt_logprobs or wc.prompt_logprobs
                rerun_text += wc.text_delta
                new_ids = rerun_tokens[len(self.progress.token_ids):]
                new_text = rerun_text[len(self.progress.text):]
                finished = wc.finish_reason != UNSET
                if not new_ids and not finished:
                    continue
                chunk = self._chunk(new_ids, new_text, rerun_logprobs[len(self.progress.logprobs):], prompt_logprobs)
                if finished:
                    chunk.finish_reason = wc.finish_reason
                    chunk.usage.CopyFrom(wc.usage)
                    _copy_stop(wc, chunk)
                    p_id, p_timings = prefill if prefill else ("", None)
                    self._metrics(chunk, p_id, worker_id, prefill is not None, p_timings, wc)
                yield chunk
                if finished:
                    return
        except grpc.RpcError as exc:
            raise self._translate(exc, worker_id) from None
        finally:
            if call is not None and not finished:
                call.cancel()  # the consumer stopped early (client gone) or the step failed: free the worker
            self._detach()
            self.d.registry.end(worker_id)
        self._check_stopped()
        raise StepFailed(worker_id, grpc.StatusCode.UNAVAILABLE, f"{method} stream ended without a last chunk")

    # ---- pieces ---------------------------------------------------------------------------------------------

    def _chunk(self, token_ids: Sequence[int], text: str, logprobs: Sequence = (),
               prompt_logprobs: Sequence = ()) -> strata_pb2.GenerateResponse:
        chunk = strata_pb2.GenerateResponse(request_id=self.request_id, token_ids=token_ids, text_delta=text,
                                            logprobs=logprobs)
        self.progress.logprobs.extend(logprobs)
        if prompt_logprobs and not self.progress.prompt_logprobs_sent:  # once, whichever attempt computed them
            chunk.prompt_logprobs.extend(prompt_logprobs)
            self.progress.prompt_logprobs_sent = True
        if not self.progress.first_chunk_sent:
            self.progress.first_chunk_sent = True
            if self.params.include_prompt_token_ids:
                chunk.prompt_token_ids.extend(self.prompt)
        if token_ids and self.progress.first_token_at is None:
            self.progress.first_token_at = time.monotonic()
        self.progress.token_ids.extend(token_ids)
        self.progress.text += text
        return chunk

    def _final(self, reason: int, usage: common_pb2.Usage) -> strata_pb2.GenerateResponse:
        chunk = self._chunk([], "")
        chunk.finish_reason = reason
        chunk.usage.CopyFrom(usage)
        return chunk

    def _metrics(self, chunk: strata_pb2.GenerateResponse, p: str, d: str, disaggregated: bool,
                 prefill_timings: common_pb2.Timings | None, last: worker_pb2.TokenChunk | None) -> None:
        if not self.params.include_metrics:
            return
        m = chunk.metrics
        m.prefill_worker_id, m.decode_worker_id, m.disaggregated = (p if disaggregated else ""), d, disaggregated
        if prefill_timings is not None:
            m.timings.CopyFrom(prefill_timings)
        if last is not None:
            t = last.timings
            m.timings.transfer_ms, m.timings.decode_ms = t.transfer_ms, t.decode_ms
            if not disaggregated:  # the decode worker prefilled: its own queue, prefill and onboarding figures
                m.timings.queue_ms, m.timings.prefill_ms = t.queue_ms, t.prefill_ms
                m.timings.load_lookup_ms, m.timings.load_read_ms = t.load_lookup_ms, t.load_read_ms
                m.timings.load_verify_ms, m.timings.load_install_ms = t.load_verify_ms, t.load_install_ms
                m.timings.blocks_by_tier.update(t.blocks_by_tier)
            m.blocks_transferred, m.blocks_from_store = last.blocks_transferred, last.blocks_from_store
            m.blocks_recomputed = last.blocks_recomputed
            m.tail_tokens_transferred = last.tail_tokens_transferred
        if self.progress.first_token_at is not None:
            m.timings.ttft_ms = (self.progress.first_token_at - self.started) * 1000.0

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return left

    def _check_stopped(self) -> None:
        if self.cancelled.is_set():
            raise ApiError(grpc.StatusCode.CANCELLED, "the client cancelled the request")

    def _translate(self, exc: grpc.RpcError, worker_id: str) -> Exception:
        """A worker's error as the router's: retryable ones as StepFailed, the caller's faults as ApiError."""
        code, detail = exc.code(), exc.details() or ""
        if self.cancelled.is_set():
            return ApiError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= self.deadline:
            return ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        if self.aborted.is_set():
            return _Aborted()
        if code in _RETRYABLE:
            return StepFailed(worker_id, code, detail)
        return ApiError(code, detail)


def _failed(what: str, last: StepFailed | None) -> ApiError:
    """The error status of a request no worker could serve: INTERNAL when the last one failed it, else UNAVAILABLE."""
    code = grpc.StatusCode.INTERNAL if last is not None and last.code == grpc.StatusCode.INTERNAL \
        else grpc.StatusCode.UNAVAILABLE
    return ApiError(code, f"{what}; last error: {last if last is not None else 'no attempt made'}")


class _Aborted(ApiError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.ABORTED, "aborted")


def _copy_stop(source, chunk: strata_pb2.GenerateResponse) -> None:
    kind = source.WhichOneof("stop_reason")
    if kind is not None:
        setattr(chunk, kind, getattr(source, kind))

