"""Who may call whom inside a fleet: the shared secret (`cluster_secret`) on gRPC metadata, and the server-side guard
that checks it (or, on the router's public service, an API key: `router.auth`).

    worker / router ──attach_secret(channel)── x-strata-secret ──> CallGuard (server interceptor) ──> servicer
                                                                   └─ refused: UNAUTHENTICATED, servicer never runs

The secret comes from `--cluster-secret-file PATH` or, failing that, `$STRATA_CLUSTER_SECRET` (what `strata serve`
hands its children: never on a command line, which `ps` shows). Empty = no secret: every call is let through.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence

import grpc

SECRET_METADATA = "x-strata-secret"
SECRET_ENV = "STRATA_CLUSTER_SECRET"
WORKER_SERVICE = "/strata.v1.Worker/"
REGISTRY_SERVICE = "/strata.v1.Registry/"
WORKER_OPEN_METHODS = frozenset({"/strata.v1.Worker/Health"})

# (metadata as pairs) -> None when the call may go on, else why it may not (the UNAUTHENTICATED details)
Check = Callable[[Sequence[tuple[str, str]]], "str | None"]


def read_cluster_secret(path: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The fleet secret: the first line of `path` (stripped), else `$STRATA_CLUSTER_SECRET`, else "" (none)."""
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cluster_secret_file {path!r} cannot be read: {exc.strerror}") from None
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ValueError(f"cluster_secret_file {path!r} must hold the secret on its first line; it is empty")
        return secret
    return environ.get(SECRET_ENV, "").strip()


def metadata_value(metadata: Sequence[tuple[str, str]] | None, key: str) -> str:
    """The first value of `key` in a call's metadata ("" when absent)."""
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


def secret_check(secret: str) -> Check:
    """A `Check` that wants `x-strata-secret: <secret>`, compared in constant time."""
    expected = secret.encode()

    def check(metadata: Sequence[tuple[str, str]]) -> str | None:
        given = metadata_value(metadata, SECRET_METADATA)
        if given and hmac.compare_digest(given.encode(), expected):
            return None
        why = "a wrong" if given else "no"
        return (f"this call carries {why} fleet secret ({SECRET_METADATA} metadata): start the process with "
                f"--cluster-secret-file or ${SECRET_ENV} holding the fleet's secret")
    return check


# ------------------------------------------------------------------------------------------------ server side

class CallGuard(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call whose method one of `rules` (method prefix, check) covers and whose metadata
    that check turns down; the first rule whose prefix matches decides. Methods no rule covers (grpc health,
    reflection, `open_methods`) are let through."""

    def __init__(self, rules: Sequence[tuple[str, Check]], open_methods: frozenset[str] = frozenset()) -> None:
        self.rules, self.open_methods = tuple(rules), open_methods

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        check = next((c for prefix, c in self.rules if method.startswith(prefix)), None)
        why = None if check is None or method in self.open_methods else check(handler_call_details.invocation_metadata)
        handler = continuation(handler_call_details)
        if why is None or handler is None:
            return handler
        return _refusal(handler, why)


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED without running it."""
    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def worker_guard(secret: str) -> list[grpc.ServerInterceptor]:
    """A worker server's interceptors: every Worker RPC but Health wants the secret (none without one)."""
    if not secret:
        return []
    return [CallGuard([(WORKER_SERVICE, secret_check(secret))], WORKER_OPEN_METHODS)]


# ------------------------------------------------------------------------------------------------ client side

class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    """What a call is sent with, its metadata extended (grpc wants a `ClientCallDetails`)."""


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs = tuple(pairs)

    def _details(self, d) -> _ClientCallDetails:
        return _ClientCallDetails(d.method, d.timeout, (*(d.metadata or ()), *self.pairs), d.credentials,
                                  d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def attach_metadata(channel: grpc.Channel, pairs: Sequence[tuple[str, str]]) -> grpc.Channel:
    """`channel`, every call on it carrying `pairs` as metadata (the channel itself when there are none)."""
    pairs = [(k, v) for k, v in pairs if v]
    return grpc.intercept_channel(channel, _AddMetadata(pairs)) if pairs else channel


def attach_secret(channel: grpc.Channel, secret: str) -> grpc.Channel:
    """`channel`, every call on it carrying the fleet secret (unchanged when there is none)."""
    return attach_metadata(channel, [(SECRET_METADATA, secret)])
