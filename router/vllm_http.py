"""The router's HTTP side of mixed fleets (issue 18 item 3): proxying OpenAI requests to vLLM workers, and the
admin API that registers them (`strata worker add|remove|list`).

    POST /v1/completions, /v1/chat/completions ──VllmDoor.serve──> mixed_routing.choose
         ├── a vLLM worker: the body (model -> its served name, cache_salt -> the salt the router hashed with)
         │   POSTed to WORKER_URL + path; its answer, streamed or whole, is the client's (x-strata-worker: id)
         └── None (or the worker cannot be reached): the request goes on to Strata's own workers

    GET    /admin/workers              the vLLM workers: registration, state, load, event feed
    POST   /admin/workers              register one (`VllmWorkerSpec.to_json`'s shape); 400 naming the field
    DELETE /admin/workers/{id}         unregister; 404 for an unknown id

Registering and removing are admin calls: refused (403) on a router started with --no-admin; with API keys on,
every route here wants a known key (`router.auth`), as every route but /health and /metrics does.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

import anyio
import grpc
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.dispatch import Dispatcher
from router.mixed_routing import MixedRoute, choose
from router.openai_request import batch_params, from_chat, from_completion
from router.validation import ApiError, effective_salt
from router.vllm_workers import FleetEntry, VllmFleet, VllmWorkerSpec

log = logging.getLogger(__name__)

_STRATA_ONLY_FIELDS = ("speculative",)  # what the router accepts and a vLLM server would refuse
_CONNECT_TIMEOUT_S = 5.0


class VllmDoor:
    """Proxies the requests `mixed_routing.choose` gives to a vLLM worker. `identity(request)` names the caller
    (its tenant: the salt); `on_proxied(status)` counts them."""

    def __init__(self, fleet: VllmFleet, dispatcher: Dispatcher, identity: Callable[[Request], str],
                 on_proxied: Callable[[int], None] = lambda status: None) -> None:
        self.fleet, self.dispatcher, self.identity, self.on_proxied = fleet, dispatcher, identity, on_proxied
        timeout = httpx.Timeout(dispatcher.config.default_timeout_s, connect=_CONNECT_TIMEOUT_S)
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)  # NOTE: the fleet's own addresses

    async def serve(self, request: Request, body: Any, path: str) -> Response | None:
        """The vLLM worker's answer, or None when Strata's own workers should serve the request."""
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return None
        resolved = self.fleet.resolve(body["model"])
        if resolved is None:
            return None
        model_id, lora = resolved

        def route() -> tuple[MixedRoute | None, str]:  # NOTE: off the event loop: tokenizing and hashing take a while
            prompt, salt = self._prompt_and_salt(request, {**body, "model": model_id}, path)
            return choose(self.fleet, self.dispatcher, self.dispatcher.models[model_id], prompt, salt, lora), salt
        chosen, salt = await anyio.to_thread.run_sync(route)
        if chosen is None:
            return None
        return await self._proxy(request, chosen, _upstream_body(body, chosen, lora, salt), path)

    def _prompt_and_salt(self, request: Request, body: dict, path: str) -> tuple[list[int], str]:
        """The prompt's token ids as the router tokenizes it (the first prompt of a batch) and the salt it hashes
        with; a body the router would refuse is refused here the same way (400 naming the field)."""
        model = self.dispatcher.models[body["model"]]
        request_id = request.headers.get("x-request-id", "") or "mixed-route"
        if path.endswith("/chat/completions"):
            params, options = from_chat(body, self.dispatcher.limits, request_id, model.render_chat)
        else:
            params, options = from_completion(body, self.dispatcher.limits, request_id)
        first = batch_params(params, options)[0]
        salt = effective_salt(first.cache_salt, self.identity(request), self.dispatcher.config.isolate_tenants)
        return model.tokenize(first), salt

    async def _proxy(self, request: Request, route: MixedRoute, body: dict, path: str) -> Response | None:
        worker = route.worker
        url = worker.url.rstrip("/") + path
        headers = {"x-request-id": request.headers["x-request-id"]} if "x-request-id" in request.headers else {}
        self.fleet.registry.begin(worker.id, route.decision.work_s, prefill_s=route.decision.work_s)
        try:
            upstream = await self._client.send(self._client.build_request("POST", url, json=body, headers=headers),
                                               stream=True)
        except httpx.HTTPError as exc:
            self.fleet.registry.end(worker.id)
            self.fleet.report_failure(worker.id, f"POST {url}: {exc}")
            log.warning("vLLM worker %s did not take a request (%s); Strata's workers serve it", worker.id, exc)
            return None
        self.on_proxied(upstream.status_code)
        log.debug("request to vLLM worker %s: %s", worker.id, route.decision.reason)
        out_headers = {"x-strata-worker": worker.id}
        media_type = upstream.headers.get("content-type", "application/json")
        if not body.get("stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                self.fleet.registry.end(worker.id)
            return Response(content, upstream.status_code, out_headers, media_type)
        return StreamingResponse(self._relay(upstream, worker.id), upstream.status_code,
                                 {**out_headers, "Cache-Control": "no-cache"}, media_type)

    async def _relay(self, upstream: httpx.Response, worker_id: str) -> AsyncIterator[bytes]:
        """The worker's stream as it comes; the client leaving closes it (vLLM then aborts the request)."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            self.fleet.registry.end(worker_id)

    async def aclose(self) -> None:
        await self._client.aclose()


def _upstream_body(body: dict, route: MixedRoute, lora: str | None, salt: str) -> dict:
    """The body the vLLM worker gets: its own model name (or the LoRA adapter's), the salt the router hashed with
    (so the worker's block hashes are the ones the router matched), no Strata-only field."""
    out = {k: v for k, v in body.items() if k not in _STRATA_ONLY_FIELDS}
    out["model"] = lora if lora is not None else route.worker.served_model_name
    if salt:
        out["cache_salt"] = salt
    else:
        out.pop("cache_salt", None)
    return out


# ---------------------------------------------------------------------------------------------------- admin API

def _entry_json(entry: FleetEntry) -> dict[str, Any]:
    out = entry.spec.to_json()
    view, feed = entry.view, entry.feed
    out["state"] = view.state if view is not None else "down"
    if view is not None:
        out["load"] = {"running": view.load.running, "waiting": view.load.waiting, "inflight": view.inflight}
    if feed is not None:
        out["events"] = {"connected": feed.connected, "batches": feed.batches, "last_seq": feed.last_seq,
                         "resyncs": feed.resyncs, "unknown_media": feed.unknown_media,
                         "unknown_events": feed.unknown_events, "unknown_fields": feed.unknown_fields}
    return out


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


def mount_admin(app: FastAPI, fleet: VllmFleet, allow_admin: bool = True) -> None:
    """The /admin/workers routes (module docstring)."""

    def refused() -> JSONResponse | None:
        return None if allow_admin else _error(403, "admin calls are off on this router (start it without "
                                                    "--no-admin)")

    @app.get("/admin/workers")
    async def list_workers() -> dict[str, Any]:
        return {"workers": [_entry_json(e) for e in fleet.entries()]}

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> JSONResponse:
        if (no := refused()) is not None:
            return no
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            spec = fleet.add(VllmWorkerSpec.from_json(body))
        except ValueError as exc:  # a JSON error is a ValueError too
            return _error(400, str(exc))
        return JSONResponse({"worker": spec.to_json()})

    @app.delete("/admin/workers/{worker_id}")
    async def remove_worker(worker_id: str) -> JSONResponse:
        if (no := refused()) is not None:
            return no
        if not fleet.remove(worker_id):
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"no vLLM worker has id {worker_id!r}", "worker_id")
        return JSONResponse({"removed": worker_id})
