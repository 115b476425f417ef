"""OpenAI-compatible HTTP API on the router (issue 5 item 2): works with the official `openai` client unchanged.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics (Prometheus)

Requests go through `router.openai_request` (400 naming the field, OpenAI's error body) and the same `Dispatcher` as
gRPC; `router.openai_responses` shapes the answers. A client that disconnects mid-stream cancels the request on every worker.
A request that fails (no worker could serve it, or the router broke) is never a finished choice: an HTTP 4xx/5xx with
OpenAI's error body, or, once a stream has started, a last `data: {"error": {...}}` event (which the `openai` client
raises as `APIError`) before `[DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

import anyio
import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.auth import ApiKeys, BearerAuth
from router.body_limit import BodyLimit
from router.dispatch import Dispatcher
from router.events_feed import EventsFeed
from router.request_run import RequestRun
from router.registry import WorkerRegistry
from router.openai_request import OpenAIOptions, batch_params, from_chat, from_completion, parse_body
from router.openai_responses import FINISH_REASONS, Choice, Shape, error_body, error_response, merged_usage
from router.validation import MAX_REQUEST_BYTES, ApiError, GenerateParams
from router.vllm_http import VllmDoor, mount_admin
from router.vllm_workers import VllmFleet
from strata.cache_metrics import CacheTierCollector, Snapshot
from strata.v1 import common_pb2

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# ------------------------------------------------------------------------------------------------ metrics

class RouterMetrics:
    """The router's Prometheus metrics (its own registry, so several routers can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("strata_router_requests", "Finished requests by front door and outcome "
                                "(finish reason or error code)", ["door", "outcome"], registry=r)
        self.routes = Counter("strata_router_routes", "Requests by route taken", ["route"], registry=r)
        self.retries = Counter("strata_router_step_retries", "Worker steps retried on another worker", registry=r)
        self.ttft = Histogram("strata_router_ttft_seconds", "Arrival to the first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.latency = Histogram("strata_router_request_seconds", "Arrival to the last chunk",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("strata_router_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("strata_router_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("strata_router_cached_tokens", "Prompt tokens served from a KV cache tier",
                                     registry=r)
        self.inflight = Gauge("strata_router_inflight_requests", "Requests in flight", registry=r)
        self.workers = Gauge("strata_router_workers", "Registered workers by role and state", ["role", "state"],
                             registry=r)
        self.index_blocks = Gauge("strata_router_index_blocks", "Distinct blocks in the global prefix index",
                                  registry=r)
        self.event_batches = Gauge("strata_router_kv_event_batches", "KV-event batches applied, per worker",
                                   ["worker"], registry=r)
        self.event_resyncs = Gauge("strata_router_kv_event_resyncs", "Index resyncs after lost KV events, per worker",
                                   ["worker"], registry=r)
        self.event_unknown = Gauge("strata_router_kv_event_unknown", "KV-event parts skipped as unknown, per worker "
                                   "(medium, event type, field)", ["worker", "what"], registry=r)

    def on_proxied(self, status: int) -> None:
        """A request proxied to a vLLM worker (its usage stays with that worker's own metrics)."""
        self.routes.labels("vllm").inc()
        self.requests.labels("http", f"vllm_{status}").inc()

    def on_finish(self, door: str, outcome: str, usage: common_pb2.Usage | None, ttft_s: float | None,
                  total_s: float, route: str, retries: int) -> None:
        self.requests.labels(door, outcome).inc()
        if route:
            self.routes.labels(route).inc()
        self.retries.inc(retries)
        self.latency.observe(total_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.completion_tokens.inc(usage.completion_tokens)
            self.cached_tokens.inc(usage.cached_tokens)

    def enable_cache_metrics(self, snapshot: Callable[[], Snapshot]) -> None:
        """Add every worker's per-tier cache counters (`strata_cache_*{worker, tier}`), asked at scrape time."""
        self.registry.register(CacheTierCollector(snapshot))

    def render(self, dispatcher: Dispatcher, registry: WorkerRegistry, feed: EventsFeed | None = None) -> bytes:
        self.inflight.set(dispatcher.num_inflight())
        self.index_blocks.set(dispatcher.index.num_blocks())
        if feed is not None:
            self.event_batches.clear()
            self.event_resyncs.clear()
            self.event_unknown.clear()
            for worker_id, stats in feed.stats().items():
                self.event_batches.labels(worker_id).set(stats.batches)
                self.event_resyncs.labels(worker_id).set(stats.resyncs)
                for what in ("media", "events", "fields"):
                    self.event_unknown.labels(worker_id, what).set(getattr(stats, f"unknown_{what}"))
        counts: dict[tuple[str, str], int] = {(role, state): 0 for role in ("prefill", "decode", "both")
                                              for state in ("ready", "draining", "dead")}
        for view in registry.workers(include_dead=True):
            counts[(view.record.role, view.state)] += 1
        for (role, state), n in counts.items():
            self.workers.labels(role, state).set(n)
        return generate_latest(self.registry)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


# ------------------------------------------------------------------------------------------------ the app

async def _chunks(run: RequestRun) -> AsyncIterator:
    """A run's chunks on the event loop. One thread of its own drives the blocking stream and hands each chunk over
    (`call_soon_threadsafe`): no thread-pool hop per chunk, and nothing shared with the app's other blocking calls
    (anyio's 40-thread default limiter), so streams stuck on a slow worker never stall other requests. The buffer
    holds at most the request's own tokens."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def hand_over(item: tuple) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed (shutdown): nobody is reading

    def drive() -> None:
        try:
            for chunk in run.events():
                hand_over((chunk, None))
            hand_over((None, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            hand_over((None, exc))

    threading.Thread(target=drive, name=f"http-stream-{run.request_id}", daemon=True).start()
    while True:
        chunk, error = await queue.get()
        if error is not None:
            raise error
        if chunk is None:
            return
        yield chunk


def create_app(dispatcher: Dispatcher, registry: WorkerRegistry, metrics: RouterMetrics,
               feed: EventsFeed | None = None, is_ready: Callable[[], bool] = lambda: True,
               keys: ApiKeys = ApiKeys(), max_request_bytes: int = MAX_REQUEST_BYTES,
               fleet: VllmFleet | None = None, allow_admin: bool = True) -> FastAPI:
    """`keys`: with any, every route but /health and /metrics wants a known bearer key (`router.auth`).
    `max_request_bytes`: a larger body is a 413 before it is parsed (`router.body_limit`; 0 = no limit).
    `fleet`: vLLM workers beside Strata's (`router.vllm_http`: requests proxied to them, /admin/workers)."""
    app = FastAPI(title="Strata router (OpenAI-compatible)", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)  # NOTE: added first = inside the key check
    app.add_middleware(BearerAuth, keys=keys)
    door = None
    if fleet is not None:
        mount_admin(app, fleet, allow_admin)
        door = VllmDoor(fleet, dispatcher, lambda request: _identity(request, keys), metrics.on_proxied)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = [v for v in registry.workers() if v.state == "ready"]
        ready += [v for v in (fleet.registry.workers() if fleet is not None else ()) if v.state == "ready"]
        roles = {v.record.role for v in ready}
        ok = is_ready() and bool(ready) and ("decode" in roles or "both" in roles)
        return JSONResponse({"status": "ok" if ok else "unavailable", "workers": len(ready)},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        # NOTE: off the event loop: rendering asks the workers for their cache stats (bounded by a timeout).
        body = await anyio.to_thread.run_sync(metrics.render, dispatcher, registry, feed)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _model_object(m, created: int) -> dict[str, Any]:
        return {"id": m.id, "object": "model", "created": created, "owned_by": "strata",
                "max_model_len": m.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [_model_object(m, created) for m in dispatcher.models.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """One model (the official client's `models.retrieve`); an unknown id is 404 with OpenAI's error body."""
        served = dispatcher.models.get(model_id)
        if served is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"model {model_id!r} is not served here; served: "
                                                      f"{', '.join(sorted(dispatcher.models))}", "model")
        return _model_object(served, int(time.time()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        if door is not None and (proxied := await door.serve(request, body, "/v1/completions")) is not None:
            return proxied
        params, options = from_completion(body, dispatcher.limits, _request_id(request))
        return await _serve(request, params, options)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        if door is not None and (proxied := await door.serve(request, body, "/v1/chat/completions")) is not None:
            return proxied
        model_name = body.get("model") if isinstance(body, dict) else None
        model = dispatcher.models.get(model_name) if isinstance(model_name, str) else None
        render = model.render_chat if model is not None else next(iter(dispatcher.models.values())).render_chat
        params, options = from_chat(body, dispatcher.limits, _request_id(request), render)
        stops = dispatcher.models[params.model].chat_stop_token_ids
        if stops:  # NOTE: ChatML ends a turn with <|im_end|>, which is not the checkpoint's EOS
            sampling = replace(params.sampling, stop_token_ids=tuple(params.sampling.stop_token_ids) + stops)
            params = replace(params, sampling=sampling)
        return await _serve(request, params, options)

    def _tokenizer(params: GenerateParams):
        return dispatcher.models[params.model].tokenizer

    def _echo_text(run: RequestRun) -> str:
        """The prompt as `echo` repeats it: its text, or a token-id prompt decoded (special tokens kept, as the
        logprobs that describe it list them)."""
        if run.params.prompt_text is not None:
            return run.params.prompt_text
        return _tokenizer(run.params).decode(list(run.prompt), skip_special_tokens=False)

    async def _serve(request: Request, params: GenerateParams, options: OpenAIOptions) -> Response:
        peer = request.client.host if request.client is not None else ""
        runs = await anyio.to_thread.run_sync(_start, params, options, _identity(request, keys), peer)
        if options.stream:
            return StreamingResponse(_stream(runs, params, options), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(runs, params, options)

    def _start(params: GenerateParams, options: OpenAIOptions, identity: str, peer: str) -> list[RequestRun]:
        """One run per choice; none at all when any cannot start (a full router, a clashing request id)."""
        runs: list[RequestRun] = []
        try:
            for child in batch_params(params, options):
                runs.append(dispatcher.start(child, identity, None, "http", peer))
        except BaseException:
            for run in runs:
                dispatcher.finish(run, "not_started", None)
            raise
        return runs

    async def _collect(run: RequestRun) -> tuple[Choice, common_pb2.Usage]:
        text, logprobs, prompt_logprobs, finish, usage = [], [], [], None, common_pb2.Usage()
        async for chunk in _chunks(run):
            text.append(chunk.text_delta)
            logprobs.extend(chunk.logprobs)
            prompt_logprobs.extend(chunk.prompt_logprobs)
            if chunk.finish_reason:
                finish, usage = FINISH_REASONS.get(chunk.finish_reason), chunk.usage
        return Choice("".join(text), finish, logprobs, prompt_logprobs), usage

    async def _whole(runs: list[RequestRun], params: GenerateParams, options: OpenAIOptions) -> JSONResponse:
        try:
            results = await asyncio.gather(*(_collect(run) for run in runs), return_exceptions=True)
        except asyncio.CancelledError:
            for run in runs:
                run.cancel()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for run in runs:
                run.cancel()
            api = next((e for e in errors if isinstance(e, ApiError)), None)
            if api is None and not isinstance(errors[0], Exception):
                raise errors[0]  # cancelled: nobody is waiting for an answer
            if api is None:  # NOTE: the router's own failure gets OpenAI's error body too, not a bare 500
                log.error("request %s failed in the router", params.request_id, exc_info=errors[0])
                api = ApiError(grpc.StatusCode.INTERNAL, f"internal: {errors[0]}")
            return error_response(api)
        choices = [choice._replace(text=_echo_text(run) + choice.text) if options.echo else choice
                   for run, (choice, _) in zip(runs, results)]
        usage = merged_usage({i: u for i, (_, u) in enumerate(results)}, options.n)
        shape = Shape(params, options, _tokenizer(params))
        return JSONResponse(shape.whole(choices, usage, [run.prompt[0] for run in runs]))

    async def _stream(runs: list[RequestRun], params: GenerateParams,
                      options: OpenAIOptions) -> AsyncIterator[bytes]:
        """Every choice's chunks as they come, each tagged with its index; one error ends the whole stream."""
        shape = Shape(params, options, _tokenizer(params))
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, run: RequestRun) -> None:
            try:
                async for chunk in _chunks(run):
                    await queue.put((index, chunk, None))
                await queue.put((index, None, None))
            except Exception as exc:  # noqa: BLE001 - any failure ends the stream with an error body, never a hang
                error = exc if isinstance(exc, ApiError) else ApiError(grpc.StatusCode.INTERNAL, f"internal: {exc}")
                await queue.put((index, None, error))

        tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
        usages: dict[int, common_pb2.Usage] = {}
        try:
            first = [True] * len(runs)
            # NOTE: an echo whose prompt carries logprobs waits for them (they come with the first tokens)
            echo_now = options.echo and not shape.echo_logprobs
            if options.chat or echo_now:
                for i, run in enumerate(runs):
                    yield _sse(shape.delta(i, _echo_text(run) if options.echo else None, None, first=True))
                    first[i] = False
            running = len(runs)
            while running:
                index, chunk, error = await queue.get()
                if error is not None:
                    for run in runs:
                        run.cancel()
                    yield _sse(error_body(error))
                    break
                if chunk is None:
                    running -= 1
                    continue
                finish = FINISH_REASONS.get(chunk.finish_reason) if chunk.finish_reason else None
                prompt = (runs[index].prompt[0], chunk.prompt_logprobs)
                if shape.echo_logprobs and first[index]:      # the held-back echo, its prompt logprobs with it
                    yield _sse(shape.delta(index, _echo_text(runs[index]), None, first=True, prompt=prompt))
                    first[index] = False
                elif chunk.prompt_logprobs:
                    yield _sse(shape.delta(index, None, None, first=first[index], prompt=prompt))
                    first[index] = False
                if chunk.text_delta or finish or chunk.logprobs:
                    yield _sse(shape.delta(index, chunk.text_delta, finish, first=first[index],
                                           logprobs=chunk.logprobs))
                    first[index] = False
                if chunk.finish_reason:
                    usages[index] = chunk.usage
            else:
                if options.include_usage and usages:
                    yield _sse(shape.usage_chunk(merged_usage(usages, options.n)))
        except BaseException:
            for run in runs:
                run.cancel()  # client gone (the response task is cancelled): the workers stop too
            raise
        finally:
            for task in tasks:
                task.cancel()
        yield b"data: [DONE]\n\n"

    return app


async def _json_body(request: Request) -> Any:
    return parse_body(await request.body())


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if 0 < len(given) <= 128 else uuid.uuid4().hex


def _identity(request: Request, keys: ApiKeys) -> str:
    return keys.identity(request.headers.get("authorization", ""))
