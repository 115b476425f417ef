"""Client API keys and tenants on the router's public doors (gRPC `strata.v1.Strata`, HTTP `/v1/...`).

    --api-key KEY            (repeatable)  a key of the tenant "default"
    --api-keys-file PATH     (repeatable)  one `tenant:key` a line; blank lines and `# comments` skipped

With any key configured every public call needs `authorization: Bearer <key>` (gRPC metadata or HTTP header): else
UNAUTHENTICATED / HTTP 401. grpc health, `/health` and `/metrics` stay open. A call's tenant is its identity for the
cache salt (`identity`): every request of a tenant is salted from the tenant's name on the router, a `cache_salt` or
not (`router.validation.effective_salt`, isolated), so no tenant ever hits another's cached prefix. Without keys the
identity is the raw header, as before, and a request without `cache_salt` uses the shared public namespace.
"""
from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from router.openai_responses import error_response
from router.validation import ApiError
from worker_common.grpc_auth import Check, metadata_value

DEFAULT_TENANT = "default"
STRATA_SERVICE = "/strata.v1.Strata/"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})


@dataclass(frozen=True)
class ApiKeys:
    """(tenant, key) pairs; none = auth off. Contract: `tenant_of` compares every key in constant time, so the
    answer's timing tells nothing about how much of a key was right, nor which tenant's key it was closest to."""

    entries: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for tenant, key in self.entries:
            if not _TENANT.match(tenant):
                raise ValueError(f"api key tenant must be 1-64 letters, digits, '.', '_' or '-' (starting with a "
                                 f"letter or digit), got {tenant!r}")
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"api key of tenant {tenant!r} must be non-empty and hold no whitespace")
            if key in seen:
                raise ValueError(f"api key of tenant {tenant!r} is given twice: each key must name one tenant")
            seen.add(key)

    @classmethod
    def load(cls, keys: Sequence[str] = (), files: Sequence[str] = ()) -> "ApiKeys":
        """`--api-key` values (tenant "default") and every `--api-keys-file`; ValueError naming what is wrong."""
        entries = [(DEFAULT_TENANT, key) for key in keys]
        for path in files:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise ValueError(f"api_keys_file {path!r} cannot be read: {exc.strerror}") from None
            entries += parse_keys_file(text, path)
        return cls(tuple(entries))

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(tenant for tenant, _ in self.entries)

    def tenant_of(self, authorization: str) -> str | None:
        """The tenant whose key `authorization` ("Bearer <key>") carries; None for a missing or unknown key."""
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        given_bytes, found = given.strip().encode(), None
        for tenant, key in self.entries:  # NOTE: no early exit: every key is compared, whichever matches
            if hmac.compare_digest(given_bytes, key.encode()):
                found = tenant
        return found

    def identity(self, authorization: str) -> str:
        """Who a call is, for the cache salt: its tenant with keys on (the guard already let the call in), else
        the raw header as before (`token:...`, or `anonymous` without one)."""
        if self.enabled:
            return f"tenant:{self.tenant_of(authorization)}"
        return f"token:{authorization}" if authorization else "anonymous"

    def refusal(self, authorization: str) -> str | None:
        """None when `authorization` carries a known key (or keys are off); else why the call is refused."""
        if not self.enabled or self.tenant_of(authorization) is not None:
            return None
        if not authorization:
            return "this router wants an API key: send `authorization: Bearer <key>`"
        return "the API key is not valid on this router (send `authorization: Bearer <key>` with a configured key)"

    def any_key(self) -> str:
        """A configured key ("" with none): what a launcher's own client shows its router."""
        return self.entries[0][1] if self.entries else ""

    def __repr__(self) -> str:  # NOTE: never print the keys (logs, tracebacks)
        return f"ApiKeys(tenants={sorted(self.tenants)})"


def parse_keys_file(text: str, source: str = "api_keys_file") -> list[tuple[str, str]]:
    """`tenant:key` lines; blank lines and lines starting with `#` are skipped. ValueError naming the line."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        if not sep or not tenant.strip() or not key.strip():
            raise ValueError(f"{source} line {number}: must be `tenant:key`, got {_masked(line)!r}")
        entries.append((tenant.strip(), key.strip()))
    return entries


def _masked(line: str) -> str:
    """A bad line as an error names it: at most its first 4 characters (it may hold a key)."""
    return line[:4] + "..." if len(line) > 4 else line


def api_key_check(keys: ApiKeys) -> Check:
    """The gRPC `Check` of the public service: a known bearer key in the `authorization` metadata."""
    def check(metadata: Sequence[tuple[str, str]]) -> str | None:
        return keys.refusal(metadata_value(metadata, "authorization"))
    return check


class BearerAuth:
    """ASGI middleware: every HTTP path but `/health` and `/metrics` wants a known bearer key (401 with OpenAI's
    error body otherwise). A plain ASGI layer, not `BaseHTTPMiddleware`: streamed answers and a client's disconnect
    pass through untouched."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_HTTP_PATHS or not self.keys.enabled:
            await self.app(scope, receive, send)
            return
        why = self.keys.refusal(header_of(scope, b"authorization"))
        if why is None:
            await self.app(scope, receive, send)
            return
        response = error_response(ApiError(grpc.StatusCode.UNAUTHENTICATED, why))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def header_of(scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""
