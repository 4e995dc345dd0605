"""Request limits as small ASGI middlewares: body size (413), body read time (408) and
per-caller rate (429).

All answer in OpenAI's error shape before the app parses anything, so a hostile
client cannot make the server buffer a huge body or flood the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.auth import caller_key_id
from server.buckets import TokenBuckets
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


class RateLimit:
    """Token bucket per caller: the API key it was accepted with (the key middleware
    runs first), or its client address when the server has no keys; a header nobody
    checked names no one. `per_minute` requests a minute on average, bursts up to
    the same number; memory stays bounded (see `TokenBuckets`)."""

    EXEMPT = frozenset({"/health", "/metrics"})

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
        self.buckets = TokenBuckets(per_minute, max_buckets=max_buckets)

    def allow(self, who: str, now: float) -> float:
        """0 if allowed (and charged), else seconds until a request would be."""
        return self.buckets.take(who, now)

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


class BodyReadTimeout:
    """Refuse a body that has not fully arrived `timeout` seconds after the app asked
    for it: 408, and the connection closes. Without it a client that sends a head and
    then trickles (or never finishes) its body holds a request task for ever. Reads
    after the body is complete (waiting for a disconnect) are not bounded."""

    def __init__(self, app: ASGIApp, timeout: float, on_refused: Callable[[], None]) -> None:
        self.app = app
        self.timeout = timeout
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        complete = False

        async def timed_receive() -> Message:
            nonlocal deadline, complete
            if complete:
                return await receive()
            deadline = deadline or time.monotonic() + self.timeout
            with anyio.move_on_after(deadline - time.monotonic()):
                message = await receive()
                complete = message["type"] != "http.request" or not message.get("more_body")
                return message
            self.on_refused()
            raise ApiError(
                408,
                f"request body not received within {self.timeout:g} s",
                "invalid_request_error",
                code="request_timeout",
                headers={"Connection": "close"},
            )

        await self.app(scope, timed_receive, send)
