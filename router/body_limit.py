"""The HTTP door's request-size limit (`--max-request-bytes`): a body over it is answered 413 with OpenAI's error
body naming the limit, before anything parses it. The gRPC door has the same bound as its
`grpc.max_receive_message_length` (`router.service.make_grpc_server`: RESOURCE_EXHAUSTED past it).

    client ──body──> BodyLimit: Content-Length over the limit?  ──yes──> 413
                               read chunks, counting; over?    ──yes──> 413
                               replay the body ──> the app (JSON parsing, validation)
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# NOTE: uvicorn closes a connection whose response went out before its request body was read, and a client still
# sending then sees a reset, not the 413: an oversized body is read and dropped first, up to this much.
DRAIN_BYTES = 64 << 20


class BodyLimit:
    """ASGI middleware: at most `max_bytes` of request body per HTTP request (0 = no limit). A body within it is
    buffered and handed on whole (the routes read it whole anyway); later receives (disconnects) pass through."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_request_bytes must be >= 0 (0 = no limit), got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, 0)
            return await self._refuse(send, declared)
        chunks, size, last = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                last = message      # the client left: the app sees it as it would have
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body"):
                    await _drain(receive, size)
                return await self._refuse(send, None)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return await self.app(scope, _replay(b"".join(chunks), last, receive), send)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "longer"
        body = json.dumps({"error": {
            "message": f"the request body is {size}; this router takes at most {self.max_bytes} bytes per request "
                       f"(--max-request-bytes)", "type": "invalid_request_error", "param": "body",
            "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _drain(receive: Receive, already: int) -> None:
    """Read and drop the rest of a refused body (up to DRAIN_BYTES), so the client gets to read the answer."""
    while already < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        already += len(message.get("body", b""))
        if not message.get("more_body"):
            return


def _replay(body: bytes, last: Message | None, receive: Receive) -> Receive:
    """A receive that gives the buffered body as one message, then what the client sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}] + ([last] if last else [])

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()
    return replay
