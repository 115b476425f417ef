"""A request whose outputs stream back to a gRPC handler thread, with the worker's text and stop-string rules."""
from __future__ import annotations

import queue
import time
from typing import Callable, Iterator, NamedTuple

import grpc

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from strata.v1 import common_pb2
from worker_common.convert import FINISH_REASONS, stop_reason_fields
from worker_common.engine_loop import Failure, Tracked
from worker_common.text_stream import TextStream

_POLL_S = 0.1


class StreamEvent(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: int           # common_pb2.FinishReason; UNSPECIFIED while the request runs
    stop_fields: dict            # the stop_reason oneof, on the last event only
    completion_tokens: int       # outputs so far, a first token sampled elsewhere included
    cached_tokens: int           # prompt tokens the engine took from its prefix cache
    error: str = ""
    logprobs: tuple = ()         # engine.outputs.TokenLogprobs per token, when the request asked for them
    prompt_logprobs: tuple = ()  # TokenLogprobs per prompt token after the first: the first event that has them
    failure: Failure | None = None  # the worker failed the request: the last event, answered with an error status


class StreamingRequest(Tracked):
    """Engine-thread side: turns each `RequestOutput` into a `StreamEvent` on `events` (read by the handler)."""

    def __init__(self, text: TextStream, params: SamplingParams,
                 on_finish: Callable[["StreamingRequest"], None] | None = None, carry_text: str = "") -> None:
        super().__init__(None)  # the request is set when the engine thread admits it
        self.text, self.params, self.on_finish = text, params, on_finish
        self.carry_text = carry_text  # text of a migrated request's earlier tokens: goes out with the first event
        self.events: queue.Queue[StreamEvent] = queue.Queue()
        self.first_output_at: float | None = None
        self.last_output_at: float | None = None
        self._prompt_logprobs_sent = False

    def on_output(self, output: RequestOutput, now: float) -> bool:
        if not output.new_token_ids and not output.finished:
            return False  # a prompt chunk whose prompt logprobs were recorded: they come with the first token
        self.first_output_at = self.first_output_at or now
        self.last_output_at = now
        delta = self.text.push(output.new_token_ids, output.finished)
        reason, stop = common_pb2.FINISH_REASON_UNSPECIFIED, {}
        if delta.stop_str is not None:
            reason, stop = common_pb2.FINISH_REASON_STOP, {"stop_str": delta.stop_str}
        elif output.finished:
            reason = FINISH_REASONS[output.finish_reason]
            if reason == common_pb2.FINISH_REASON_STOP:
                stop = stop_reason_fields(None, output.token_ids[-1], self.params)
        if reason != common_pb2.FINISH_REASON_UNSPECIFIED and self.on_finish is not None:
            self.on_finish(self)  # NOTE: before the event: the stream's end means the blocks are stored
        prompt_logprobs = ()
        if not self._prompt_logprobs_sent and output.prompt_logprobs:  # NOTE: read once, not every step
            prompt_logprobs, self._prompt_logprobs_sent = tuple(output.prompt_logprobs[1:]), True
        # NOTE: a stop string inside a multi-token (speculative) step ends the request at its token: the rest go
        dropped = len(output.new_token_ids) - delta.num_tokens
        text, self.carry_text = self.carry_text + delta.text, ""
        self.events.put(StreamEvent(list(output.new_token_ids[:delta.num_tokens]), text, reason, stop,
                                    output.completion_tokens - dropped, output.num_cached_tokens, "",
                                    tuple(output.new_logprobs or ())[:delta.num_tokens], prompt_logprobs))
        return delta.stop_str is not None

    def on_abort(self, reason: str) -> None:
        outputs = self.request.num_output_tokens if self.request is not None else 0
        self.events.put(StreamEvent([], "", common_pb2.FINISH_REASON_ABORT, {}, outputs, 0, reason))

    def on_fail(self, failure: Failure) -> None:
        outputs = self.request.num_output_tokens if self.request is not None else 0
        self.events.put(StreamEvent([], "", common_pb2.FINISH_REASON_UNSPECIFIED, {}, outputs, 0, str(failure),
                                    failure=failure))


def wait_events(tracked: StreamingRequest, context: grpc.ServicerContext) -> Iterator[StreamEvent]:
    """Events until the last one (finished, aborted or failed); stops early (the caller aborts the request) once
    the client is gone."""
    while True:
        try:
            event = tracked.events.get(timeout=_POLL_S)
        except queue.Empty:
            if not context.is_active():
                return
            continue
        yield event
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED or event.failure is not None:
            return


def ms(seconds: float | None) -> float:
    return 0.0 if seconds is None else max(0.0, seconds * 1000.0)


def now() -> float:
    return time.perf_counter()
