"""The gRPC shell every worker shares: the engine, its thread and store, in-flight ids, Health/Stats/Abort, and
`serve()`, which prints the READY line launchers and tests wait for:

    READY 127.0.0.1:50051 role=prefill worker_id=prefill-1234 transfer=shm
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.config import WorkerConfig
from worker_common.convert import cache_stats
from worker_common.engine_loop import EngineLoop, Tracked
from worker_common.engine_setup import EngineBundle, build_engine
from worker_common.store_setup import build_store

log = logging.getLogger(__name__)

_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class WorkerBase(worker_pb2_grpc.WorkerServicer):
    """Owns the engine loop and the store; subclasses add their role's RPCs."""

    def __init__(self, config: WorkerConfig, bundle: EngineBundle | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{config.role}-{os.getpid()}"
        self.bundle = bundle or build_engine(config)
        self.store = build_store(config)
        self.loop = EngineLoop(self.bundle, name=f"{config.role}-engine")
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
            self._inflight[request_id] = tracked

    def unclaim(self, request_id: str) -> None:
        with self._inflight_lock:
            self._inflight.pop(request_id, None)

    def Abort(self, request: worker_pb2.WorkerAbortRequest, context) -> worker_pb2.WorkerAbortResponse:
        with self._inflight_lock:
            known = request.request_id in self._inflight
        if known:
            self.loop.abort(request.request_id, "aborted by Abort").result(timeout=10)
        return worker_pb2.WorkerAbortResponse(found=known)

    # The other role's RPCs: UNAVAILABLE, so the router retries on a worker of the right role (worker.proto).
    def Prefill(self, request, context):
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
        scheduler, pool = self.bundle.engine.scheduler, self.bundle.engine.block_manager.pool
        load = common_pb2.WorkerLoad(running=scheduler.num_running, waiting=scheduler.num_waiting,
                                     kv_usage=pool.num_used_blocks / pool.num_blocks)
        return worker_pb2.StatsResponse(worker_id=self.worker_id, load=load,
                                        cache=cache_stats(self.worker_id, self.store, int(time.time() * 1000)))

    def close(self) -> None:
        self.loop.stop()
        self.store.close()


def serve(service: WorkerBase, extra_ready: str = "") -> grpc.Server:
    """Start the gRPC server (Worker + grpc.health.v1) and print the READY line."""
    config = service.config
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads), options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    service.address = f"{config.host}:{port}"
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"READY {service.address} role={config.role} worker_id={service.worker_id} transfer={config.transfer}"
          f"{' ' + extra_ready if extra_ready else ''}", flush=True)
    return server


def run_until_signalled(service: WorkerBase, server: grpc.Server, on_exit: Callable[[], None]) -> None:
    """Block until SIGTERM/SIGINT, then stop taking calls, finish (grace 5 s) and release everything."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    service.draining = True
    server.stop(grace=5).wait(6)
    on_exit()
