"""The worker's side of the router's Registry (router.proto): register, heartbeat, drain, deregister.

    start ──RegisterWorker──> READY ──Heartbeat every interval──> ...
      │ router unreachable: retry with backoff (0.5 s doubling to 10 s); the worker serves all along
      │ Heartbeat NOT_FOUND (router restarted, or declared this worker dead): register again
      │ Heartbeat says DRAINING (an operator's Drain): take nothing new; once idle, Deregister and stop
    SIGTERM ──Drain──> (in-flight requests finish) ──Deregister

The interval is `--heartbeat-s`, or the router's `heartbeat_interval_ms` when that is shorter (a worker that beats
slower than its router expects is declared dead). Runs in its own daemon thread; no call here ever blocks serving.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
from typing import Callable

import grpc

from strata.v1 import common_pb2, router_pb2, router_pb2_grpc
from worker_common.fleet_tls import NO_TLS, FleetTls
from worker_common.grpc_auth import attach_secret

log = logging.getLogger(__name__)

_WILDCARD = re.compile(r"^(?P<scheme>\w+://)?(?P<host>0\.0\.0\.0|\*|\[::\]|::)(?P<port>:[^:]+)$")
_CALL_TIMEOUT_S = 2.0
_BACKOFF_INITIAL_S = 0.5
_BACKOFF_MAX_S = 10.0


class RouterLink:
    """Contract: `start()` returns at once; `stop()` sends Drain and Deregister (best effort, bounded by
    `_CALL_TIMEOUT_S` each) and is idempotent. Counters are for tests and logs."""

    def __init__(self, address: str, info: Callable[[], common_pb2.WorkerInfo],
                 load: Callable[[], common_pb2.WorkerLoad], num_published: Callable[[], int], heartbeat_s: float,
                 on_drain: Callable[[], None], idle: Callable[[], bool],
                 speculative: Callable[[], common_pb2.SpeculativeStats | None] = lambda: None,
                 cluster_secret: str = "", tls: FleetTls = NO_TLS) -> None:
        """`speculative`: the worker's speculative decoding counters for each heartbeat (None: it does not
        speculate). `cluster_secret`: shown on every Registry call (a router with a secret refuses calls without
        it: UNAUTHENTICATED, retried with backoff like an unreachable router). `tls`: fleet TLS, to dial a router
        that serves it (a handshake that fails is retried with backoff, like an unreachable router)."""
        self.address, self._info, self._load, self._num_published = address, info, load, num_published
        self._speculative = speculative
        self.heartbeat_s, self._on_drain, self._idle = heartbeat_s, on_drain, idle
        self._channel = attach_secret(tls.channel(address), cluster_secret)
        self._stub = router_pb2_grpc.RegistryStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-link", daemon=True)
        self.worker_id = ""
        self.registered = False
        self.draining = False
        self.num_registrations = self.num_heartbeats = self.num_failures = 0

    def start(self) -> None:
        self._thread.start()

    # ---- the loop -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = _BACKOFF_INITIAL_S
        while not self._stop.is_set():
            if self.draining and not self.registered:
                return  # NOTE: never (re-)register while draining: the registry would route to this worker again
            try:
                if self.registered:
                    self._beat()
                else:
                    self._register()
                backoff, wait_s = _BACKOFF_INITIAL_S, self.heartbeat_s
            except grpc.RpcError as exc:
                self.num_failures += 1
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self.registered, wait_s = False, 0.0     # the router forgot us: register again now
                else:
                    log.warning("router %s: %s (%s); retrying in %.1fs", self.address, exc.code().name,
                                exc.details(), backoff)
                    wait_s, backoff = backoff, min(_BACKOFF_MAX_S, backoff * 2)
            if self.draining and self._idle():
                self._deregister()
                return
            self._stop.wait(wait_s)

    def _register(self) -> None:
        info = self._info()
        answer = self._stub.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=info), timeout=_CALL_TIMEOUT_S)
        self.worker_id, self.registered = answer.worker_id or info.id, True
        self.num_registrations += 1
        if answer.heartbeat_interval_ms:
            self.heartbeat_s = min(self.heartbeat_s, answer.heartbeat_interval_ms / 1000.0)
        log.info("registered with router %s as %s (heartbeat every %.2fs)", self.address, self.worker_id,
                 self.heartbeat_s)

    def _beat(self) -> None:
        answer = self._stub.Heartbeat(router_pb2.HeartbeatRequest(
            worker_id=self.worker_id, load=self._load(), kv_event_batches_published=self._num_published(),
            speculative=self._speculative()), timeout=_CALL_TIMEOUT_S)
        self.num_heartbeats += 1
        if answer.state == common_pb2.WORKER_STATE_DRAINING and not self.draining:
            log.info("router %s drains this worker", self.address)
            self.draining = True
            self._on_drain()
        elif answer.state == common_pb2.WORKER_STATE_READY and self.draining:
            # NOTE: our Drain did not reach the router (its call timed out on a loaded machine, seen in CI): the
            # router still routes here, so ask again on every beat until it says DRAINING
            log.info("router %s still routes to this draining worker: asking it to drain again", self.address)
            self._call("Drain", router_pb2.DrainRequest(worker_id=self.worker_id))

    # ---- shutdown -------------------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Ask the router to route nothing new here (SIGTERM, before in-flight requests finish)."""
        if not self.draining:
            self.draining = True
            if self.registered:
                self._call("Drain", router_pb2.DrainRequest(worker_id=self.worker_id))

    def stop(self) -> None:
        """Stop heartbeating and leave the registry."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(_CALL_TIMEOUT_S + 1)
        self._deregister()
        self._channel.close()

    def _deregister(self) -> None:
        if self.registered:
            self.registered = False
            self._call("Deregister", router_pb2.DeregisterRequest(worker_id=self.worker_id))

    def _call(self, method: str, request) -> None:
        try:
            getattr(self._stub, method)(request, timeout=_CALL_TIMEOUT_S)
        except grpc.RpcError as exc:  # the router may be gone already: it will declare this worker dead
            log.info("%s at router %s failed: %s", method, self.address, exc.code().name)


def advertised(address: str, host: str) -> str:
    """`address` (host:port or a ZeroMQ tcp:// endpoint) as a peer can reach it: a wildcard bind host (0.0.0.0, *,
    ::) is replaced by `host`, or by this machine's name when `host` is a wildcard too."""
    match = _WILDCARD.match(address)
    if not match:
        return address
    if not host or _WILDCARD.match(f"{host}:0"):
        host = socket.gethostname()
    return f"{match['scheme'] or ''}{host}{match['port']}"
