"""The router's request path (DESIGN §2 steps 1-2): tokenize, hash, route; the in-flight table (`Abort`,
ALREADY_EXISTS) and the worker channels. One request's run through the workers is `router.request_run`.

    GenerateParams ─tokenize─> ids ─hash_blocks(namespace + salt)─> hashes ─policy(index.match, load view)─>
    RouteDecision ─> RequestRun.events(): Prefill + Decode, or Generate (conditional disaggregation)
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from router.admission import AdmissionConfig, check_fleet, with_room
from router.cost_model import CostModelConfig
from router.events_feed import SharedIndex
from router.policy import NoWorkerError, Policy, RouteDecision, RouteRequest, local_only
from router.registry import WorkerRegistry
from router.request_run import RequestRun, StepFailed
from router.served_model import ServedModel
from router.validation import ApiError, GenerateParams, ModelLimits, check_prompt, effective_salt, invalid
from strata.v1 import common_pb2, worker_pb2_grpc
from worker_common.fleet_tls import NO_TLS, FleetTls
from worker_common.grpc_auth import attach_secret

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


# ----------------------------------------------------------------------------------------------- worker stubs

class WorkerChannels:
    """One channel per worker address, reused by every request; every call carries the fleet secret (if any), over
    fleet TLS (mTLS: the router's certificate shown, the worker's verified against the fleet CA) when it is on."""

    def __init__(self, cluster_secret: str = "", tls: FleetTls = NO_TLS) -> None:
        self._secret, self._tls = cluster_secret, tls
        self._stubs: dict[str, tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        with self._lock:
            if address not in self._stubs:
                channel = attach_secret(self._tls.channel(address, GRPC_OPTIONS), self._secret)
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
    recent-work sum (the same estimate `benchmarks/routing_sim.py` charges). `isolate_tenants`: every request is
    salted from its caller's identity (API keys on: its tenant), a cache_salt or not. `cluster_secret`: what the
    worker stubs show the workers (empty = none). `fleet_tls`: the worker channels' TLS files (off: plain text)."""

    max_attempts: int = 3
    default_timeout_s: float = 600.0
    lease_ms: int = 0              # 0 = the prefill worker's default
    decode_s_per_token: float = 0.02
    isolate_tenants: bool = False
    cluster_secret: str = field(default="", repr=False)
    fleet_tls: FleetTls = NO_TLS
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_streams_per_client: int = 0   # requests one client may have in flight; 0 = no limit

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.default_timeout_s <= 0:
            raise ValueError(f"max_attempts must be >= 1 and default_timeout_s > 0, got {self.max_attempts}, "
                             f"{self.default_timeout_s}")
        if self.max_streams_per_client < 0:
            raise ValueError(f"max_streams_per_client must be >= 0 (0 = no limit), got {self.max_streams_per_client}")
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
        self.channels = WorkerChannels(self.config.cluster_secret, self.config.fleet_tls)
        self.max_inflight = max_inflight
        self._inflight: dict[str, RequestRun] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._warned_namespace: set[str] = set()
        self.unary_prefill: set[str] = set()     # worker addresses that answered PrefillStream UNIMPLEMENTED
        self._draining = False
        self._idle = threading.Condition(self._lock)

    @property
    def limits(self) -> dict[str, ModelLimits]:
        return {m.id: m.limits for m in self.models.values()}

    def start(self, params: GenerateParams, identity: str = "", timeout_s: float | None = None,
              door: str = "grpc", peer: str = "") -> RequestRun:
        """Tokenize and check the prompt, claim the request id; `run.events()` then routes and streams. `identity`
        (a tenant, a bearer token, or "anonymous") and `peer` (the caller's address) name the client whose requests
        in flight `max_streams_per_client` bounds."""
        model = self.models[params.model]
        client = identity if identity and identity != "anonymous" else f"peer:{peer}"
        num_decoders = len(self.registry.load_view(model.id).decode_workers())
        with self._lock:  # NOTE: before tokenizing: under overload a refusal costs next to nothing
            self._check_room(model, client, num_decoders)
        prompt = model.tokenize(params)
        grpc_door = door == "grpc"
        sampling = check_prompt(params, prompt, model.limits, ids_param="prompt.token_ids" if grpc_door else "prompt",
                                bias_param="sampling.logit_bias" if grpc_door else "logit_bias",
                                stop_ids_param="sampling.stop_token_ids" if grpc_door else "stop_token_ids")
        self._check_drafter(model.id, sampling.speculative, "sampling.speculative" if grpc_door else "speculative")
        default = self.config.default_timeout_s
        timeout = default if timeout_s is None else min(timeout_s, default)
        salt = effective_salt(params.cache_salt, identity, self.config.isolate_tenants)
        run = RequestRun(self, params, model, prompt, sampling, salt, timeout, door)
        run.client = client
        with self._lock:
            self._check_room(model, client, num_decoders)
            if params.request_id in self._inflight:
                raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {params.request_id!r} is already in "
                                                               f"flight", "request_id")
            self._inflight[params.request_id] = run
        return run

    def _check_room(self, model: ServedModel, client: str, num_decoders: int) -> None:
        """Lock held. Whether a new request may start: not while draining, not past the client's share, the
        model's bounded queue (`router.admission`) or the router's own limit."""
        if self._draining:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down (draining the requests in "
                                                        "flight); retry on another router", retry_after_s=1.0)
        limit = self.config.max_streams_per_client
        if limit and sum(1 for r in self._inflight.values() if r.client == client) >= limit:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this client has {limit} requests in flight, the "
                                                               f"router's --max-streams-per-client; retry when one "
                                                               f"ends", retry_after_s=1.0)
        check_fleet(sum(1 for r in self._inflight.values() if r.model is model), num_decoders,
                    self.config.admission, model.id)
        if len(self._inflight) >= self.max_inflight:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the router has {self.max_inflight} requests in "
                                                               f"flight (--max-inflight); retry with backoff",
                           retry_after_s=1.0)

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
            if not self._inflight:
                self._idle.notify_all()
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
        if not excluded:  # NOTE: a retry or migration of an admitted request is never refused for load
            view = with_room(view, self.config.admission, run.model.id)
        with self._lock:
            self._seq += 1
            seq = self._seq
        request = RouteRequest(tuple(run.hashes), len(run.prompt), seq)
        match, cost = self.index.match(run.hashes), self.cost[run.model.id]
        try:
            decision = self.policy(request, match, view, cost)
        except NoWorkerError:
            if not view.decode_workers():
                raise ApiError(grpc.StatusCode.UNAVAILABLE, f"no ready decode worker for model {run.model.id!r} "
                               f"(tried: {sorted(excluded) or 'none'}); retry with backoff") from None
            decision = local_only(self.policy)(request, match, view, cost)
        log.debug("route %s: %s", run.request_id, decision)
        return decision

    def preview(self, model: ServedModel, hashes: list, num_tokens: int) -> RouteDecision | None:
        """The policy's choice for a prompt among the model's READY Strata workers, running nothing (the mixed
        fleet's comparison, `router.mixed_routing`); None when no Strata worker can take it."""
        ns = model.namespace
        view = self.registry.load_view(model.id, kv=(ns.model_fingerprint, ns.kv_dtype))
        try:
            return self.policy(RouteRequest(tuple(hashes), num_tokens), self.index.match(hashes), view,
                               self.cost[model.id])
        except NoWorkerError:
            return None

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

    def begin_drain(self) -> None:
        """Refuse new requests from now on (UNAVAILABLE, with a retry hint); those in flight go on."""
        with self._lock:
            self._draining = True

    def drain(self, timeout_s: float) -> int:
        """Graceful shutdown: refuse new requests (UNAVAILABLE) and wait up to `timeout_s` for those in flight to
        finish; how many are still running (`close` cancels them)."""
        with self._lock:
            self._draining = True
            self._idle.wait_for(lambda: not self._inflight, timeout=timeout_s)
            return len(self._inflight)

    def close(self) -> None:
        with self._lock:
            runs = list(self._inflight.values())
        for run in runs:
            run.cancel()
        self.channels.close()



__all__ = ["Dispatcher", "DispatchConfig", "GRPC_OPTIONS", "RequestObserver", "WorkerChannels"]
