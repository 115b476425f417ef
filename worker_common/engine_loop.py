"""The engine thread: the only thread that touches the engine, its block manager and its paged cache.

gRPC handlers never call the engine. They `post` closures to this thread (add a request, install pulled KV, abort)
and wait on their own queues; the loop runs `LLMEngine.step()` while anything is unfinished and hands each output
to the request's `Tracked` sink, still on the engine thread (so a sink may read the cache before the next step
can overwrite a freed block).

    handler threads --post(fn)--> [commands] --> engine thread: drain commands, step(), fan out to sinks

After each step (before its outputs fan out) and each batch of commands, the loop publishes the device tier's
buffered KV events (`events.flush()`) and refreshes the load snapshot (`load.snapshot`, read by Stats/heartbeats).

A request leaves the loop one of three ways, and its sink hears which: finished (`on_output` with a finished output),
ended by its client (`on_abort`: Abort, cancel, client gone; the client sees finish reason "abort"), or failed by the
worker (`on_fail`: the engine step or its output handler raised, the worker is shutting down; the client must see an
error status, never a finish reason).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, TypeVar

from engine.moe.ep_group import EPGroupError
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from worker_common.engine_setup import EngineBundle
from worker_common.load import LoadTracker, computed_tokens

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05
# NOTE: an expert-parallel rank with nothing to do still joins a step this often (a rank that gets a request waits
# at most this long for an idle peer to join it); one all-reduce per turn.
_LOCKSTEP_IDLE_WAIT_S = 0.01


class Failure(NamedTuple):
    """Why the worker, not the client, ended a request. `retryable`: the worker is going away and another one may
    serve the request (gRPC UNAVAILABLE); otherwise the worker failed it (INTERNAL)."""

    reason: str                 # "engine step failed", "worker error while handling output", ...
    detail: str = ""            # the exception, when there was one
    retryable: bool = False

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


def failure_of(reason: str, exc: BaseException) -> Failure:
    return Failure(reason, f"{type(exc).__name__}: {exc}")


class Tracked:
    """One request the loop fans out to. Subclasses override the `on_*` hooks (called on the engine thread).

    `pinned` are block ids the worker took a reference on (installed KV); the loop releases them when the request
    leaves, whatever the reason. `handed_over_blocks`: leading blocks another worker computed and stored (a Decode's
    hand-off), which this worker does not write to its store again.
    """

    def __init__(self, request: Request | None) -> None:
        self.request = request
        self.arrived_at = time.perf_counter()
        self.scheduled_at: float | None = None
        self.pinned: list[int] = []
        self.handed_over_blocks = 0

    def on_output(self, output: RequestOutput, now: float) -> bool:
        """Handle one step's output; return True to end the request now (e.g. a stop string matched)."""
        return False

    def on_abort(self, reason: str) -> None:
        """Its client ended the request before it finished (Abort, cancel, client gone)."""

    def on_fail(self, failure: Failure) -> None:
        """The worker could not finish the request. The gRPC sinks answer with an error status; this default ends
        the request like an abort, so that a sink knowing no failures is never left waiting."""
        self.on_abort(failure.reason)


class EngineLoop:
    def __init__(self, bundle: EngineBundle, name: str = "engine", events: Any | None = None) -> None:
        """`events`: anything with `flush()` (the device tier's `DeviceEvents`), called on the engine thread."""
        self.bundle = bundle
        self.engine = bundle.engine
        self.events = events
        self.load = LoadTracker()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._tracked: dict[str, Tracked] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0
        # expert parallel: called once, on the engine thread, after a collective failed and every in-flight
        # request was failed (retryable); the worker then leaves (the group cannot be used again)
        self.on_group_failure: Callable[[EPGroupError], None] | None = None
        self.group_end_expected = False   # the worker is shutting down: a group that breaks now is no error

    # ---- any thread -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)

    def post(self, fn: Callable[[], T]) -> Future:
        """Run `fn` on the engine thread between steps; its result or exception lands in the future."""
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(exc)
        self._commands.put(run)
        return future

    def abort(self, request_id: str, reason: str) -> Future:
        """End a request at its client's wish (idempotent); the future's result says whether it was in flight."""
        return self.post(lambda: self._abort(request_id, reason))

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    # ---- engine thread only ---------------------------------------------------------------------------------

    def track(self, tracked: Tracked) -> None:
        self._tracked[tracked.request.request_id] = tracked

    def _abort(self, request_id: str, reason: str) -> bool:
        tracked = self._remove(request_id)
        if tracked is not None:
            tracked.on_abort(reason)
        return tracked is not None

    def _fail(self, request_id: str, failure: Failure) -> None:
        tracked = self._remove(request_id)
        if tracked is not None:
            tracked.on_fail(failure)

    def _remove(self, request_id: str) -> Tracked | None:
        """Out of the engine and the loop, its pins released; the sink it had, if any."""
        tracked = self._tracked.pop(request_id, None)
        self.engine.abort(request_id)
        if tracked is not None:
            self._release(tracked)
        return tracked

    def _release(self, tracked: Tracked) -> None:
        if tracked.pinned:
            self.engine.block_manager.pool.release(tracked.pinned)
            tracked.pinned = []

    def _run(self) -> None:
        lockstep = getattr(self.engine, "lockstep", False)   # expert parallel: every turn is a group step
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished() or lockstep and not self.engine.group_idle
            self._drain(block=not busy, wait_s=_LOCKSTEP_IDLE_WAIT_S if lockstep else _IDLE_WAIT_S)
            if (lockstep or self.engine.has_unfinished()) and not self._stopping.is_set():
                if not self._step():
                    break
        for request_id in list(self._tracked):
            self._fail(request_id, Failure("worker shutting down", retryable=True))

    def _drain(self, block: bool, wait_s: float = _IDLE_WAIT_S) -> None:
        ran = False
        try:
            command = self._commands.get(timeout=wait_s) if block else self._commands.get_nowait()
            while True:
                command()
                ran = True
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        if ran:
            self._after_change()

    def _after_change(self) -> None:
        if self.events is not None:
            self.events.flush()
        self.load.refresh(self._requests())

    def _requests(self) -> list[Request]:
        return [t.request for t in self._tracked.values() if t.request is not None]

    def _step(self) -> bool:
        """One engine step and its fan-out; False when the loop must end (the expert-parallel group broke)."""
        requests = self._requests()
        computed_before = computed_tokens(requests)
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except EPGroupError as exc:
            self._group_failed(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - fail the requests, keep the worker serving
            log.exception("engine step failed; failing every in-flight request")
            for request_id in list(self._tracked):
                self._fail(request_id, failure_of("engine step failed", exc))
            self._after_change()
            return True
        self.num_steps += 1
        now = time.perf_counter()
        if requests:
            # NOTE: a preempted request's counter went back to 0, so the difference may undercount; never negative.
            self.load.observe_step(computed_tokens(requests) - computed_before, now - started)
        if self.events is not None:
            self.events.flush()  # NOTE: before the outputs: a sink's store writes publish host after device
        for tracked in self._tracked.values():
            if tracked.scheduled_at is None and tracked.request.status is not RequestStatus.WAITING:
                tracked.scheduled_at = started
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            try:
                end_now = tracked.on_output(output, now)
            except Exception as exc:  # noqa: BLE001 - one request's sink must not stop the loop
                log.exception("output handler of %s failed", output.request_id)
                self._fail(output.request_id, failure_of("worker error while handling output", exc))
                continue
            if output.finished or end_now:
                if not output.finished:
                    self.engine.abort(output.request_id)
                self._release(self._tracked.pop(output.request_id))
        self._after_change()
        return True

    def _group_failed(self, exc: EPGroupError) -> None:
        """A rank of the expert-parallel group is gone: fail everything here as retryable elsewhere, then tell the
        worker (which leaves: the group cannot step again)."""
        # NOTE: a group whose other ranks stop on purpose (SIGTERM) breaks too: no error then
        level = logging.INFO if self._stopping.is_set() or self.group_end_expected else logging.ERROR
        log.log(level, "%s; failing %d in-flight request(s)", exc, len(self._tracked))
        for request_id in list(self._tracked):
            self._fail(request_id, Failure("expert-parallel group failed", str(exc), retryable=True))
        self._after_change()
        self._stopping.set()
        if self.on_group_failure is not None:
            self.on_group_failure(exc)
