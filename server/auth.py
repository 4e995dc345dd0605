"""API-key check as a small ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware).

Keys arrive as `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic)
and are compared in constant time. `/health` stays open for supervisors. A client
address that keeps presenting wrong keys is refused with 429 for a while (whatever it
presents then), so keys cannot be guessed at network speed. Scopes other than HTTP
(WebSocket) are refused when keys are set: a future route is not open by default.

An accepted key leaves its id (`key_id`: a keyed hash, never the key) in the request
scope; what must not cross between users (prefix-cache reuse, rate-limit buckets)
is keyed by it. The hash's salt is the middleware's: with a prefix cache on disk, the
one kept in its folder, so a key's entries there serve it after a restart (made anew
when the keys change: scheduler/prefix_folder.py); else one made per process.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler.prefix_folder import scope_id
from server.buckets import TokenBuckets
from server.errors import ApiError, error_response_for

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/"})  # "/": the web page, which asks for a key
OPEN_PREFIX = "/ui/static/"  # the page's script and style: no data in them
PROCESS_SALT = secrets.token_bytes(32)  # ids no restart can match (no prefix cache on disk)
_KEY_ID = "tandem.key_id"  # where the accepted key's id lives in scope["state"]


SHORT_KEY = 16  # below this a key is guessable enough to warn about


def key_problem(key: str) -> str | None:
    """Why `key` cannot be used, or None. Headers carry ASCII only, so a key with other
    characters could never match; a one-character key is no protection."""
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        return "must be printable ASCII without spaces"
    if len(key) < 2:
        return "is one character long"
    return None


def check_keys(keys: tuple[str, ...], source: str = "API key") -> None:
    """Refuse unusable keys (SystemExit with the reason), warn about short ones.
    Keys are named by position, never printed."""
    for number, key in enumerate(keys, 1):
        problem = key_problem(key)
        if problem:
            raise SystemExit(f"tandem serve: {source} #{number} {problem}")
        if len(key) < SHORT_KEY:
            log.warning(
                "%s #%d is %d characters long; use at least %d (openssl rand -hex 32)",
                source,
                number,
                len(key),
                SHORT_KEY,
            )


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


def key_id(key: str, salt: bytes = PROCESS_SALT) -> str:
    """A name for an API key that stands for it, not reversible to it (an HMAC under
    `salt`: the same id for the same key only under the same salt)."""
    return scope_id(key, salt)


def caller_key_id(scope: Scope) -> str | None:
    """The id of the key this request was accepted with; None when no keys are set."""
    return scope.get("state", {}).get(_KEY_ID)


class ApiKeyMiddleware:
    """`/metrics` accepts the metrics keys when given (so a Prometheus scraper needs
    no API key), otherwise the API keys like every other route."""

    FAILURES_BURST = 10  # wrong keys an address may present at once ...
    FAILURES_PER_MINUTE = 10  # ... and then this many a minute

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        metrics_keys: tuple[str, ...] = (),
        on_denied: Callable[[], None] | None = None,
        salt: bytes = PROCESS_SALT,
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics_keys = metrics_keys
        self.salt = salt  # of the ids of accepted keys (`key_id`)
        self.on_denied = on_denied or (lambda: None)
        self.failures = TokenBuckets(self.FAILURES_PER_MINUTE, burst=self.FAILURES_BURST)

    def keys_for(self, path: str) -> tuple[str, ...]:
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
            return ()
        if path == "/metrics" and self.metrics_keys:
            return self.metrics_keys + self.keys
        return self.keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or not self.keys:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no other kind is served: refuse, do not pass it on
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        keys = self.keys_for(scope["path"])
        if not keys:
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("?", 0))[0]
        now = time.monotonic()
        wait = self.failures.wait(address, now)
        if wait:
            await error_response_for(scope["path"], too_many_failures(wait))(scope, receive, send)
            return
        presented = presented_key(dict(scope["headers"]))
        if key_is_valid(presented, keys):
            scope.setdefault("state", {})[_KEY_ID] = key_id(presented, self.salt)
            await self.app(scope, receive, send)
            return
        self.failures.take(address, now)
        self.on_denied()
        await error_response_for(scope["path"], invalid_key())(scope, receive, send)


def invalid_key() -> ApiError:
    return ApiError(
        401,
        "missing or invalid API key",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def too_many_failures(wait: float) -> ApiError:
    return ApiError(
        429,
        "too many invalid API keys from this address; try again later",
        "rate_limit_error",
        code="too_many_invalid_keys",
        headers={"Retry-After": str(max(1, round(wait)))},
    )
