"""Registration with the router's Registry (router.proto) from real worker processes started with `--router`:
RegisterWorker with the worker's whole description, heartbeats with its load, registering again after NOT_FOUND,
retries while the router is unreachable (the worker serves all along), Drain + Deregister on SIGTERM, and a
router-initiated drain.

The Registry here is a small real gRPC server of the real contract that records what it is told."""
from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from engine.model_runner import ModelRunner
from engine.config import CacheConfig, ModelConfig
from strata.llm import kv_namespace
from strata.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16


class RecordingRegistry(router_pb2_grpc.RegistryServicer):
    """Registry that records every call; `forget(id)` makes the next heartbeat NOT_FOUND, `drain(id)` DRAINING."""

    def __init__(self, interval_ms: int = 200) -> None:
        self.interval_ms = interval_ms
        self.calls: list[tuple[str, object]] = []
        self.known: set[str] = set()
        self.draining: set[str] = set()
        self._lock = threading.Lock()

    def _record(self, method: str, request) -> None:
        with self._lock:
            self.calls.append((method, request))

    def named(self, method: str) -> list:
        with self._lock:
            return [r for m, r in self.calls if m == method]

    def methods(self) -> list[str]:
        with self._lock:
            return [m for m, _ in self.calls]

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self.known.discard(worker_id)

    def drain(self, worker_id: str) -> None:
        with self._lock:
            self.draining.add(worker_id)

    def RegisterWorker(self, request, context):
        self._record("RegisterWorker", request)
        with self._lock:
            self.known.add(request.worker.id)
        return router_pb2.RegisterWorkerResponse(worker_id=request.worker.id, heartbeat_interval_ms=self.interval_ms,
                                                 heartbeat_timeout_ms=10 * self.interval_ms)

    def Heartbeat(self, request, context):
        self._record("Heartbeat", request)
        with self._lock:
            known, draining = request.worker_id in self.known, request.worker_id in self.draining
        if not known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id {request.worker_id!r} is not registered")
        state = common_pb2.WORKER_STATE_DRAINING if draining else common_pb2.WORKER_STATE_READY
        return router_pb2.HeartbeatResponse(state=state)

    def Drain(self, request, context):
        self._record("Drain", request)
        return router_pb2.DrainResponse(worker=common_pb2.WorkerInfo(id=request.worker_id))

    def Deregister(self, request, context):
        self._record("Deregister", request)
        self.forget(request.worker_id)
        return router_pb2.DeregisterResponse()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_registry(registry: RecordingRegistry, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    router_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def wait_for(condition, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


@pytest.fixture
def registry():
    registry, port = RecordingRegistry(), free_port()
    server = start_registry(registry, port)
    registry.address = f"127.0.0.1:{port}"
    yield registry
    server.stop(0)


def worker_args(model_path: str, router: str, worker_id: str) -> list[str]:
    return ["--model", model_path, "--transfer", "shm", "--worker-id", worker_id, "--router", router,
            "--heartbeat-s", "5", "--num-blocks", "64", "--handoff-mib", "4", "--host-tier-mib", "4",
            "--block-size", str(BLOCK_SIZE)]


@pytest.mark.timeout(300)
def test_worker_registers_its_whole_description_and_heartbeats_its_load(model_path, registry):
    with WorkerProcess("prefill", worker_args(model_path, registry.address, "prefill-reg")) as worker:
        wait_for(lambda: registry.named("RegisterWorker"), what="RegisterWorker")
        info = registry.named("RegisterWorker")[0].worker
        cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=2)
        namespace = kv_namespace(ModelRunner(ModelConfig(model_path, dtype="float32"), cache), cache, "float32")
        assert (info.id, info.role, info.address) == ("prefill-reg", common_pb2.WORKER_ROLE_PREFILL, worker.address)
        assert info.model.id == Path(model_path).name and info.model.max_model_len == 2048
        assert info.model.kv == common_pb2.KvSpec(model_fingerprint=namespace.model_fingerprint,
                                                  kv_layout=namespace.kv_layout, kv_dtype="float32",
                                                  block_size=BLOCK_SIZE)
        assert (info.kv_events_endpoint, info.kv_replay_endpoint) == (worker.events_endpoint, worker.replay_endpoint)
        assert list(info.transfer_backends) == ["shm"] and list(info.tiers) == ["device", "host"]
        assert info.state == common_pb2.WORKER_STATE_READY
        # The router's 200 ms interval is shorter than --heartbeat-s 5: the worker beats at the router's pace.
        wait_for(lambda: len(registry.named("Heartbeat")) >= 3, timeout_s=5, what="3 heartbeats")
        beat = registry.named("Heartbeat")[-1]
        assert beat.worker_id == "prefill-reg" and beat.HasField("load") and 0.0 <= beat.load.kv_usage <= 1.0

        prompt = list(range(3, 3 + 2 * BLOCK_SIZE + 1))
        worker.stub().Prefill(worker_pb2.PrefillRequest(request_id="r1", token_ids=prompt,
                                                        sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60)
        # The prefill published its blocks' BlockStored (device, then host): heartbeats now count those batches.
        wait_for(lambda: registry.named("Heartbeat")[-1].kv_event_batches_published > 0, timeout_s=5,
                 what="a heartbeat counting the KV-event batches published")

        registry.forget("prefill-reg")  # as a restarted router would: the next heartbeat is NOT_FOUND
        wait_for(lambda: len(registry.named("RegisterWorker")) == 2, timeout_s=5, what="registering again")


@pytest.mark.timeout(300)
def test_sigterm_drains_then_deregisters(model_path, registry):
    worker = WorkerProcess("decode", worker_args(model_path, registry.address, "decode-reg"))
    try:
        wait_for(lambda: registry.named("Heartbeat"), what="a heartbeat")
        worker.signal(signal.SIGTERM)
        assert worker.proc.wait(30) == 0
    finally:
        worker.stop()
    methods = registry.methods()
    assert methods[0] == "RegisterWorker" and methods[-1] == "Deregister"
    assert methods.count("Drain") == 1 and methods.index("Drain") < len(methods) - 1
    assert registry.named("Deregister")[0].worker_id == "decode-reg"


@pytest.mark.timeout(300)
def test_unreachable_router_is_retried_while_the_worker_serves(model_path):
    registry, port = RecordingRegistry(), free_port()
    with WorkerProcess("prefill", worker_args(model_path, f"127.0.0.1:{port}", "prefill-late")) as worker:
        health = worker.stub().Health(worker_pb2.HealthRequest(), timeout=10)
        assert health.state == common_pb2.WORKER_STATE_READY       # serving without a router
        time.sleep(1.0)                                             # a few failed attempts
        server = start_registry(registry, port)
        try:
            wait_for(lambda: registry.named("RegisterWorker"), timeout_s=15, what="registration after the router "
                                                                                 "came up")
            assert registry.named("RegisterWorker")[0].worker.address == worker.address
        finally:
            server.stop(0)


@pytest.mark.timeout(300)
def test_router_drain_stops_new_requests_and_the_idle_worker_deregisters(model_path, registry):
    with WorkerProcess("prefill", worker_args(model_path, registry.address, "prefill-drained")) as worker:
        wait_for(lambda: registry.named("Heartbeat"), what="a heartbeat")
        registry.drain("prefill-drained")
        wait_for(lambda: registry.named("Deregister"), timeout_s=5, what="Deregister once idle")
        health = worker.stub().Health(worker_pb2.HealthRequest(), timeout=10)
        assert health.state == common_pb2.WORKER_STATE_DRAINING
        with pytest.raises(grpc.RpcError) as err:
            worker.stub().Prefill(worker_pb2.PrefillRequest(request_id="late", token_ids=[5, 6, 7]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
