"""The decode worker's gRPC service (DESIGN §2 steps 4-5): Decode, Generate, Abort, Health, Stats.

    Decode:   validate -> pull the handle's blocks (transfer -> store -> recompute) -> ReleaseKv to the prefill
              worker (in the background) -> engine thread: install + add request + first token as output
              -> stream the tokens after the first
    Generate: conditional disaggregation: load cached prefix blocks, prefill here, stream every token; with
              resume_output_ids (request migration) prefill prompt + those and stream what comes after them
A client that cancels (or whose deadline passes) aborts the request on the engine thread, freeing its blocks; an
Abort ends its stream with FINISH_REASON_ABORT. A request this worker fails (the engine step or the output handling
raised, admission broke, the worker shut down) ends its stream with an error status (INTERNAL, UNAVAILABLE), never
a finish reason. A hand-off that breaks in an unexpected way is recomputed, like one that cannot be read.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Iterator, Sequence

import grpc

from decode_worker.kv_pull import KvPuller, PullResult
from strata.cache_metrics import HandoffCollector
from engine.sampling_params import SamplingParams
from kvstore.hashing import hash_blocks
from kvstore.transfer import TransferConfig, create_agent
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.admission import admit
from worker_common.config import WorkerConfig
from worker_common.convert import (InvalidArgument, check_handle, check_prompt, check_resume, check_speculative,
                                   check_vocab, logprobs_to_proto, sampling_from_proto)
from worker_common.engine_loop import failure_of
from worker_common.engine_setup import EngineBundle
from worker_common.grpc_auth import attach_secret
from worker_common.kv_blocks import cacheable_blocks, store_computed_blocks
from worker_common.prefix_load import ChunkInstaller, fill_load_timings, load_prefix
from worker_common.server import GRPC_OPTIONS, WorkerBase
from worker_common.streaming import StreamingRequest, ms, wait_events
from worker_common.text_stream import TextStream, engine_params

log = logging.getLogger(__name__)
_RELEASE_TIMEOUT_S = 2.0


class DecodeService(WorkerBase):
    def __init__(self, config: WorkerConfig, bundle: EngineBundle | None = None, ep_group: Any = None) -> None:
        super().__init__(config, bundle, ep_group)
        self.agent = create_agent(TransferConfig(backend=config.transfer, host=config.host, advertise_host=config.advertise_host,
                                                secret=config.cluster_secret, tls_cert_file=config.fleet_tls_cert_file,
                                                tls_key_file=config.fleet_tls_key_file,
                                                tls_ca_file=config.fleet_tls_ca_file))  # fleet TLS: tcp over TLS
        self.puller = KvPuller(self.bundle, self.store, self.agent, config.transfer_deadline_s, self.transfer_costs)
        self._peers: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._peers_lock = threading.Lock()
        self._pull_lock = threading.Lock()  # NOTE: transfer agents are not thread-safe; one pull at a time

    # ---- Decode -------------------------------------------------------------------------------------------------

    def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext) -> Iterator:
        params, prompt = self._validate(request.sampling, request.token_ids, context)
        fingerprint = self.bundle.fingerprint_for(request.cache_salt)
        self._check_handle(request.kv, prompt, fingerprint, context)
        text = TextStream(self.bundle.tokenizer, prompt, params, request.skip_text)
        already = self._finished_by_first(params, text, request.first_token_id)
        tracked = StreamingRequest(text, params, self._store_blocks_of(fingerprint))
        self.claim(request.request_id, tracked, context)
        try:
            if already is not None:
                self._release_async(request.kv)
                yield self._final_without_decode(request, already)
                return
            num_blocks = min(len(request.kv.block_hashes),
                             cacheable_blocks(len(prompt) + 1, self.bundle.block_size))
            with self._pull_lock:
                pulled = self._pull(request.kv, num_blocks, prompt)
            self._release_async(request.kv)
            hashes = list(request.kv.block_hashes[:len(pulled.payloads)])
            # NOTE: the prompt's logprobs came with the first token from the prefill worker: not computed again
            installed = self._admit(tracked, request.request_id, prompt, replace(params, prompt_logprobs=None),
                                    fingerprint, hashes, pulled.payloads, context, outputs=[request.first_token_id],
                                    tail=pulled.tail)
            blocks = _block_counts(pulled, installed.num_blocks, len(request.kv.block_hashes))
            if pulled.tail is not None and installed.num_blocks == len(hashes):
                blocks["tail_tokens"] = request.kv.tail_tokens
            self.puller.counts.add(blocks_transferred=blocks["transferred"], blocks_from_store=blocks["from_store"],
                                   blocks_recomputed=blocks["recomputed"],
                                   tail_tokens_transferred=blocks.get("tail_tokens", 0))
            timings = common_pb2.Timings(transfer_ms=ms(pulled.elapsed_s))
            yield from self._stream(tracked, request.request_id, context, timings, len(prompt),
                                    request.cached_tokens, blocks, pulled.reason)
        finally:
            self.unclaim(request.request_id)

    def _pull(self, kv: common_pb2.KvHandle, num_blocks: int, prompt: list[int]) -> PullResult:
        """The handle's blocks; none (the engine recomputes them all) when the pull itself breaks."""
        started = time.perf_counter()
        try:
            return self.puller.pull(kv, num_blocks, prompt)
        except Exception as exc:  # noqa: BLE001 - KV that could not be had is recomputed, never guessed
            log.exception("pulling the KV hand-off failed; recomputing it")
            return PullResult([], 0, 0, 0, f"pull failed: {type(exc).__name__}: {exc}",
                              time.perf_counter() - started)

    def _check_handle(self, kv: common_pb2.KvHandle, prompt: list[int], fingerprint: bytes, context) -> None:
        try:
            check_handle(kv, len(prompt))
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if (kv.block_hashes or kv.HasField("tail")) and bytes(kv.namespace_fingerprint) != fingerprint:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "kv.namespace_fingerprint is not this worker's "
                          "namespace (model, KV layout/dtype and cache_salt must match)")
        if (kv.block_hashes or kv.HasField("tail")) and kv.block_size != self.bundle.block_size:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"kv.block_size is {kv.block_size}, this worker's "
                          f"is {self.bundle.block_size}")
        if kv.block_hashes and list(kv.block_hashes) != hash_blocks(fingerprint, prompt, kv.block_size)[
                :len(kv.block_hashes)]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kv.block_hashes do not chain from the prompt's tokens")

    def _finished_by_first(self, params: SamplingParams, text: TextStream, first: int) -> tuple | None:
        """Push the first token through the text (its delta was sent by the prefill worker); a finish reason and
        stop fields if it already ends the request (the router should not have called Decode then)."""
        delta = text.push([first], False)
        if delta.stop_str is not None:
            return common_pb2.FINISH_REASON_STOP, {"stop_str": delta.stop_str}
        eos = self.bundle.engine.scheduler.eos_token_ids
        if first in params.stop_token_ids:
            return common_pb2.FINISH_REASON_STOP, {"stop_token_id": first}
        if first in eos and not params.ignore_eos:
            return common_pb2.FINISH_REASON_STOP, {}
        if params.max_tokens == 1:
            return common_pb2.FINISH_REASON_LENGTH, {}
        return None

    @staticmethod
    def _final_without_decode(request: worker_pb2.DecodeRequest, already: tuple) -> worker_pb2.TokenChunk:
        reason, stop = already
        return worker_pb2.TokenChunk(
            request_id=request.request_id, finish_reason=reason,
            usage=common_pb2.Usage(prompt_tokens=len(request.token_ids), completion_tokens=1,
                                   cached_tokens=request.cached_tokens),
            blocks_recomputed=len(request.kv.block_hashes), kv_fallback_reason="not needed", **stop)

    def _release_async(self, kv: common_pb2.KvHandle) -> None:
        """Tell the prefill worker its lease can end; never waited on (a dead peer just lets the lease expire)."""
        if not kv.lease_id or not kv.lease_worker_address:
            return
        stub = self._peer(kv.lease_worker_address)
        future = stub.ReleaseKv.future(worker_pb2.ReleaseKvRequest(lease_id=kv.lease_id), timeout=_RELEASE_TIMEOUT_S)
        future.add_done_callback(lambda f: f.exception() and log.info("ReleaseKv failed: %s", f.exception()))

    def _peer(self, address: str) -> worker_pb2_grpc.WorkerStub:
        with self._peers_lock:
            stub = self._peers.get(address)
            if stub is None:
                channel = self.config.fleet_tls().channel(address, GRPC_OPTIONS)  # fleet TLS: mTLS to the peer
                stub = self._peers[address] = worker_pb2_grpc.WorkerStub(
                    attach_secret(channel, self.config.cluster_secret))
            return stub

    # ---- Generate (conditional disaggregation) ----------------------------------------------------------------

    def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.ServicerContext) -> Iterator:
        params, prompt = self._validate(request.sampling, request.token_ids, context)
        text = TextStream(self.bundle.tokenizer, prompt, params, request.skip_text)
        resume, carry = self._resume(request.resume_output_ids, prompt, params, text, context)
        if resume:  # NOTE: the prompt's logprobs went to the client with the first token, from the failed worker
            params = replace(params, prompt_logprobs=None)
        context_ids = prompt + resume           # | prompt | tokens the client has | -> computed (or loaded) here
        fingerprint = self.bundle.fingerprint_for(request.cache_salt)
        hashes = hash_blocks(fingerprint, context_ids, self.bundle.block_size)
        hashes = hashes[:cacheable_blocks(len(context_ids), self.bundle.block_size)]
        tracked = StreamingRequest(text, params, self._store_blocks_of(fingerprint), carry_text=carry)
        self.claim(request.request_id, tracked, context)
        try:
            started = time.perf_counter()
            chunks = ChunkInstaller(self.loop, hashes, context_ids)  # installs while later blocks are read
            loaded = load_prefix(self.bundle, self.store, hashes, fingerprint, request, on_chunk=chunks)
            load_s = time.perf_counter() - started
            try:
                installed = self._admit(tracked, request.request_id, prompt, params, fingerprint, hashes,
                                        loaded.payloads, context, outputs=resume)
            finally:
                chunks.finish()
                loaded.release()  # admission copied the payloads into the cache
            timings = common_pb2.Timings()
            fill_load_timings(timings, loaded, installed, chunks.install_s())
            yield from self._stream(tracked, request.request_id, context, timings, len(prompt), None, None, "",
                                    load_s=load_s)
        finally:
            self.unclaim(request.request_id)

    def _resume(self, resume_ids, prompt: list[int], params: SamplingParams, text: TextStream,
                context) -> tuple[list[int], str]:
        """A migrated request's tokens so far, checked, and their text (sent in front of the first new delta)."""
        if not resume_ids:
            return [], ""
        try:
            resume = check_resume(resume_ids, prompt, params, self.bundle.runner.vocab_size,
                                  self.bundle.max_model_len)
            return resume, text.resume(resume)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # ---- shared -----------------------------------------------------------------------------------------------

    def _store_blocks_of(self, fingerprint: bytes):
        """The finished request's full blocks into the store (DESIGN §2 step 5), except those a prefill worker
        handed over: it stored them already, and rewriting them cost the engine thread ~4 ms per 1k-token prompt."""
        def store(tracked: StreamingRequest) -> None:
            try:
                store_computed_blocks(self.bundle, self.store, tracked.request.token_ids, fingerprint,
                                      start=tracked.handed_over_blocks)
            except Exception:  # noqa: BLE001 - a store failure must not fail the request it served
                log.exception("writing the finished request's blocks to the store failed")
        return store

    def _validate(self, sampling, token_ids, context) -> tuple[SamplingParams, list[int]]:
        try:
            vocab = self.bundle.runner.vocab_size
            params = check_speculative(sampling_from_proto(sampling), self.bundle.engine.speculation)
            return check_vocab(params, vocab), check_prompt(token_ids, vocab, self.bundle.max_model_len)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _admit(self, tracked: StreamingRequest, request_id: str, prompt: list[int], params: SamplingParams,
               fingerprint: bytes, hashes: Sequence[bytes], payloads, context, outputs: Sequence[int] = (),
               tail: memoryview | None = None):
        try:
            installed = self.loop.post(lambda: admit(self.loop, tracked, request_id, prompt, engine_params(params),
                                                     fingerprint, hashes, payloads, outputs, tail)).result()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - installing the KV or adding the request broke: this worker's fault
            log.exception("admitting %s failed", request_id)
            self.fail_call(context, failure_of("admission failed", exc))
        context.add_callback(lambda: self.loop.abort(request_id, "client cancelled"))
        return installed

    def _stream(self, tracked: StreamingRequest, request_id: str, context, timings: common_pb2.Timings,
                prompt_tokens: int, cached_tokens: int | None, blocks: dict | None, reason: str,
                load_s: float = 0.0) -> Iterator[worker_pb2.TokenChunk]:
        finished = False
        try:
            for chunk in self._chunks(tracked, request_id, context, timings, prompt_tokens, cached_tokens, blocks,
                                      reason, load_s):
                finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield chunk
        finally:
            if not finished:  # the client left (its cancel callback may never fire if it left early)
                self.loop.abort(request_id, "client gone")

    def _chunks(self, tracked: StreamingRequest, request_id: str, context, timings: common_pb2.Timings,
                prompt_tokens: int, cached_tokens: int | None, blocks: dict | None, reason: str,
                load_s: float) -> Iterator[worker_pb2.TokenChunk]:
        for event in wait_events(tracked, context):
            if event.failure is not None:
                self.fail_call(context, event.failure)
            chunk = worker_pb2.TokenChunk(request_id=request_id, token_ids=event.token_ids, text_delta=event.text,
                                          logprobs=[logprobs_to_proto(e) for e in event.logprobs],
                                          prompt_logprobs=[logprobs_to_proto(e) for e in event.prompt_logprobs])
            if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                chunk.finish_reason = event.finish_reason
                for key, value in event.stop_fields.items():
                    setattr(chunk, key, value)
                # NOTE: a migrated request's prefix hit may reach into its outputs: usage counts prompt tokens
                cached = cached_tokens if cached_tokens is not None else min(event.cached_tokens, prompt_tokens)
                chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt_tokens,
                                                      completion_tokens=event.completion_tokens,
                                                      cached_tokens=cached))
                chunk.timings.CopyFrom(self._timings(tracked, timings, load_s, blocks is None))
                if blocks is not None:
                    chunk.blocks_transferred = blocks["transferred"]
                    chunk.blocks_from_store = blocks["from_store"]
                    chunk.blocks_recomputed = blocks["recomputed"]
                    chunk.tail_tokens_transferred = blocks.get("tail_tokens", 0)
                    chunk.kv_fallback_reason = reason
            yield chunk

    @staticmethod
    def _timings(tracked: StreamingRequest, timings: common_pb2.Timings, load_s: float,
                 generate: bool) -> common_pb2.Timings:
        first, last = tracked.first_output_at, tracked.last_output_at
        scheduled = tracked.scheduled_at or tracked.arrived_at
        if generate:
            timings.queue_ms = ms(scheduled - tracked.arrived_at)
            timings.prefill_ms = ms(load_s + (first or scheduled) - scheduled)
            timings.decode_ms = ms((last or 0) - (first or 0))
        else:
            timings.decode_ms = ms((last or tracked.arrived_at) - tracked.arrived_at)
        return timings

    def metrics_collectors(self) -> list:
        return [HandoffCollector(self.worker_id, self.puller.counts.snapshot)]

    def close(self) -> None:
        super().close()
        self.agent.close()


def _block_counts(pulled: PullResult, installed: int, total: int) -> dict:
    """How the handle's blocks were obtained, summing to `total`; device prefix-cache hits count as from the store
    (the device is the store's first tier, G1). Blocks pulled but not installed (no free block) are recomputed."""
    transferred = min(pulled.transferred, max(0, installed - pulled.on_device))
    return {"transferred": transferred, "from_store": installed - transferred, "recomputed": total - installed}
