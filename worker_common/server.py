"""The gRPC shell every worker shares: the engine, its thread and store, the KV-event publisher, in-flight ids,
Health/Stats/Abort/EvictCache/FlushCache, registration with a router, and `serve()`, which prints the READY line
launchers and tests wait for:

    READY 127.0.0.1:50051 role=prefill worker_id=prefill-1234 transfer=shm agent=shm://... \
          events=tcp://127.0.0.1:41234 replay=tcp://127.0.0.1:41235

(`events=` and `replay=` are empty when the worker publishes no KV events.)
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from kvstore.events import WireOptions
from kvstore.metrics import register_store_metrics
from strata.cache_metrics import CacheTierCollector, LoadCollector
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.cache_admin import CacheAdmin
from worker_common.cache_stats import cache_stats
from worker_common.config import WorkerConfig
from worker_common.convert import InvalidArgument
from worker_common.engine_loop import EngineLoop, Failure, Tracked
from worker_common.read_costs import ReadCostMeter, TransferCounter
from worker_common.engine_setup import EngineBundle, build_engine
from worker_common.grpc_auth import worker_guard
from worker_common.kv_events import WorkerEvents
from worker_common.registration import RouterLink, advertised
from worker_common.moe_stats import MoECollector
from worker_common.spec_stats import SpecCollector, speculative_stats
from worker_common.store_setup import build_store

log = logging.getLogger(__name__)

_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class WorkerBase(worker_pb2_grpc.WorkerServicer):
    """Owns the engine loop and the store; subclasses add their role's RPCs."""

    def __init__(self, config: WorkerConfig, bundle: EngineBundle | None = None, ep_group: Any = None) -> None:
        """A `bundle` built elsewhere publishes no device events for the blocks its engine computes (its block
        manager's hooks are set at construction: `build_engine(config, on_block_stored, on_block_removed)`).
        `ep_group`: this rank's joined `engine.moe.ep_group.EPGroup` (`--expert-parallel` > 1), handed to the
        engine."""
        self.config = config
        self.worker_id = config.worker_id or f"{config.role}-{os.getpid()}"
        self.events = WorkerEvents(self.worker_id, config.kv_events_endpoint, config.kv_replay_endpoint,
                                   config.block_size, WireOptions.preset(config.kv_events_format))
        device = self.events.device
        self.bundle = bundle or build_engine(config, device.on_block_stored, device.on_block_removed, ep_group)
        self.bundle.device_events = device
        self.store = build_store(config, self.events.publisher)
        self.loop = EngineLoop(self.bundle, name=f"{config.role}-engine", events=device)
        self.transfer_costs = TransferCounter()  # a decode worker's hand-off reads (its KvPuller records them)
        # heartbeats carry measured read costs: the store tiers', and the hand-off reads'
        self.loop.load.tier_reads = ReadCostMeter(self.store.stats, transfer=self.transfer_costs).fields
        self.admin = CacheAdmin(self.worker_id, self.loop, self.store, self.events)
        self.router_link: RouterLink | None = None
        self.metrics_server = None             # the /metrics HTTP server (config.metrics_port >= 0)
        self.health_servicer: health.HealthServicer | None = None  # grpc.health.v1, once serving
        self.address = ""                      # host:port once serving
        self._inflight: dict[str, Tracked] = {}
        self._inflight_lock = threading.Lock()
        self.draining = False                  # set on SIGTERM: finish what is in flight, take nothing new
        self.loop.start()

    # ---- in-flight ids (ALREADY_EXISTS, Abort) ---------------------------------------------------------------

    def claim(self, request_id: str, tracked: Tracked, context: grpc.ServicerContext) -> None:
        if not request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        with self._inflight_lock:
            if request_id in self._inflight:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
            if len(self._inflight) >= self.config.max_requests:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", "1000"),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker {self.worker_id} holds its limit of "
                              f"{self.config.max_requests} requests (--max-requests); retry on another worker")
            self._inflight[request_id] = tracked

    def unclaim(self, request_id: str) -> None:
        with self._inflight_lock:
            self._inflight.pop(request_id, None)

    def fail_call(self, context: grpc.ServicerContext, failure: Failure) -> NoReturn:
        """End a call whose request this worker failed with an error status, never a finish reason: UNAVAILABLE when
        another worker may serve it (the router retries there), else INTERNAL."""
        code = grpc.StatusCode.UNAVAILABLE if failure.retryable else grpc.StatusCode.INTERNAL
        context.abort(code, f"worker {self.worker_id}: {failure}")

    def Abort(self, request: worker_pb2.WorkerAbortRequest, context) -> worker_pb2.WorkerAbortResponse:
        with self._inflight_lock:
            known = request.request_id in self._inflight
        if known:
            self.loop.abort(request.request_id, "aborted by Abort").result(timeout=10)
        return worker_pb2.WorkerAbortResponse(found=known)

    # The other role's RPCs: UNAVAILABLE, so the router retries on a worker of the right role (worker.proto).
    def Prefill(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is a {self.config.role} worker: no Prefill")

    def PrefillStream(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is a {self.config.role} worker: no Prefill")

    def Decode(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is a {self.config.role} worker: no Decode")

    def Generate(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is a {self.config.role} worker: no Generate")

    def ReleaseKv(self, request, context) -> worker_pb2.ReleaseKvResponse:
        return worker_pb2.ReleaseKvResponse(released=False)  # this worker grants no leases

    def Health(self, request, context) -> worker_pb2.HealthResponse:
        state = common_pb2.WORKER_STATE_DRAINING if self.draining else common_pb2.WORKER_STATE_READY
        return worker_pb2.HealthResponse(worker_id=self.worker_id, role=_ROLES[self.config.role], state=state,
                                         detail="draining" if self.draining else "model loaded")

    def Stats(self, request, context) -> worker_pb2.StatsResponse:
        cache = cache_stats(self.worker_id, self.bundle, self.store, int(time.time() * 1000))
        return worker_pb2.StatsResponse(worker_id=self.worker_id, load=self.load(), cache=cache,
                                        speculative=self.speculative_stats())

    def start_metrics(self) -> str:
        """Serve `/metrics` on a daemon thread: this worker's tiers as `strata_cache_*{worker, tier}` (the figures of
        `strata cache stats`, device included), its store's latency histograms and counters as
        `strata_kvstore_*{tier}` (`kvstore.metrics`), its load as `strata_worker_*{worker}`, and on a worker that
        speculates its drafting as `strata_spec_*{worker}` (`worker_common.spec_stats`), on a MoE model its expert
        load as `strata_moe_*` (`worker_common.moe_stats`). Returns the URL."""
        registry = CollectorRegistry()
        register_store_metrics(self.store, registry)
        registry.register(CacheTierCollector(lambda: [(self.worker_id, cache_stats(
            self.worker_id, self.bundle, self.store, int(time.time() * 1000)))]))
        registry.register(LoadCollector(self.worker_id, self.load))
        if self.bundle.engine.speculation is not None:
            registry.register(SpecCollector(self.worker_id, self.speculative_stats))
        registry.register(MoECollector(self.worker_id, self.bundle.runner.model, self.bundle.runner.ep))
        for collector in self.metrics_collectors():
            registry.register(collector)
        self.metrics_server, _ = start_http_server(self.config.metrics_port, addr=self.config.host, registry=registry)
        return f"http://{self.config.host}:{self.metrics_server.server_port}/metrics"

    def metrics_collectors(self) -> list:
        """Role-specific Prometheus collectors for `/metrics` (the decode worker's hand-off totals)."""
        return []

    def load(self) -> common_pb2.WorkerLoad:
        """The engine loop's latest snapshot (worker_common.load documents each figure) and the pool's usage."""
        pool = self.bundle.engine.block_manager.pool
        return common_pb2.WorkerLoad(kv_usage=pool.num_used_blocks / pool.num_blocks,
                                     **self.loop.load.snapshot._asdict())

    def speculative_stats(self) -> common_pb2.SpeculativeStats | None:
        """The engine's speculative decoding counters; None when this worker does not speculate."""
        return speculative_stats(self.bundle.engine.speculation)

    # ---- cache admin --------------------------------------------------------------------------------------------

    def EvictCache(self, request: common_pb2.EvictCacheRequest, context) -> common_pb2.EvictCacheResponse:
        try:
            return common_pb2.EvictCacheResponse(results=self.admin.evict(request))
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        try:
            return common_pb2.FlushCacheResponse(results=self.admin.flush(request))
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # ---- registration -------------------------------------------------------------------------------------------

    def info(self) -> common_pb2.WorkerInfo:
        """This worker as it registers with a router (router.proto RegisterWorkerRequest)."""
        ns, config = self.bundle.namespace, self.config
        kv = common_pb2.KvSpec(model_fingerprint=ns.model_fingerprint, kv_layout=ns.kv_layout, kv_dtype=ns.kv_dtype,
                               block_size=self.bundle.block_size)
        model = common_pb2.ModelInfo(id=config.model_id or Path(config.model).name,
                                     max_model_len=self.bundle.max_model_len, kv=kv)
        state = common_pb2.WORKER_STATE_DRAINING if self.draining else common_pb2.WORKER_STATE_READY
        host = config.advertise_host or config.host
        return common_pb2.WorkerInfo(
            id=self.worker_id, role=_ROLES[config.role], address=advertised(self.address, host), state=state,
            load=self.load(), model=model, kv_events_endpoint=advertised(self.events.endpoint, host),
            kv_replay_endpoint=advertised(self.events.replay_endpoint, host), transfer_backends=[config.transfer],
            tiers=list(self.admin.tiers), speculative=self.speculative_stats())

    def start_router_link(self, load: Callable[[], common_pb2.WorkerLoad] | None = None,
                          idle: Callable[[], bool] | None = None) -> None:
        """`load` / `idle`: what heartbeats report and when a drained worker may leave (default: this worker's;
        an expert-parallel group's front passes the group's)."""
        if not self.config.router_address:
            return
        self.router_link = RouterLink(self.config.router_address, self.info, load or self.load,
                                      lambda: self.events.num_published, self.config.heartbeat_s,
                                      self._drained_by_router, idle or self._idle, speculative=self.speculative_stats,
                                      cluster_secret=self.config.cluster_secret, tls=self.config.fleet_tls())
        self.router_link.start()

    def _drained_by_router(self) -> None:
        self.draining = True

    def _idle(self) -> bool:
        with self._inflight_lock:
            return not self._inflight

    def close(self) -> None:
        if self.router_link is not None:
            self.router_link.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self.loop.stop()
        self.store.close()
        self.events.close()


def serve(service: WorkerBase, extra_ready: str = "", front: Any = None, ready_suffix: str = "") -> grpc.Server:
    """Start the gRPC server (Worker + grpc.health.v1) and print the READY line. `front`: the Worker servicer to
    install instead of `service` (an expert-parallel group's `worker_common.ep_front.EPFront`, whose `load` and
    `idle` the router link then reports); `ready_suffix`: fields after the READY line's own."""
    config = service.config
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads), options=GRPC_OPTIONS,
                         interceptors=worker_guard(config.cluster_secret))  # every RPC but Health wants it
    worker_pb2_grpc.add_WorkerServicer_to_server(front or service, server)
    health_servicer = service.health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = config.fleet_tls().add_port(server, f"{config.host}:{config.port}")  # fleet TLS: mTLS, else plain
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    service.address = f"{config.host}:{port}"
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    events = f"events={service.events.endpoint} replay={service.events.replay_endpoint}"
    metrics = f" metrics={service.start_metrics()}" if config.metrics_port >= 0 else ""
    print(f"READY {service.address} role={config.role} worker_id={service.worker_id} transfer={config.transfer}"
          f"{' ' + extra_ready if extra_ready else ''} {events}{metrics}{' ' + ready_suffix if ready_suffix else ''}",
          flush=True)
    if front is not None:
        service.start_router_link(front.load, front.idle)
    else:
        service.start_router_link()
    return server


def run_until_signalled(service: WorkerBase, server: grpc.Server, on_exit: Callable[[], None],
                        failed: threading.Event | None = None, failed_wait_s: float = 0.0) -> int:
    """Block until SIGTERM/SIGINT, then drain: leave the router's routing at once, take nothing new, wait up to
    `drain_timeout_s` for the requests in flight to finish, stop (grace 5 s) and release everything: exit status 0.
    Or until `failed` is set (an expert-parallel group broke): see `_stop_failed`; exit status 1."""
    done, signals = threading.Event(), []

    def on_signal(*_) -> None:
        signals.append(1)   # a second signal ends the drain's wait
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not done.wait(0.1 if failed is not None else None):
        if failed.is_set():
            _stop_failed(service, server, on_exit, failed_wait_s)
            return 1
    service.loop.group_end_expected = True   # the other ranks of a group stop too
    service.draining = True
    if service.router_link is not None:
        service.router_link.drain()  # the router stops sending new requests while the in-flight ones finish
    deadline = time.monotonic() + service.config.drain_timeout_s
    while not service._idle() and time.monotonic() < deadline and len(signals) < 2:
        time.sleep(0.05)
    server.stop(grace=5).wait(6)
    on_exit()  # the service's close() deregisters from the router
    return 0


def _stop_failed(service: WorkerBase, server: grpc.Server, on_exit: Callable[[], None], wait_s: float) -> None:
    """A worker that cannot serve any more: NOT_SERVING, out of the router's registry now (not drained: nothing in
    flight can finish), then up to `wait_s` for the engine loop to fail what is in flight (UNAVAILABLE: the router
    retries elsewhere), then stop."""
    service.draining = True
    if service.health_servicer is not None:
        service.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if service.router_link is not None:
        service.router_link.stop()   # Deregister, bounded
    deadline = time.monotonic() + wait_s
    while not service._idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(grace=1).wait(2)
    on_exit()
