"""Request limits as small ASGI middlewares: body size (413) and per-caller rate (429).

Both answer in OpenAI's error shape before the app parses anything, so a hostile
client cannot make the server buffer a huge body or flood the queue.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.auth import caller_key_id
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
    """Token bucket per caller: the API key it was accepted with (the key middleware
    runs first), or its client address when the server has no keys; a header nobody
    checked names no one. `per_minute` requests a minute on average, bursts up to
    the same number.

    Buckets are kept in least-recently-used order. One untouched for a minute is
    full again, the same as a new one, so it is dropped; beyond `max_buckets`
    callers the least recently seen are forgotten (they get a fresh burst)."""

    EXEMPT = frozenset({"/health", "/metrics"})
    REFILL_S = 60.0  # an idle bucket is full again after this long

    def __init__(
        self,
        app: ASGIApp,
        per_minute: float,
        on_refused: Callable[[], None],
        max_buckets: int = 4096,
    ) -> None:
        self.app = app
        self.per_minute = per_minute
        self.on_refused = on_refused
        self.max_buckets = max_buckets
        self.buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def allow(self, who: str, now: float) -> float:
        """0 if allowed (and charged), else seconds until a request would be."""
        self._forget_idle(now)
        bucket = self.buckets.pop(who, None) or _Bucket(self.per_minute, now)
        self.buckets[who] = bucket  # most recently seen last
        if len(self.buckets) > self.max_buckets:
            self.buckets.popitem(last=False)
        rate = self.per_minute / 60.0
        bucket.tokens = min(self.per_minute, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / rate

    def _forget_idle(self, now: float) -> None:
        while self.buckets:
            who, oldest = next(iter(self.buckets.items()))
            if now - oldest.updated < self.REFILL_S:
                return
            del self.buckets[who]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        key = caller_key_id(scope)
        who = f"key:{key}" if key else f"addr:{client[0]}"
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
