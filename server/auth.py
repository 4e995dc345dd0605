"""API-key check as a small ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware).

Keys arrive as `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic)
and are compared in constant time. `/health` stays open for supervisors.

An accepted key leaves its id (`key_id`: a keyed hash, never the key) in the request
scope; what must not cross between users (prefix-cache reuse, rate-limit buckets)
is keyed by it.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError, error_response_for

OPEN_PATHS = frozenset({"/health"})
_ID_SALT = secrets.token_bytes(16)  # per process: ids cannot be matched across restarts
_KEY_ID = "tandem.key_id"  # where the accepted key's id lives in scope["state"]


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key else None


def key_is_valid(presented: str | None, keys: tuple[str, ...]) -> bool:
    if presented is None:
        return False
    given = presented.encode()
    # Compare against every key so timing does not reveal which one matched.
    return any([hmac.compare_digest(given, key.encode()) for key in keys])


def key_id(key: str) -> str:
    """A name for an API key that stands for it in memory, not reversible to it."""
    return hmac.new(_ID_SALT, key.encode(), "sha256").hexdigest()[:24]


def caller_key_id(scope: Scope) -> str | None:
    """The id of the key this request was accepted with; None when no keys are set."""
    return scope.get("state", {}).get(_KEY_ID)


class ApiKeyMiddleware:
    """`/metrics` accepts the metrics keys when given (so a Prometheus scraper needs
    no API key), otherwise the API keys like every other route."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        metrics_keys: tuple[str, ...] = (),
        on_denied: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics_keys = metrics_keys
        self.on_denied = on_denied or (lambda: None)

    def keys_for(self, path: str) -> tuple[str, ...]:
        if path in OPEN_PATHS:
            return ()
        if path == "/metrics" and self.metrics_keys:
            return self.metrics_keys + self.keys
        return self.keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys_for(scope["path"]) if scope["type"] == "http" else ()
        if not keys:
            await self.app(scope, receive, send)
            return
        presented = presented_key(dict(scope["headers"]))
        if key_is_valid(presented, keys):
            scope.setdefault("state", {})[_KEY_ID] = key_id(presented)
            await self.app(scope, receive, send)
            return
        self.on_denied()
        error = ApiError(
            401,
            "missing or invalid API key",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response_for(scope["path"], error)(scope, receive, send)
