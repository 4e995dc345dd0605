"""The asyncio side of a request: events from the engine thread, and cancellation.

The engine thread never touches asyncio objects directly: it hands each event to
the request's event loop with `call_soon_threadsafe`. Leaving an `async for` early
(client disconnect, timeout, error) cancels the request at the next engine step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.errors import RequestAborted, RequestFailed, RequestTimeout
from engines.sequence import FinishReason

_ERRORS = {"failed": RequestFailed, "aborted": RequestAborted, "timeout": RequestTimeout}


@dataclass
class TokenEvent:
    """Tokens committed for one request in one engine step, with their text."""

    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: FinishReason | None = None
    matched_stop: str | None = None
    error: str | None = None
    error_kind: str | None = None  # failed | aborted | timeout
    logprobs: list | None = None  # engines.sample.logprobs.TokenLogprob per token, when asked
    prompt_logprobs: list | None = None  # prompt[1:] scored, on the request's first event
    speculation: dict | None = None  # per-request drafted/accepted stats, on the final event
    # (source, text) per token: a drafter's name (pld, draft, mtp) or "target" (see
    # engines.token_sources); surfaces show it only when a request asks
    token_sources: list[tuple[str, str]] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """Async iterator of a request's `TokenEvent`s; raises `RequestFailed` when serving
    the request raised, `RequestAborted` when the server ended it (shutdown, timeout)."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._cancel = cancel
        self._done = False
        # Events taken by the reader; the engine thread compares it with the events it
        # delivered to see a client that stopped reading (a stale read only delays that).
        self.consumed = 0

    @property
    def done(self) -> bool:
        return self._done

    @property
    def buffered(self) -> int:
        """Events delivered and not yet read."""
        return self._queue.qsize()

    def put(self, event: TokenEvent) -> None:
        """Called on the event loop thread (via call_soon_threadsafe)."""
        self._queue.put_nowait(event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self.consumed += 1
        if event.final:
            self._done = True
        if event.error is not None or event.finish_reason == FinishReason.ERROR:
            raise _ERRORS.get(event.error_kind, RequestFailed)(event.error or "request failed")
        return event

    def cancel(self) -> None:
        """Stop generating for this request; harmless after it finished."""
        if not self._done:
            self._done = True
            self._cancel(self.request_id)

    async def collect(self) -> list[TokenEvent]:
        """All events until the final one (non-streaming responses)."""
        try:
            return [event async for event in self]
        finally:
            self.cancel()
