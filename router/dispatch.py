"""The router's request path (DESIGN §2 steps 1-2): tokenize, hash, route; the in-flight table (`Abort`,
ALREADY_EXISTS) and the worker channels. One request's run through the workers is `router.request_run`.

    GenerateParams ─tokenize─> ids ─hash_blocks(namespace + salt)─> hashes ─policy(index.match, load view)─>
    RouteDecision ─> RequestRun.events(): Prefill + Decode, or Generate (conditional disaggregation)
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import grpc

from router.cost_model import CostModelConfig
from router.events_feed import SharedIndex
from router.policy import NoWorkerError, Policy, RouteDecision, RouteRequest
from router.registry import WorkerRegistry
from router.request_run import RequestRun, StepFailed
from router.served_model import ServedModel
from router.validation import ApiError, GenerateParams, ModelLimits, check_prompt, effective_salt, invalid
from strata.v1 import common_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


# ----------------------------------------------------------------------------------------------- worker stubs

class WorkerChannels:
    """One channel per worker address, reused by every request."""

    def __init__(self) -> None:
        self._stubs: dict[str, tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        with self._lock:
            if address not in self._stubs:
                channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._stubs[address] = (channel, worker_pb2_grpc.WorkerStub(channel))
            return self._stubs[address][1]

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()


class RequestObserver(Protocol):
    """Told about every finished request (metrics)."""

    def on_finish(self, door: str, outcome: str, usage: common_pb2.Usage | None, ttft_s: float | None,
                  total_s: float, route: str, retries: int) -> None: ...


class _NullObserver:
    def on_finish(self, *args, **kwargs) -> None:
        pass


@dataclass(frozen=True)
class DispatchConfig:
    """`decode_s_per_token`: the decode work charged to a worker per requested token, for the load guard's
    recent-work sum (the same estimate `benchmarks/routing_sim.py` charges)."""

    max_attempts: int = 3
    default_timeout_s: float = 600.0
    lease_ms: int = 0              # 0 = the prefill worker's default
    decode_s_per_token: float = 0.02

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.default_timeout_s <= 0:
            raise ValueError(f"max_attempts must be >= 1 and default_timeout_s > 0, got {self.max_attempts}, "
                             f"{self.default_timeout_s}")
        if self.decode_s_per_token < 0:
            raise ValueError(f"decode_s_per_token must be >= 0, got {self.decode_s_per_token}")


# ------------------------------------------------------------------------------------------------ the dispatcher

class Dispatcher:
    """Routes and runs requests; owns the in-flight table (`Abort`, ALREADY_EXISTS)."""

    def __init__(self, models: dict[str, ServedModel], registry: WorkerRegistry, index: SharedIndex,
                 policy: Policy, cost: dict[str, CostModelConfig], config: DispatchConfig = DispatchConfig(),
                 observer: RequestObserver | None = None, max_inflight: int = 1024) -> None:
        self.models, self.registry, self.index, self.policy, self.cost = models, registry, index, policy, cost
        self.config, self.observer = config, observer or _NullObserver()
        self.channels = WorkerChannels()
        self.max_inflight = max_inflight
        self._inflight: dict[str, RequestRun] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._warned_namespace: set[str] = set()

    @property
    def limits(self) -> dict[str, ModelLimits]:
        return {m.id: m.limits for m in self.models.values()}

    def start(self, params: GenerateParams, identity: str = "", timeout_s: float | None = None,
              door: str = "grpc") -> RequestRun:
        """Tokenize and check the prompt, claim the request id; `run.events()` then routes and streams."""
        model = self.models[params.model]
        prompt = model.tokenize(params)
        grpc_door = door == "grpc"
        sampling = check_prompt(params, prompt, model.limits, ids_param="prompt.token_ids" if grpc_door else "prompt",
                                bias_param="sampling.logit_bias" if grpc_door else "logit_bias",
                                stop_ids_param="sampling.stop_token_ids" if grpc_door else "stop_token_ids")
        self._check_drafter(model.id, sampling.speculative, "sampling.speculative" if grpc_door else "speculative")
        default = self.config.default_timeout_s
        timeout = default if timeout_s is None else min(timeout_s, default)
        run = RequestRun(self, params, model, prompt, sampling, effective_salt(params.cache_salt, identity),
                         timeout, door)
        with self._lock:
            if params.request_id in self._inflight:
                raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {params.request_id!r} is already in "
                                                               f"flight", "request_id")
            if len(self._inflight) >= self.max_inflight:
                raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the router has {self.max_inflight} requests "
                                                                   f"in flight; retry with backoff")
            self._inflight[params.request_id] = run
        return run

    def _check_drafter(self, model_id: str, wanted: str | None, param: str) -> None:
        """A drafter that no READY decode worker of the model loaded is the caller's error, refused before anything
        runs (never a request that hangs, or that a prefill worker computes for nothing). "off" always works."""
        if wanted in (None, "off"):
            return
        loaded = self.registry.speculative_methods(model_id)
        if loaded is not None and wanted not in loaded:
            runs = f"run {', '.join(sorted(loaded))}" if loaded else "do not speculate"
            raise invalid(param, f"{param} {wanted!r} is not available: the decode workers of model {model_id!r} "
                                 f"{runs} (start them with --speculative {wanted}); 'off' always works")

    def abort(self, request_id: str) -> None:
        with self._lock:
            run = self._inflight.get(request_id)
        if run is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"no in-flight request has request_id {request_id!r}",
                           "request_id")
        run.abort()

    def finish(self, run: RequestRun, outcome: str, usage: common_pb2.Usage | None) -> None:
        with self._lock:
            if self._inflight.get(run.request_id) is run:
                del self._inflight[run.request_id]
        ttft = None if run.progress.first_token_at is None else run.progress.first_token_at - run.started
        self.observer.on_finish(run.door, outcome, usage, ttft, time.monotonic() - run.started, run.route,
                                run.retries)

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def route(self, run: RequestRun, excluded: set[str]) -> RouteDecision:
        """The policy's choice among READY workers not yet tried; a decoder alone when the prefill pool is out
        (or tokens already reached the client)."""
        ns = run.model.namespace
        drafter = run.sampling.speculative if run.sampling.speculative not in ("", "off") else None
        view = self.registry.load_view(run.model.id, exclude=excluded, kv=(ns.model_fingerprint, ns.kv_dtype),
                                       speculative=drafter)
        with self._lock:
            self._seq += 1
            seq = self._seq
        request = RouteRequest(tuple(run.hashes), len(run.prompt), seq)
        try:
            decision = self.policy(request, self.index.match(run.hashes), view, self.cost[run.model.id])
        except NoWorkerError:
            decoders = view.decode_workers()
            if not decoders:
                raise ApiError(grpc.StatusCode.UNAVAILABLE, f"no ready decode worker for model {run.model.id!r} "
                               f"(tried: {sorted(excluded) or 'none'}); retry with backoff") from None
            d = min(decoders, key=lambda w: (w.backlog_s, w.queue_len, w.worker_id))
            decision = RouteDecision(d.worker_id, d.worker_id, False, 0.0, 0, "no prefill worker: local")
        log.debug("route %s: %s", run.request_id, decision)
        return decision

    def address_of(self, worker_id: str) -> str:
        try:
            return self.registry.get(worker_id).record.address
        except KeyError:
            raise StepFailed(worker_id, grpc.StatusCode.UNAVAILABLE, "worker left the registry") from None

    def check_namespace(self, worker_id: str, kv: common_pb2.KvHandle, salt: str, model: ServedModel) -> None:
        """Warn once per worker when its KV namespace is not the one the router hashes with (routing would then
        never see a cached prefix; correctness is unaffected, workers verify every block)."""
        if not kv.block_hashes or worker_id in self._warned_namespace:
            return
        if bytes(kv.namespace_fingerprint) != model.namespace.with_salt(salt).fingerprint():
            self._warned_namespace.add(worker_id)
            log.warning("worker %s hashes blocks in another namespace than the router (model %s: %s); "
                        "prefix-aware routing will not see its cache", worker_id, model.id, model.namespace)

    def close(self) -> None:
        with self._lock:
            runs = list(self._inflight.values())
        for run in runs:
            run.cancel()
        self.channels.close()



__all__ = ["Dispatcher", "DispatchConfig", "GRPC_OPTIONS", "RequestObserver", "WorkerChannels"]
