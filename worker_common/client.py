"""A minimal disaggregated client: Prefill on one worker, Decode on another (what the router does per request),
or Generate on the decode worker when the conditional policy says so. Tests and benchmarks use it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from engine.sampling_params import SamplingParams
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.convert import sampling_to_proto


@dataclass
class Completion:
    """The whole answer of one request, and where its time went (client-side clocks, ms)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    prefill: worker_pb2.PrefillResponse | None = None
    last_chunk: worker_pb2.TokenChunk | None = None
    logprobs: list = field(default_factory=list)   # common_pb2.TokenLogprobs per token, when asked for
    prompt_logprobs: list = field(default_factory=list)   # per prompt token after the first, when asked for
    ttft_ms: float = 0.0              # call start to the first token in the client's hands
    second_token_ms: float = 0.0      # call start to the second token (first decode step included)
    total_ms: float = 0.0


def disaggregated(prefill: worker_pb2_grpc.WorkerStub, decode: worker_pb2_grpc.WorkerStub, request_id: str,
                  prompt: Sequence[int], params: SamplingParams, cache_salt: str = "", timeout_s: float = 60.0,
                  lease_ms: int = 0) -> Completion:
    sampling = sampling_to_proto(params)
    started = time.perf_counter()
    first = prefill.Prefill(worker_pb2.PrefillRequest(request_id=request_id, token_ids=list(prompt),
                                                      sampling=sampling, cache_salt=cache_salt, lease_ms=lease_ms),
                            timeout=timeout_s)
    out = Completion(request_id, [first.first_token_id], first.first_text_delta, first.finish_reason,
                     prefill=first, ttft_ms=_ms_since(started))
    if first.HasField("first_logprobs"):
        out.logprobs.append(first.first_logprobs)
    out.prompt_logprobs.extend(first.prompt_logprobs)
    if first.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        out.total_ms = out.ttft_ms
        return out
    stream = decode.Decode(worker_pb2.DecodeRequest(request_id=request_id, token_ids=list(prompt),
                                                    first_token_id=first.first_token_id, kv=first.kv,
                                                    sampling=sampling, cache_salt=cache_salt,
                                                    cached_tokens=first.cached_tokens), timeout=timeout_s)
    _consume(out, stream, started)
    return out


def local(decode: worker_pb2_grpc.WorkerStub, request_id: str, prompt: Sequence[int], params: SamplingParams,
          cache_salt: str = "", timeout_s: float = 60.0) -> Completion:
    """Conditional disaggregation: the decode worker prefills itself."""
    started = time.perf_counter()
    stream = decode.Generate(worker_pb2.WorkerGenerateRequest(request_id=request_id, token_ids=list(prompt),
                                                              sampling=sampling_to_proto(params),
                                                              cache_salt=cache_salt), timeout=timeout_s)
    out = Completion(request_id)
    _consume(out, stream, started)
    return out


def _consume(out: Completion, stream, started: float) -> None:
    for chunk in stream:
        out.token_ids.extend(chunk.token_ids)
        out.logprobs.extend(chunk.logprobs)
        out.prompt_logprobs.extend(chunk.prompt_logprobs)
        out.text += chunk.text_delta
        if chunk.token_ids:
            out.ttft_ms = out.ttft_ms or _ms_since(started)
            if len(out.token_ids) >= 2 and not out.second_token_ms:
                out.second_token_ms = _ms_since(started)
        if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            out.finish_reason, out.usage, out.last_chunk = chunk.finish_reason, chunk.usage, chunk
    out.total_ms = _ms_since(started)


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0
