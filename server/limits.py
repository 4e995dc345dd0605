"""Request limits as small ASGI middlewares: body size (413) and per-key rate (429).

Both answer in OpenAI's error shape before the app parses anything, so a hostile
client cannot make the server buffer a huge body or flood the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.auth import presented_key
from server.errors import ApiError, error_response_for


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuse bodies over `max_bytes`: by Content-Length up front, or while streaming."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        response_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refused()
        error = ApiError(
            413,
            f"request body larger than {self.max_bytes} bytes",
            "invalid_request_error",
            code="request_too_large",
        )
        await error_response_for(scope["path"], error)(scope, receive, send)


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimit:
    """Token bucket per API key (or per client address when no key is presented):
    `per_minute` requests a minute on average, bursts up to the same number."""

    EXEMPT = frozenset({"/health", "/metrics"})

    def __init__(self, app: ASGIApp, per_minute: float, on_refused: Callable[[], None]) -> None:
        self.app = app
        self.per_minute = per_minute
        self.on_refused = on_refused
        self.buckets: dict[str, _Bucket] = {}

    def allow(self, who: str, now: float) -> float:
        """0 if allowed (and charged), else seconds until a request would be."""
        bucket = self.buckets.setdefault(who, _Bucket(self.per_minute, now))
        rate = self.per_minute / 60.0
        bucket.tokens = min(self.per_minute, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        who = presented_key(dict(scope["headers"])) or f"addr:{client[0]}"
        wait = self.allow(who, time.monotonic())
        if not wait:
            await self.app(scope, receive, send)
            return
        self.on_refused()
        error = ApiError(
            429,
            f"rate limit of {self.per_minute:g} requests per minute exceeded",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, round(wait)))},
        )
        await error_response_for(scope["path"], error)(scope, receive, send)
