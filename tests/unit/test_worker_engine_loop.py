"""The engine thread: commands run between steps, outputs fan out to their request, aborts and engine failures
end requests instead of leaving their handlers waiting (no hang)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from worker_common.engine_loop import EngineLoop, Tracked


class FakePool:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, ids) -> None:
        self.released += list(ids)


class FakeEngine:
    """Each step emits one token per running request; a request finishes after `length` tokens."""

    def __init__(self, fail_steps: bool = False) -> None:
        self.requests: dict[str, Request] = {}
        self.block_manager = SimpleNamespace(pool=FakePool())
        self.fail_steps = fail_steps
        self.aborted: list[str] = []

    def add(self, request_id: str, length: int) -> Request:
        request = Request(request_id, [1, 2], SamplingParams(max_tokens=length))
        self.requests[request_id] = request
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def step(self) -> list[RequestOutput]:
        if self.fail_steps:
            raise RuntimeError("device lost")
        outputs = []
        for request in list(self.requests.values()):
            request.status = RequestStatus.RUNNING
            request.append_output(7)
            done = request.num_output_tokens >= request.params.max_tokens
            if done:
                del self.requests[request.request_id]
            outputs.append(RequestOutput(request.request_id, [7], "", list(request.output_token_ids), "", done,
                                         "length" if done else None, 0, 2))
        return outputs


class Recorder(Tracked):
    def __init__(self, request: Request, stop_after: int | None = None) -> None:
        super().__init__(request)
        self.tokens: list[int] = []
        self.aborted = ""
        self.finished = threading.Event()
        self.stop_after = stop_after

    def on_output(self, output, now) -> bool:
        self.tokens += output.new_token_ids
        if output.finished:
            self.finished.set()
        return self.stop_after is not None and len(self.tokens) >= self.stop_after

    def on_abort(self, reason: str) -> None:
        self.aborted = reason
        self.finished.set()


@pytest.fixture
def loop_of():
    loops = []

    def make(engine: FakeEngine) -> EngineLoop:
        loop = EngineLoop(SimpleNamespace(engine=engine))
        loop.start()
        loops.append(loop)
        return loop
    yield make
    for loop in loops:
        loop.stop()


def admit(loop: EngineLoop, engine: FakeEngine, request_id: str, length: int, pinned=(), **kw) -> Recorder:
    def run() -> Recorder:
        tracked = Recorder(engine.add(request_id, length), **kw)
        tracked.pinned = list(pinned)
        loop.track(tracked)
        return tracked
    return loop.post(run).result(timeout=5)


def test_outputs_reach_their_request_and_pins_are_released_at_the_end(loop_of):
    engine = FakeEngine()
    loop = loop_of(engine)
    a, b = admit(loop, engine, "a", 3, pinned=[4, 5]), admit(loop, engine, "b", 1)
    assert a.finished.wait(5) and b.finished.wait(5)
    assert (a.tokens, b.tokens) == ([7, 7, 7], [7])
    assert a.scheduled_at is not None and a.scheduled_at >= a.arrived_at
    assert engine.block_manager.pool.released == [4, 5]
    assert loop.num_tracked == 0


def test_a_sink_that_ends_its_request_aborts_it_in_the_engine(loop_of):
    engine = FakeEngine()
    loop = loop_of(engine)
    tracked = admit(loop, engine, "stop-string", 100, stop_after=2)
    deadline = time.monotonic() + 5
    while "stop-string" not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tracked.tokens == [7, 7] and "stop-string" in engine.aborted
    assert loop.post(lambda: loop.num_tracked).result(timeout=5) == 0


def test_abort_ends_the_request_once(loop_of):
    engine = FakeEngine()
    loop = loop_of(engine)
    tracked = admit(loop, engine, "x", 10_000)
    assert loop.abort("x", "aborted by Abort").result(timeout=5) is True
    assert tracked.finished.wait(5) and tracked.aborted == "aborted by Abort"
    assert loop.abort("x", "again").result(timeout=5) is False


def test_a_failing_step_aborts_every_request_instead_of_hanging(loop_of):
    engine = FakeEngine(fail_steps=True)
    loop = loop_of(engine)
    tracked = admit(loop, engine, "y", 5, pinned=[9])
    assert tracked.finished.wait(5)
    assert tracked.aborted == "engine step failed" and engine.block_manager.pool.released == [9]


def test_a_failing_command_reports_to_its_caller_only(loop_of):
    loop = loop_of(FakeEngine())
    with pytest.raises(ValueError, match="bad"):
        loop.post(lambda: (_ for _ in ()).throw(ValueError("bad"))).result(timeout=5)
    assert loop.post(lambda: 42).result(timeout=5) == 42
