"""A small Python client for the router's gRPC API (`strata.v1.Strata`).

    with StrataClient("127.0.0.1:50051") as client:
        for chunk in client.stream("def fibonacci(n):", max_tokens=32, seed=7):
            print(chunk.text_delta, end="")
        result = client.generate("Hello", max_tokens=8)        # Completion(text, token_ids, finish_reason, usage)
        client.cache_stats(); client.workers(); client.flush_cache(tier="host")
    StrataClient("router.example:50051", ca_file="ca.pem")      # a router whose gRPC port speaks TLS (--tls-*)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import grpc

from strata.v1 import common_pb2, router_pb2, router_pb2_grpc, strata_pb2, strata_pb2_grpc
from worker_common.grpc_auth import SECRET_METADATA, attach_metadata

DEFAULT_ADDRESS = "127.0.0.1:50051"
API_KEY_ENV = "STRATA_API_KEY"
CA_FILE_ENV = "STRATA_CA_FILE"
_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE,
          "both": common_pb2.WORKER_ROLE_BOTH}


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)


def default_address() -> str:
    """`STRATA_ROUTER` or the embedded default's gRPC port."""
    return os.environ.get("STRATA_ROUTER", DEFAULT_ADDRESS)


@dataclass
class Completion:
    """A whole `Generate` stream, gathered."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: common_pb2.Usage | None = None
    metrics: strata_pb2.RequestMetrics | None = None
    stop_str: str | None = None
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)   # with logprobs=N
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., with N


def sampling(max_tokens: int | None = None, temperature: float = 0.0, top_p: float | None = None, top_k: int = 0,
             seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
             ignore_eos: bool = False, repetition_penalty: float | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, logprobs: int | None = None,
             logit_bias: dict[int, float] | None = None, min_tokens: int = 0,
             prompt_logprobs: int | None = None, speculative: str = "") -> common_pb2.SamplingParams:
    """`speculative`: "" (the decode worker's own drafter), "off", or "ngram" / "draft" / "eagle"."""
    msg = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, stop=list(stop),
                                    stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                    min_tokens=min_tokens, speculative=speculative)
    if repetition_penalty is not None:
        msg.repetition_penalty = repetition_penalty
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    if top_p is not None:
        msg.top_p = top_p
    if seed is not None:
        msg.seed = seed
    if logprobs is not None:
        msg.logprobs = logprobs
    if prompt_logprobs is not None:
        msg.prompt_logprobs = prompt_logprobs
    msg.logit_bias.update(logit_bias or {})
    return msg


def tls_credentials(ca_file: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials that verify the router against the PEM CA certificate(s) in `ca_file` (None: `$STRATA_CA_FILE`;
    neither: None, plain text). ValueError naming the file when it cannot be read."""
    path = os.environ.get(CA_FILE_ENV, "") if ca_file is None else ca_file
    if not path:
        return None
    try:
        return grpc.ssl_channel_credentials(root_certificates=Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"ca_file {path!r} cannot be read: {exc.strerror}") from None


class StrataClient:
    def __init__(self, address: str | None = None, timeout_s: float = 60.0, api_key: str | None = None,
                 cluster_secret: str = "", credentials: grpc.ChannelCredentials | None = None,
                 ca_file: str | None = None, registry_address: str | None = None) -> None:
        """`api_key`: sent as `authorization: Bearer KEY` on every call (None: `$STRATA_API_KEY`, if set);
        `cluster_secret`: the fleet secret, for the Registry calls (`drain`) of a router that has one;
        `credentials`: dial over TLS with these (`grpc.ssl_channel_credentials`); without them, `ca_file` (None:
        `$STRATA_CA_FILE`, if set): TLS verifying the router against that PEM CA; neither: plain text.
        `registry_address`: the router's registry port (`--registry-port`), where `registry` / `drain` go (None:
        `address`, a router whose Registry shares its gRPC port); dialled with the same credentials."""
        self.address = address or default_address()
        self.timeout_s = timeout_s
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        credentials = credentials or tls_credentials(ca_file)
        self._channel = _channel(self.address, credentials)
        bearer = f"Bearer {key}" if key else ""
        self.stub = strata_pb2_grpc.StrataStub(attach_metadata(self._channel, [("authorization", bearer)]))
        self._registry_channel = (_channel(registry_address, credentials)
                                  if registry_address and registry_address != self.address else None)
        secret = [(SECRET_METADATA, cluster_secret)]
        self.registry = router_pb2_grpc.RegistryStub(attach_metadata(self._registry_channel or self._channel, secret))

    # ---- generation -------------------------------------------------------------------------------------------

    def request(self, prompt: str | Sequence[int], *, model: str = "", request_id: str = "", cache_salt: str = "",
                include_metrics: bool = False, **sampling_kwargs) -> strata_pb2.GenerateRequest:
        req = strata_pb2.GenerateRequest(model=model, request_id=request_id, cache_salt=cache_salt,
                                         sampling=sampling(**sampling_kwargs),
                                         stream_options=strata_pb2.StreamOptions(include_metrics=include_metrics))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def stream(self, prompt: str | Sequence[int], timeout_s: float | None = None,
               **kwargs) -> Iterator[strata_pb2.GenerateResponse]:
        """The raw chunk stream (cancel it with `.cancel()` on the returned call)."""
        return self.stub.Generate(self.request(prompt, **kwargs), timeout=timeout_s or self.timeout_s)

    def generate(self, prompt: str | Sequence[int], timeout_s: float | None = None, **kwargs) -> Completion:
        out = Completion()
        for chunk in self.stream(prompt, timeout_s, **kwargs):
            out.request_id = chunk.request_id
            out.text += chunk.text_delta
            out.token_ids.extend(chunk.token_ids)
            out.logprobs.extend(chunk.logprobs)
            out.prompt_logprobs.extend(chunk.prompt_logprobs)
            if chunk.finish_reason:
                out.finish_reason = common_pb2.FinishReason.Name(chunk.finish_reason).removeprefix(
                    "FINISH_REASON_").lower()
                out.usage = chunk.usage
                out.metrics = chunk.metrics if chunk.HasField("metrics") else None
                out.stop_str = chunk.stop_str if chunk.HasField("stop_str") else None
        return out

    def abort(self, request_id: str) -> None:
        self.stub.Abort(strata_pb2.AbortRequest(request_id=request_id), timeout=self.timeout_s)

    # ---- operators --------------------------------------------------------------------------------------------

    def models(self) -> list[common_pb2.ModelInfo]:
        return list(self.stub.ListModels(strata_pb2.ListModelsRequest(), timeout=self.timeout_s).models)

    def workers(self, role: str | None = None, include_dead: bool = False) -> list[common_pb2.WorkerInfo]:
        req = strata_pb2.ListWorkersRequest(role=_ROLES.get(role or "", 0), include_dead=include_dead)
        return list(self.stub.ListWorkers(req, timeout=self.timeout_s).workers)

    def cache_stats(self, worker_ids: Sequence[str] = (), tier: str = "") -> list[common_pb2.WorkerCacheStats]:
        req = strata_pb2.GetCacheStatsRequest(worker_ids=list(worker_ids), tier=tier)
        return list(self.stub.GetCacheStats(req, timeout=self.timeout_s).workers)

    def evict_cache(self, worker_id: str = "", tier: str = "", block_hashes: Sequence[bytes] = (), num_bytes: int = 0,
                    demote: bool = False) -> list[common_pb2.CacheAdminResult]:
        req = common_pb2.EvictCacheRequest(worker_id=worker_id, tier=tier, block_hashes=list(block_hashes),
                                           bytes=num_bytes, demote=demote)
        return list(self.stub.EvictCache(req, timeout=self.timeout_s).results)

    def flush_cache(self, worker_id: str = "", tier: str = "") -> list[common_pb2.CacheAdminResult]:
        req = common_pb2.FlushCacheRequest(worker_id=worker_id, tier=tier)
        return list(self.stub.FlushCache(req, timeout=self.timeout_s).results)

    def drain(self, worker_id: str) -> common_pb2.WorkerInfo:
        return self.registry.Drain(router_pb2.DrainRequest(worker_id=worker_id), timeout=self.timeout_s).worker

    # ---- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()
        if self._registry_channel is not None:
            self._registry_channel.close()

    def __enter__(self) -> "StrataClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
