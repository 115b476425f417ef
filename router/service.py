"""The router's gRPC face: the public `Strata` service, the workers' `Registry`, grpc health and reflection.

    clients ──Strata──> StrataService ──> Dispatcher (dispatch.py) ──Worker──> workers
    workers ──Registry─> RegistryService ──> WorkerRegistry (registry.py) ──listeners──> EventsFeed, index
    `--worker ADDR` ──> WorkerProbe: Health + Stats as the worker's registration and heartbeat

Errors follow docs/api.md: every `ApiError` becomes its status with its message.
"""
from __future__ import annotations

import logging
import math
import threading
from concurrent import futures
from typing import Callable, Iterable, NamedTuple, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.auth import STRATA_SERVICE, ApiKeys, api_key_check
from router.cost_model import STORE_TIERS, TRANSFER, MeasuredCosts, MeasuredRead
from router.dispatch import GRPC_OPTIONS, Dispatcher
from router.served_model import ServedModel
from router.events_feed import EventsFeed
from router.index import SHARED_TIERS, TIERS
from router.registry import (LoadFigures, ModelFacts, SpecFigures, UnknownWorker, WorkerRecord, WorkerRegistry,
                             WorkerView)
from router.grpc_decode import DecodeErrors
from router.validation import MAX_REQUEST_BYTES, ApiError, from_grpc
from strata.v1 import common_pb2, router_pb2, router_pb2_grpc, strata_pb2, strata_pb2_grpc, worker_pb2
from worker_common.grpc_auth import REGISTRY_SERVICE, CallGuard, metadata_value, secret_check

log = logging.getLogger(__name__)

ROLE_NAME = {common_pb2.WORKER_ROLE_PREFILL: "prefill", common_pb2.WORKER_ROLE_DECODE: "decode",
              common_pb2.WORKER_ROLE_BOTH: "both"}
_ROLE_PROTO = {v: k for k, v in ROLE_NAME.items()}
_STATE_PROTO = {"ready": common_pb2.WORKER_STATE_READY, "draining": common_pb2.WORKER_STATE_DRAINING,
                "dead": common_pb2.WORKER_STATE_DEAD}
_FANOUT_TIMEOUT_S = 5.0
# EvictCache / FlushCache without a caller's deadline: thousands of blocks on S3 take a while, a hang still ends.
_ADMIN_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------------------------ conversions

def record_from_proto(info: common_pb2.WorkerInfo, probed: bool = False) -> WorkerRecord:
    """INVALID_ARGUMENT naming the field for a registration that misses a required one."""
    for name in ("id", "address"):
        if not getattr(info, name):
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"worker.{name} must not be empty", f"worker.{name}")
    if info.role not in ROLE_NAME:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "worker.role must be PREFILL, DECODE or BOTH, got "
                       f"{common_pb2.WorkerRole.Name(info.role)}", "worker.role")
    if not info.model.id:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "worker.model.id must not be empty", "worker.model.id")
    kv = info.model.kv
    model = ModelFacts(info.model.id, info.model.max_model_len, kv.model_fingerprint, kv.kv_layout, kv.kv_dtype,
                       kv.block_size)
    return WorkerRecord(info.id, ROLE_NAME[info.role], info.address, model, info.kv_events_endpoint,
                        info.kv_replay_endpoint, tuple(info.transfer_backends), tuple(info.tiers), probed,
                        tuple(info.speculative.methods))


def spec_from_proto(stats: common_pb2.SpeculativeStats, present: bool) -> SpecFigures | None:
    """A heartbeat's (or Stats') speculative counters; None when the worker sent none (it does not speculate)."""
    if not present:
        return None
    return SpecFigures(stats.method, stats.num_speculative_tokens, stats.verifies, stats.draft_tokens,
                       stats.accepted_tokens, stats.emitted_tokens, stats.draft_seconds, stats.verify_seconds)


def spec_to_proto(spec: SpecFigures | None, methods: Sequence[str]) -> common_pb2.SpeculativeStats | None:
    """What `ListWorkers` reports: the drafters from the registration, the counters from the last heartbeat."""
    if spec is None and not methods:
        return None
    spec = spec or SpecFigures(method="")
    return common_pb2.SpeculativeStats(
        method=spec.method, methods=list(methods), num_speculative_tokens=spec.num_speculative_tokens,
        verifies=spec.verifies, draft_tokens=spec.draft_tokens, accepted_tokens=spec.accepted_tokens,
        emitted_tokens=spec.emitted_tokens, draft_seconds=spec.draft_seconds, verify_seconds=spec.verify_seconds,
        acceptance_rate=spec.acceptance_rate, mean_accepted_length=spec.mean_accepted_length)


def load_from_proto(load: common_pb2.WorkerLoad) -> LoadFigures:
    return LoadFigures(load.running, load.waiting, load.kv_usage, load.pending_prefill_tokens, load.running_tokens,
                       load.backlog_s, measured_from_proto(load))


def measured_from_proto(load: common_pb2.WorkerLoad) -> MeasuredCosts | None:
    """The costs a worker measured (WorkerLoad's measured fields), None when it reports none. A figure that is not
    usable (no samples, NaN, a negative or infinite latency or rate, a bandwidth <= 0) is left out: the cost
    model's default prices that tier (or the prefill) instead."""
    reads = []
    for tier in STORE_TIERS:
        latency, bandwidth, samples = (getattr(load, f"{tier}_read_{name}")
                                       for name in ("latency_s", "bytes_per_s", "samples"))
        if samples and 0 <= latency < math.inf and bandwidth > 0:
            reads.append(MeasuredRead(tier, latency, bandwidth, samples))
    transfer = None
    if load.transfer_read_samples and 0 <= load.transfer_read_latency_s < math.inf \
            and load.transfer_read_bytes_per_s > 0:
        transfer = MeasuredRead(TRANSFER, load.transfer_read_latency_s, load.transfer_read_bytes_per_s,
                                load.transfer_read_samples)
    rate = load.prefill_tokens_per_s if 0 < load.prefill_tokens_per_s < math.inf else 0.0
    if not reads and not rate and transfer is None:
        return None
    return MeasuredCosts(rate, load.prefill_rate_samples if rate else 0, tuple(reads), transfer)


def measured_fields(measured: MeasuredCosts | None) -> dict[str, float]:
    """WorkerLoad's measured fields from what the registry keeps (what the router prices the worker with, before its
    sample thresholds): the inverse of `measured_from_proto`."""
    if measured is None:
        return {}
    out: dict[str, float] = {"prefill_tokens_per_s": measured.prefill_tokens_per_s,
                             "prefill_rate_samples": measured.prefill_samples}
    for read in measured.reads + ((measured.transfer,) if measured.transfer is not None else ()):
        out |= {f"{read.tier}_read_latency_s": read.latency_s, f"{read.tier}_read_bytes_per_s": read.bytes_per_s,
                f"{read.tier}_read_samples": read.samples}
    return out


def view_to_proto(view: WorkerView, models: dict[str, ServedModel]) -> common_pb2.WorkerInfo:
    r, load = view.record, view.load
    served = models.get(r.model.id)
    model = served.info() if served is not None else common_pb2.ModelInfo(id=r.model.id,
                                                                           max_model_len=r.model.max_model_len)
    return common_pb2.WorkerInfo(
        id=r.id, role=_ROLE_PROTO[r.role], address=r.address, state=_STATE_PROTO[view.state], model=model,
        load=common_pb2.WorkerLoad(running=load.running, waiting=load.waiting, kv_usage=load.kv_usage,
                                   pending_prefill_tokens=load.pending_prefill_tokens,
                                   running_tokens=load.running_tokens, backlog_s=load.backlog_s,
                                   **measured_fields(load.measured)),
        kv_events_endpoint=r.kv_events_endpoint, kv_replay_endpoint=r.kv_replay_endpoint,
        transfer_backends=r.transfer_backends, tiers=r.tiers, last_heartbeat_unix_ms=view.last_heartbeat_unix_ms,
        speculative=spec_to_proto(view.speculative, r.speculative_methods))


def _abort_with(context: grpc.ServicerContext, exc: ApiError) -> None:
    if exc.retry_after_s is not None:  # gRPC's own retry hint (gRFC A6), honoured by retrying clients
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(int(exc.retry_after_s * 1000))),))
    context.abort(exc.code, exc.message)


def _peer_host(peer: str) -> str:
    """The caller's host from gRPC's peer string (`ipv4:10.0.0.5:4312`, `ipv6:[::1]:4312`, `unix:...`)."""
    kind, _, rest = peer.partition(":")
    return rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else peer


def _identity(context: grpc.ServicerContext, keys: ApiKeys) -> str:
    """Who is calling, for the cache salt: its tenant with API keys on (`router.auth`), else its bearer header."""
    return keys.identity(metadata_value(context.invocation_metadata(), "authorization"))


# ------------------------------------------------------------------------------------------------ Strata

# The router's gRPC threads, and how many of them client streams may hold: the rest answer heartbeats, registration
# (when the Registry shares the public port: no --registry-port), admin and short calls however many streams are open.
GRPC_THREADS = 512
MAX_GRPC_STREAMS = 448


class StrataService(strata_pb2_grpc.StrataServicer):
    def __init__(self, dispatcher: Dispatcher, registry: WorkerRegistry, allow_admin: bool = True,
                 max_streams: int = MAX_GRPC_STREAMS, keys: ApiKeys = ApiKeys()) -> None:
        """`keys`: the API keys `make_grpc_server`'s guard checks; here they name each call's tenant."""
        self.dispatcher, self.registry, self.allow_admin, self.keys = dispatcher, registry, allow_admin, keys
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="fanout")
        self.max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)

    def Generate(self, request: strata_pb2.GenerateRequest, context: grpc.ServicerContext):
        # NOTE: a stream holds one of the server's threads for its whole life: past `max_streams` the rest of the
        # pool stays free for workers' heartbeats and registration (or they would be swept as dead under load)
        if not self._streams.acquire(blocking=False):
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "1000"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the router is serving its limit of "
                                                              f"{self.max_streams} concurrent streams; retry in a second")
        try:
            yield from self._generate(request, context)
        finally:
            self._streams.release()

    def _generate(self, request: strata_pb2.GenerateRequest, context: grpc.ServicerContext):
        try:
            params = from_grpc(request, self.dispatcher.limits)
            run = self.dispatcher.start(params, _identity(context, self.keys), context.time_remaining(), door="grpc",
                                        peer=_peer_host(context.peer()))
        except ApiError as exc:
            _abort_with(context, exc)
        context.add_callback(run.cancel)  # client cancel or deadline: the workers stop too
        try:
            yield from run.events()
        except ApiError as exc:
            if context.is_active():
                _abort_with(context, exc)
        except Exception as exc:  # noqa: BLE001 - the router's own failure is INTERNAL, never a finished stream
            log.exception("request %s failed in the router", request.request_id)
            if context.is_active():
                _abort_with(context, ApiError(grpc.StatusCode.INTERNAL, f"internal: {exc}"))

    def Abort(self, request: strata_pb2.AbortRequest, context) -> strata_pb2.AbortResponse:
        try:
            self.dispatcher.abort(request.request_id)
        except ApiError as exc:
            _abort_with(context, exc)
        return strata_pb2.AbortResponse()

    def ListModels(self, request, context) -> strata_pb2.ListModelsResponse:
        return strata_pb2.ListModelsResponse(models=[m.info() for m in self.dispatcher.models.values()])

    def ListWorkers(self, request: strata_pb2.ListWorkersRequest, context) -> strata_pb2.ListWorkersResponse:
        role = ROLE_NAME.get(request.role)
        views = self.registry.workers(role, include_dead=request.include_dead)
        return strata_pb2.ListWorkersResponse(workers=[view_to_proto(v, self.dispatcher.models) for v in views])

    def GetCacheStats(self, request: strata_pb2.GetCacheStatsRequest, context) -> strata_pb2.GetCacheStatsResponse:
        if request.tier and request.tier not in TIERS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"tier must be empty (every tier) or one of {', '.join(TIERS)}, got {request.tier!r}")
        views = self._select(request.worker_ids, context)
        stats = self._fan_out(views, lambda stub: stub.Stats(worker_pb2.StatsRequest(), timeout=_FANOUT_TIMEOUT_S))
        out = strata_pb2.GetCacheStatsResponse()
        for view, (answer, error) in zip(views, stats):
            entry = out.workers.add(worker_id=view.record.id)
            if error:
                entry.error = error
                continue
            entry.CopyFrom(answer.cache)
            entry.worker_id = view.record.id
            if request.tier:
                kept = [t for t in entry.tiers if t.tier == request.tier]
                del entry.tiers[:]
                entry.tiers.extend(kept)
        return out

    def EvictCache(self, request: common_pb2.EvictCacheRequest, context) -> common_pb2.EvictCacheResponse:
        self._admin_allowed(context)
        if bool(request.block_hashes) == bool(request.bytes):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "exactly one of block_hashes and bytes must be given")
        if any(len(h) != 16 for h in request.block_hashes):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "block_hashes must be 16 bytes each")
        return self._admin(request, context, "EvictCache", common_pb2.EvictCacheResponse())

    def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        self._admin_allowed(context)
        return self._admin(request, context, "FlushCache", common_pb2.FlushCacheResponse())

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _admin_allowed(self, context) -> None:
        if not self.allow_admin:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "admin calls are off on this router "
                                                             "(start it without --no-admin)")

    def _admin(self, request, context, method: str, response):
        """Every selected worker acts on its local tiers; a shared tier (redis, s3), one backend for them all, is
        acted on once, by one worker (`_ask_one`), so nothing is removed or counted twice."""
        views = self._select([request.worker_id] if request.worker_id else [], context)
        forward = type(request)()
        forward.CopyFrom(request)
        timeout = _admin_timeout_s(context.time_remaining())

        def call(stub):
            return getattr(stub, method)(forward, timeout=timeout)

        shared = request.tier in SHARED_TIERS
        if shared and len(views) > 1:
            answers = self._ask_one(request.tier, views, call)
        else:
            answers = [(view.record.id, *answer) for view, answer in zip(views, self._fan_out(views, call))]
        for worker_id, answer, error in answers:
            if error:
                response.results.add(worker_id=worker_id, tier=request.tier, error=error, shared=shared)
            else:
                response.results.extend(answer.results)
        return response

    def _ask_one(self, tier: str, views: Sequence[WorkerView], call: Callable) -> list[tuple[str, object, str]]:
        """Ask the first worker (READY ones first) that runs `tier`; the next only when one could not be reached
        (UNAVAILABLE: it did not act). Any other answer, an error included, is final: the worker may have acted."""
        runs = [v for v in views if tier in v.record.tiers or not v.record.tiers]  # a probed worker may list none
        if not runs:
            return [("", None, f"no worker runs the {tier} tier")]
        error = ""
        for view in sorted(runs, key=lambda v: v.state != "ready"):
            try:
                return [(view.record.id, call(self.dispatcher.channels.stub(view.record.address)), "")]
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return [(view.record.id, None, error)]
        return [(view.record.id, None, error)]

    def _select(self, worker_ids: Sequence[str], context) -> list[WorkerView]:
        views = self.registry.workers()
        if not worker_ids:
            return views
        known = {v.record.id: v for v in views}
        missing = [w for w in worker_ids if w not in known]
        if missing:
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_ids: unknown worker {missing[0]!r}; known: "
                                                     f"{sorted(known)}")
        return [known[w] for w in worker_ids]

    def _fan_out(self, views: Iterable[WorkerView], call: Callable) -> list[tuple[object, str]]:
        """Ask every worker in parallel; (answer, "") or (None, why) per worker, in order."""
        def one(view: WorkerView):
            try:
                return call(self.dispatcher.channels.stub(view.record.address)), ""
            except grpc.RpcError as exc:
                return None, f"{exc.code().name}: {exc.details()}"
        return list(self._pool.map(one, views))


def _admin_timeout_s(remaining_s: float | None) -> float:
    """A worker's deadline for EvictCache / FlushCache: the caller's, less a little, so the router still answers in
    time with what each worker did (a late worker is its own DEADLINE_EXCEEDED result)."""
    if remaining_s is None:
        return _ADMIN_TIMEOUT_S
    return max(0.1, remaining_s - min(1.0, remaining_s / 10))


# ---------------------------------------------------------------------------------------------- Registry

class RegistryService(router_pb2_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry, feed: EventsFeed | None = None) -> None:
        self.registry, self.feed = registry, feed

    def RegisterWorker(self, request: router_pb2.RegisterWorkerRequest, context):
        try:
            record = record_from_proto(request.worker)
        except ApiError as exc:
            _abort_with(context, exc)
        self.registry.register(record)
        if request.worker.HasField("speculative"):  # its drafter and counters count as its first heartbeat
            self.registry.heartbeat(record.id, speculative=spec_from_proto(request.worker.speculative, True))
        log.info("worker %s registered (%s at %s)", record.id, record.role, record.address)
        cfg = self.registry.config
        return router_pb2.RegisterWorkerResponse(worker_id=record.id, heartbeat_interval_ms=cfg.heartbeat_interval_ms,
                                                 heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)

    def Heartbeat(self, request: router_pb2.HeartbeatRequest, context):
        published = request.kv_event_batches_published
        last_seq = published - 1 if published else None
        try:
            state = self.registry.heartbeat(request.worker_id, load_from_proto(request.load), last_seq,
                                            spec_from_proto(request.speculative, request.HasField("speculative")))
        except UnknownWorker:
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id {request.worker_id!r} is not registered (or was "
                                                     f"declared dead): register again")
        if self.feed is not None and last_seq is not None:
            self.feed.note_published_seq(request.worker_id, last_seq)
        return router_pb2.HeartbeatResponse(state=_STATE_PROTO[state])

    def Drain(self, request: router_pb2.DrainRequest, context):
        try:
            view = self.registry.drain(request.worker_id)
        except UnknownWorker:
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id {request.worker_id!r} is not registered")
        return router_pb2.DrainResponse(worker=view_to_proto(view, {}))

    def Deregister(self, request: router_pb2.DeregisterRequest, context):
        self.registry.deregister(request.worker_id)
        return router_pb2.DeregisterResponse()


STRATA_NAME = strata_pb2.DESCRIPTOR.services_by_name["Strata"].full_name
REGISTRY_NAME = router_pb2.DESCRIPTOR.services_by_name["Registry"].full_name


class ServedHealth(NamedTuple):
    """A server's grpc health servicer and the services it answers SERVING for once `mark_serving` runs."""

    servicer: health.HealthServicer
    services: tuple[str, ...]


def add_services(server: grpc.Server, strata: StrataService | None, registry: RegistryService | None,
                 reflect: bool = True) -> ServedHealth:
    """The given services (None: not on this server, so its calls are UNIMPLEMENTED here), grpc health, and with
    `reflect` server reflection. The public port takes `strata` (and `registry` when it has no port of its own);
    the registry port (`router.grpc_ports`) takes `registry` alone."""
    names = []
    if strata is not None:
        strata_pb2_grpc.add_StrataServicer_to_server(strata, server)
        names.append(STRATA_NAME)
    if registry is not None:
        router_pb2_grpc.add_RegistryServicer_to_server(registry, server)
        names.append(REGISTRY_NAME)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflect:
        reflection.enable_server_reflection(
            (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    return ServedHealth(health_servicer, tuple(names))


def mark_serving(served: ServedHealth) -> None:
    """SERVING for the server as a whole ("") and for each service it serves by its name, as grpc health clients
    ask."""
    for name in ("", *served.services):
        served.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def make_grpc_server(max_workers: int = GRPC_THREADS, keys: ApiKeys = ApiKeys(),
                     cluster_secret: str = "", max_request_bytes: int = MAX_REQUEST_BYTES) -> grpc.Server:
    """With `keys`, every `Strata` call wants a known bearer key; with `cluster_secret`, every `Registry` call the
    fleet secret (UNAUTHENTICATED otherwise). grpc health and reflection stay open. A message over
    `max_request_bytes` is RESOURCE_EXHAUSTED, one that does not decode INVALID_ARGUMENT (`router.grpc_decode`)."""
    rules = [(STRATA_SERVICE, api_key_check(keys))] if keys.enabled else []
    rules += [(REGISTRY_SERVICE, secret_check(cluster_secret))] if cluster_secret else []
    options = dict(GRPC_OPTIONS) | {"grpc.max_receive_message_length": max_request_bytes or -1}  # 0: no limit
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                       options=list(options.items()),
                       interceptors=([CallGuard(rules)] if rules else []) + [DecodeErrors()])
