"""The prefill worker's gRPC service (DESIGN §2 step 3): Prefill, PrefillStream, ReleaseKv, Abort, Health, Stats.

    Prefill: validate -> load cached prefix blocks (device, else store) -> engine thread: install + add request
             (max_tokens=1, chunked prefill by the scheduler) -> first token -> export blocks under a lease
             -> PrefillResponse(first token, text delta, KvHandle, timings)
    PrefillStream: the same, answered in two messages: the first token as soon as it is sampled, then the
             KvHandle once the export is done (the router forwards the token meanwhile)

A Prefill the client aborted answers FINISH_REASON_ABORT; one this worker failed (the engine step, the output
handling or the export raised, or the worker shut down) answers an error status (INTERNAL, UNAVAILABLE), never a
finish reason.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, NamedTuple, Sequence

import grpc

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.hashing import hash_blocks
from kvstore.transfer import TransferConfig, create_agent
from prefill_worker.kv_export import KvExporter
from strata.v1 import common_pb2, worker_pb2
from worker_common.admission import admit
from worker_common.config import WorkerConfig
from worker_common.convert import (InvalidArgument, check_prompt, check_vocab, logprobs_to_proto,
                                   sampling_from_proto, stop_reason_fields)
from worker_common.engine_loop import Failure, Tracked, failure_of
from worker_common.engine_setup import EngineBundle
from worker_common.handoff_pool import HandoffPool
from worker_common.kv_blocks import cacheable_blocks, slot_bytes, store_computed_blocks
from worker_common.leases import LeaseTable
from worker_common.prefix_load import ChunkInstaller, fill_load_timings, load_prefix
from worker_common.registration import advertised
from worker_common.server import WorkerBase
from worker_common.streaming import ms
from worker_common.text_stream import TextStream, engine_params

log = logging.getLogger(__name__)
_WAIT_S = 0.1


class Admitted(NamedTuple):
    """A request's prefix load and admission, for its timings."""
    loaded: Any                 # prefix_load.LoadedPrefix
    installed: Any              # what `admit` returned
    chunks: ChunkInstaller
    load_s: float


class PrefillJob(Tracked):
    """Engine-thread side of one Prefill: decides whether the first token ends the request, else exports the KV."""

    def __init__(self, service: PrefillService, request_id: str, prompt: list[int], hashes: Sequence[bytes],
                 fingerprint: bytes, params: SamplingParams, ttl_s: float) -> None:
        super().__init__(None)
        self.service, self.request_id, self.prompt, self.hashes = service, request_id, prompt, hashes
        self.fingerprint, self.params, self.ttl_s = fingerprint, params, ttl_s
        self.text = TextStream(service.bundle.tokenizer, prompt, params)
        self.done = threading.Event()
        self.first = threading.Event()      # set with `first_response` (or on abort / failure), before the export
        self.response: worker_pb2.PrefillResponse | None = None
        self.first_response: worker_pb2.PrefillResponse | None = None
        self.abort_reason = ""
        self.failure: Failure | None = None
        self.first_output_at: float | None = None
        self.store_s = 0.0
        self._lock = threading.Lock()
        self._abandoned = False             # its handler ended without handing a lease over (`abandon`)

    def on_output(self, output: RequestOutput, now: float) -> bool:
        if not output.new_token_ids:
            return False  # a prompt chunk whose prompt logprobs were recorded: the first token comes later
        self.first_output_at = now
        token = output.new_token_ids[-1]
        engine_stop = output.finish_reason == "stop"
        length = self.params.max_tokens == 1 or len(self.prompt) + 1 >= self.service.bundle.max_model_len
        delta = self.text.push([token], engine_stop or length)
        response = worker_pb2.PrefillResponse(request_id=self.request_id, first_token_id=token,
                                              first_text_delta=delta.text, worker_id=self.service.worker_id,
                                              cached_tokens=output.num_cached_tokens)
        if output.new_logprobs:
            response.first_logprobs.CopyFrom(logprobs_to_proto(output.new_logprobs[-1]))
        if output.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_proto(e) for e in output.prompt_logprobs[1:])
        ends_here = delta.stop_str is not None or engine_stop or length
        if delta.stop_str is not None or engine_stop:
            response.finish_reason = common_pb2.FINISH_REASON_STOP
            for key, value in stop_reason_fields(delta.stop_str, token, self.params).items():
                setattr(response, key, value)
        elif length:
            response.finish_reason = common_pb2.FINISH_REASON_LENGTH
        else:
            first = worker_pb2.PrefillResponse()
            first.CopyFrom(response)
            self.first_response = first
            self.first.set()                  # PrefillStream sends the first token now, the handle after the export
            export = self.service.exporter.export(self.prompt, self.hashes, self.fingerprint, self.ttl_s,
                                                  self.request.freed_block_ids)
            response.kv.CopyFrom(export.handle)
            self.store_s = export.store_s
            response.timings.store_ms = ms(self.store_s)
        with self._lock:
            self.response, abandoned = response, self._abandoned
        if abandoned and response.kv.lease_id:
            self.service.leases.release(response.kv.lease_id)  # its client went away during the export
        if ends_here:
            self.first_response = response
            self.first.set()
            # NOTE: the answer leaves first and the blocks are written after it, still on this thread before any
            # later step can reuse them (a 2,000-token prompt's write took ~12 ms of its TTFT when it went first).
            # The write counts as pending meanwhile, so a caller waiting for the store to settle waits for it.
            with self.service.store.writing():
                self.done.set()
                self._store_prompt(token)
        else:
            self.done.set()
        return True

    def abandon(self) -> None:
        """Its handler ends without handing the lease over (the client went away, or gRPC dropped the stream with
        the hand-off unsent): the lease is released now, or by the export as it grants it. Any thread."""
        with self._lock:
            self._abandoned, response = True, self.response
        if response is not None and response.kv.lease_id:
            self.service.leases.release(response.kv.lease_id)

    def _store_prompt(self, token: int) -> None:
        """The request ends here (nothing to hand off): its prompt's full blocks still go to the store, so the
        next request with this prefix hits every tier (an export would have written them)."""
        started = time.perf_counter()
        try:
            store_computed_blocks(self.service.bundle, self.service.store, [*self.prompt, token], self.fingerprint)
        except Exception:  # noqa: BLE001 - a store failure must not fail the request it served
            log.exception("writing %s's blocks to the store failed", self.request_id)
        self.store_s = time.perf_counter() - started

    def on_abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.first.set()
        self.done.set()

    def on_fail(self, failure: Failure) -> None:
        self.failure = failure
        self.first.set()
        self.done.set()


class PrefillService(WorkerBase):
    def __init__(self, config: WorkerConfig, bundle: EngineBundle | None = None, ep_group: Any = None) -> None:
        super().__init__(config, bundle, ep_group)
        self.agent = create_agent(TransferConfig(backend=config.transfer, host=config.host, advertise_host=config.advertise_host,
                                                secret=config.cluster_secret, tls_cert_file=config.fleet_tls_cert_file,
                                                tls_key_file=config.fleet_tls_key_file,
                                                tls_ca_file=config.fleet_tls_ca_file))  # fleet TLS: tcp over TLS
        self.pool = HandoffPool(self.agent, slot_bytes(self.bundle), config.handoff_bytes)
        self.leases = LeaseTable(self.agent, self.pool)
        self.exporter = KvExporter(self.bundle, self.store, self.agent, self.pool, self.leases, self.worker_id)

    def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext):
        job = self._job(request, context)
        try:
            admitted = self._admit(job, context, request)
            if not self._wait(job, context, job.done):
                job.abandon()
                return worker_pb2.PrefillResponse()
            self._check(job, context)
            if job.response is None:  # its client aborted it
                return self._aborted(job)
            self._release_if_gone(job.response, context)
            self._fill_timings(job, job.response.timings, admitted)
            return job.response
        finally:
            self.unclaim(request.request_id)

    def PrefillStream(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext):
        """Prefill, the first token first: the hand-off's export (pinning, encoding and storing the blocks) runs
        while the router already forwards the token."""
        job = self._job(request, context)
        handed = False      # the hand-off (or the end: no lease) reached the client
        try:
            admitted = self._admit(job, context, request)
            if not self._wait(job, context, job.first):
                return
            self._check(job, context)
            if job.first_response is None:
                yield self._aborted(job)
                handed = True
                return
            first = worker_pb2.PrefillResponse()
            first.CopyFrom(job.first_response)     # its own copy: a request ending here shares `response`
            self._fill_timings(job, first.timings, admitted)
            yield first
            if first.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                handed = True
                return
            if not self._wait(job, context, job.done):
                return
            self._check(job, context)
            if job.response is None:  # aborted during the export: no handle
                yield self._aborted(job)
                handed = True
                return
            self._release_if_gone(job.response, context)
            handoff = worker_pb2.PrefillResponse(request_id=job.request_id, worker_id=self.worker_id,
                                                 cached_tokens=first.cached_tokens)
            handoff.kv.CopyFrom(job.response.kv)
            handoff.timings.store_ms = job.response.timings.store_ms
            # NOTE: from here the lease is the client's. gRPC drops this generator at the yield both when the client
            # went away first (the hand-off unsent) and when it cancels the stream once it has the hand-off (a router
            # may): the two cannot be told apart here, so a client gone in that instant leaves the lease to its TTL.
            handed = True
            yield handoff
        finally:
            # NOTE: a client gone before the hand-off (noticed by `_wait`, or by gRPC, which stops asking for answers
            # and drops this generator at the first one's yield: GeneratorExit) leaves a lease nobody will read
            if not handed:
                job.abandon()
            self.unclaim(request.request_id)

    def _job(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> PrefillJob:
        """The request checked and claimed (call `unclaim` when done)."""
        # NOTE: as the router and peers reach this worker, not a wildcard bind (the decode worker sends ReleaseKv there)
        self.exporter.worker_address = advertised(self.address, self.config.advertise_host or self.config.host)
        try:
            params = check_vocab(sampling_from_proto(request.sampling), self.bundle.runner.vocab_size)
            prompt = check_prompt(request.token_ids, self.bundle.runner.vocab_size, self.bundle.max_model_len)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        fingerprint = self.bundle.fingerprint_for(request.cache_salt)
        hashes = hash_blocks(fingerprint, prompt, self.bundle.block_size)
        ttl_s = request.lease_ms / 1000.0 if request.lease_ms else self.config.lease_ttl_s
        job = PrefillJob(self, request.request_id, prompt, hashes, fingerprint, params, ttl_s)
        self.claim(request.request_id, job, context)
        return job

    def _admit(self, job: PrefillJob, context: grpc.ServicerContext,
               plan: worker_pb2.PrefillRequest) -> Admitted:
        """Load the cached prefix and admit the request on the engine thread. `plan`: the request, for the
        router's plan of the cached prefix (`load_prefix`)."""
        started = time.perf_counter()
        cacheable = job.hashes[:cacheable_blocks(len(job.prompt), self.bundle.block_size)]
        chunks = ChunkInstaller(self.loop, cacheable, job.prompt)  # installs while later blocks are read
        loaded = load_prefix(self.bundle, self.store, cacheable, job.fingerprint, plan, on_chunk=chunks)
        load_s = time.perf_counter() - started
        # The engine stops after the first token; stop strings stay on the worker's text side. One token is never
        # speculated: the request's `speculative` is its decode worker's business (checked there and by the router).
        params = dataclasses.replace(engine_params(job.params), max_tokens=1, min_tokens=min(job.params.min_tokens, 1),
                                     speculative=None)
        try:
            installed = self.loop.post(lambda: admit(self.loop, job, job.request_id, job.prompt, params,
                                                     job.fingerprint, cacheable, loaded.payloads)).result()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - installing the loaded blocks failed: this worker's fault
            log.exception("admitting %s failed", job.request_id)
            self.fail_call(context, failure_of("admission failed", exc))
        finally:
            chunks.finish()
            loaded.release()  # admission ran on the engine thread and copied the payloads into the cache
        context.add_callback(lambda: self.loop.abort(job.request_id, "client cancelled"))
        return Admitted(loaded, installed, chunks, load_s)

    def _wait(self, job: PrefillJob, context: grpc.ServicerContext, event: threading.Event) -> bool:
        """Until `event`; False (the request aborted) when the client went away first."""
        while not event.wait(_WAIT_S):
            if not context.is_active():
                self.loop.abort(job.request_id, "client gone")  # NOTE: idempotent with the cancel callback
                return False
        return True

    def _check(self, job: PrefillJob, context: grpc.ServicerContext) -> None:
        if job.failure is not None:
            self.fail_call(context, job.failure)

    def _aborted(self, job: PrefillJob) -> worker_pb2.PrefillResponse:
        return worker_pb2.PrefillResponse(request_id=job.request_id, worker_id=self.worker_id,
                                          finish_reason=common_pb2.FINISH_REASON_ABORT)

    def _release_if_gone(self, response: worker_pb2.PrefillResponse, context: grpc.ServicerContext) -> None:
        if response.kv.lease_id and not context.is_active():
            self.leases.release(response.kv.lease_id)  # nobody will read it: do not wait for the TTL

    def _fill_timings(self, job: PrefillJob, timings: common_pb2.Timings, admitted: Admitted) -> None:
        scheduled = job.scheduled_at or job.arrived_at
        timings.queue_ms = ms(scheduled - job.arrived_at)
        timings.prefill_ms = ms(admitted.load_s + (job.first_output_at or scheduled) - scheduled)
        fill_load_timings(timings, admitted.loaded, admitted.installed, admitted.chunks.install_s())

    def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest, context) -> worker_pb2.ReleaseKvResponse:
        return worker_pb2.ReleaseKvResponse(released=self.leases.release(request.lease_id))

    def close(self) -> None:
        super().close()
        self.leases.close()
        self.pool.close()
        self.agent.close()
