"""How a request leaves the engine thread tells its handler what to answer: its client's abort is a finish reason
("abort"); the worker's own failure (a step or an output handler that raised, a shutdown) is a `Failure`, which the
gRPC sinks turn into an error status, never a finished stream."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from strata.v1 import common_pb2
from worker_common.engine_loop import EngineLoop, Failure, Tracked
from worker_common.streaming import StreamingRequest


class OneTokenEngine:
    """Each step emits token 7 for every request, or raises `error` when set."""

    def __init__(self, error: Exception | None = None) -> None:
        self.requests: dict[str, Request] = {}
        self.block_manager = SimpleNamespace(pool=SimpleNamespace(release=lambda ids: None))
        self.error = error

    def add(self, request_id: str) -> Request:
        request = self.requests[request_id] = Request(request_id, [1, 2], SamplingParams(max_tokens=100))
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def step(self) -> list[RequestOutput]:
        if self.error is not None:
            raise self.error
        for request in self.requests.values():
            request.status = RequestStatus.RUNNING
            request.append_output(7)
        return [RequestOutput(r.request_id, [7], "", list(r.output_token_ids), "", False, None, 0, 2)
                for r in self.requests.values()]


class Sink(Tracked):
    def __init__(self, request: Request, raise_on_output: bool = False) -> None:
        super().__init__(request)
        self.raise_on_output = raise_on_output
        self.aborted: str | None = None
        self.failure: Failure | None = None
        self.ended = threading.Event()

    def on_output(self, output, now) -> bool:
        if self.raise_on_output:
            raise KeyError("bad output")
        return False

    def on_abort(self, reason: str) -> None:
        self.aborted = reason
        self.ended.set()

    def on_fail(self, failure: Failure) -> None:
        self.failure = failure
        self.ended.set()


@pytest.fixture
def run_loop():
    loops = []

    def start(engine: OneTokenEngine) -> EngineLoop:
        loop = EngineLoop(SimpleNamespace(engine=engine))
        loop.start()
        loops.append(loop)
        return loop
    yield start
    for loop in loops:
        loop.stop()


def admit(loop: EngineLoop, engine: OneTokenEngine, request_id: str, **kw) -> Sink:
    def run() -> Sink:
        sink = Sink(engine.add(request_id), **kw)
        loop.track(sink)
        return sink
    return loop.post(run).result(timeout=5)


def test_a_failing_step_fails_every_request_with_its_exception(run_loop):
    engine = OneTokenEngine(error=RuntimeError("device lost"))
    loop = run_loop(engine)
    sinks = [admit(loop, engine, "a"), admit(loop, engine, "b")]
    for sink in sinks:
        assert sink.ended.wait(5)
        assert sink.aborted is None
        assert sink.failure == Failure("engine step failed", "RuntimeError: device lost", retryable=False)
    assert not engine.requests


def test_a_failing_output_handler_fails_only_its_request(run_loop):
    engine = OneTokenEngine()
    loop = run_loop(engine)
    bad, good = admit(loop, engine, "bad", raise_on_output=True), admit(loop, engine, "good")
    assert bad.ended.wait(5)
    assert bad.failure.reason == "worker error while handling output" and "KeyError" in bad.failure.detail
    assert not good.ended.is_set() and "good" in engine.requests


def test_the_client_abort_stays_an_abort_and_a_shutdown_is_retryable(run_loop):
    engine = OneTokenEngine()
    loop = run_loop(engine)
    aborted, running = admit(loop, engine, "x"), admit(loop, engine, "y")
    assert loop.abort("x", "aborted by Abort").result(timeout=5) is True
    assert aborted.aborted == "aborted by Abort" and aborted.failure is None
    loop.stop()
    assert running.failure == Failure("worker shutting down", retryable=True)


def test_a_streaming_request_ends_its_stream_with_the_failure_not_a_finish_reason():
    text = SimpleNamespace(push=lambda ids, final: SimpleNamespace(text="", stop_str=None))
    sink = StreamingRequest(text, SamplingParams())
    sink.on_fail(Failure("engine step failed", "RuntimeError: boom"))
    event = sink.events.get_nowait()
    assert event.failure == Failure("engine step failed", "RuntimeError: boom")
    assert event.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    sink.on_abort("client gone")
    assert sink.events.get_nowait().finish_reason == common_pb2.FINISH_REASON_ABORT
