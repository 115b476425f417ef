"""One rank of an expert-parallel worker group (`--expert-parallel N`, N > 1), from start to exit.

    rank 0                                             ranks 1..N-1 (rank 0's children, worker_common.ep_ranks)
    pick the rendezvous (a free loopback port)
    start ranks 1..N-1 ───────────────────────────>    parse the same flags (+ --ep-rank r --ep-init ...)
    EPGroup.init(N, 0, init) <── all ranks join ──>    EPGroup.init(N, r, init)
    build the engine (ep_group=...)                    build the engine (ep_group=...)
    wait for each child's READY (its address) <────    serve on 127.0.0.1:free, print READY
    serve EPFront (the group's Worker service),
    print READY, register with the router

Failure: rank 0 watches its children; the first that exits fails the group ("expert-parallel rank 1 of 2 exited with
code -9; failing the group"): the front ends every call UNAVAILABLE, health turns NOT_SERVING, rank 0 deregisters
from the router, waits (bounded) for its engine loop to fail what is in flight, and exits 1. Any rank whose engine
loop reports the group broken (`EngineLoop.on_group_failure`: a collective failed or timed out) does the same. A
child dies with rank 0 (PDEATHSIG). Start-up is bounded too: the rendezvous by the group's timeout, each child's
READY by `RANK_READY_TIMEOUT_S`, and a child that exits meanwhile ends rank 0's start at once, naming it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Sequence

from grpc_health.v1 import health_pb2

from worker_common.config import WorkerConfig
from worker_common.ep_events import EventRelay, RankHoldings
from worker_common.ep_front import EPFront
from worker_common.ep_ranks import ChildRanks, RankStartError, free_loopback_port
from worker_common.server import WorkerBase, run_until_signalled, serve

log = logging.getLogger(__name__)

RANK_READY_TIMEOUT_S = 900.0   # a child loads its model after the rendezvous; rank 0 waits this long for its READY
_FAILED_EXTRA_WAIT_S = 5.0     # on failure: the group's collective timeout + this, for in-flight requests to fail
_EXIT_NOTICE_S = 0.5           # how long a broken collective on rank 0 waits to see which child exited


class GroupFailure:
    """The first reason the group broke; `fail` is idempotent and safe from any thread (the engine thread too)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        self._stopping = False

    def stopping(self) -> None:
        """The worker is shutting down on purpose: a group that breaks from now on is no failure."""
        with self._lock:
            self._stopping = True

    def listen(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` on failure (now, if the group failed already)."""
        with self._lock:
            self._listeners.append(listener)
            reason = self.reason
        if reason:
            listener(reason)

    def fail(self, reason: str) -> None:
        with self._lock:
            if self._stopping:
                log.info("while stopping: %s", reason)
                return
            if self.reason:
                return
            self.reason = reason
            listeners = list(self._listeners)
        log.error("%s", reason)
        for listener in listeners:
            listener(reason)
        self.event.set()


def group_spec(config: WorkerConfig):
    from engine.moe.ep_group import EPGroupSpec  # NOTE: here: a plain worker never needs it
    return EPGroupSpec(config.expert_parallel, config.ep_rank, config.ep_init)


def join_group(spec, children: ChildRanks | None):
    """This rank's `EPGroup`, once every rank joined (bounded by the group's timeout). A child that exited meanwhile
    is named in the error rather than the rendezvous' timeout."""
    from engine.moe.ep_group import EPGroup

    try:
        return EPGroup.init(spec)
    except Exception as exc:
        exited = children.first_exit() if children is not None else None
        if exited is not None:
            raise RankStartError(f"{children.describe(exited.rank)} exited with code {exited.code} before the group "
                                 "formed (its log is above)") from exc
        raise


def with_group_defaults(config: WorkerConfig) -> WorkerConfig:
    """Rank 0's config with what it hands its children filled in: its worker id (each child's is `<id>-rank{r}`)
    and the rendezvous (a free loopback port unless given)."""
    worker_id = config.worker_id or f"{config.role}-{os.getpid()}"
    init = config.ep_init or f"tcp://127.0.0.1:{free_loopback_port()}"
    return dataclasses.replace(config, worker_id=worker_id, ep_init=init)


def run_rank(role: str, service_type: type[WorkerBase], argv: Sequence[str], config: WorkerConfig) -> int:
    """Serve as rank `config.ep_rank` until SIGTERM/SIGINT (0) or the group fails (1)."""
    children: ChildRanks | None = None
    if config.ep_rank == 0:
        config = with_group_defaults(config)
        children = ChildRanks(role, argv, config)   # NOTE: from the main thread (PDEATHSIG follows the thread)
    try:
        spec = group_spec(config)
        group = join_group(spec, children)
        service = service_type(config, ep_group=group)
        failure = GroupFailure()
        service.loop.on_group_failure = lambda exc: failure.fail(_failure_reason(config, children, exc))
        if group.broken:  # NOTE: broke before the hook was set (the engine loop runs from construction on)
            failure.fail(_failure_reason(config, children, group.error))
        failure.listen(lambda _: _not_serving(service))
        try:
            front = _front(service, children, failure) if children is not None else None
            server = serve(service, extra_ready=f"agent={service.agent.address}", front=front,
                           ready_suffix=_ready_fields(config, children))
        except BaseException:
            failure.stopping()
            service.close()
            raise

        def close() -> None:
            failure.stopping()
            _close(service, front, children, group)
        return run_until_signalled(service, server, close, failure.event, spec.timeout_s + _FAILED_EXTRA_WAIT_S)
    finally:
        if children is not None:
            children.stop()


def _front(service: WorkerBase, children: ChildRanks, failure: GroupFailure) -> EPFront:
    """Rank 0's front over its children, once each printed READY; the watch on them starts here."""
    addresses = children.wait_ready(RANK_READY_TIMEOUT_S)
    holdings = RankHoldings(1 + len(addresses))
    front = EPFront(service, addresses, alive=children.alive, holdings=holdings)
    failure.listen(front.fail)
    front.relay = _relay(service, children, holdings)

    children.watch(lambda exited: failure.fail(children.exit_reason(exited)))
    return front


def _relay(service: WorkerBase, children: ChildRanks, holdings: RankHoldings) -> EventRelay | None:
    """Every rank's KV events into `holdings`; ranks 1..N-1's onto rank 0's stream (the router sees the group)."""
    publisher = service.events.publisher
    if publisher is None:
        return None
    streams = [(0, service.worker_id, service.events.endpoint, service.events.replay_endpoint)]
    streams += [(c.rank, c.worker_id, c.events_endpoint, c.replay_endpoint) for c in children.ranks]
    return EventRelay(holdings, streams, publisher.publish_batch)


def _failure_reason(config: WorkerConfig, children: ChildRanks | None, exc: BaseException) -> str:
    """Why the engine loop saw the group break. On rank 0 a collective fails the moment a child dies, usually
    before the watch sees the exit: wait a moment for it, so the reason names the rank (engine thread, once)."""
    exited = children.wait_exit(_EXIT_NOTICE_S) if children is not None else None
    if exited is not None:
        return children.exit_reason(exited)
    return f"expert-parallel group failed on rank {config.ep_rank}: {exc}"


def _ready_fields(config: WorkerConfig, children: ChildRanks | None) -> str:
    """`ep=RANK/N`, and on rank 0 its children's addresses and pids in rank order (tests kill a rank by its pid)."""
    fields = f"ep={config.ep_rank}/{config.expert_parallel}"
    if children is not None:
        fields += (f" ep_ranks={','.join(c.address for c in children.ranks)}"
                   f" ep_pids={','.join(str(c.pid) for c in children.ranks)}")
    return fields


def _not_serving(service: WorkerBase) -> None:
    service.draining = True  # NOTE: takes nothing new at once, before the main thread wakes
    if service.health_servicer is not None:
        service.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)


def _close(service: WorkerBase, front: EPFront | None, children: ChildRanks | None, group: Any) -> None:
    """Children first (their group ends with ours either way), then this rank; the group's close is bounded."""
    if children is not None:
        children.stop()
    service.close()
    if front is not None:
        front.close()
    closer = threading.Thread(target=group.close, name="ep-group-close", daemon=True)
    closer.start()
    closer.join(5.0)  # NOTE: a broken group may block in its transport; the process exits regardless
