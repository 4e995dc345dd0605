"""Keep-alive events for streams that are quiet for a while.

A long prompt can prefill for seconds to minutes before its first token (an agent's
20k-token prompt on a CPU; or a request waiting in the queue), and clients and proxies
with idle timeouts give up on a silent stream: Claude Code cancelled and re-sent an
11.8k-token request twice while its prefill ran. So a stream that has sent nothing for
`interval` seconds sends what resets the client's idle timer and changes nothing it reads:
- OpenAI chat and completions: an SSE comment (the OpenAI SDKs and opencode skip it);
- Anthropic Messages: `ping`, and before the first token also a `message_delta` that
  carries only usage (Claude Code's watchdog is re-armed only by events other than
  `ping`: its SDK drops pings; the final `message_delta` overwrites this one);
- Responses: `response.in_progress` with the response so far (Codex CLI's idle timer
  counts only events; SSE comments did not keep it from giving up).
The surfaces whose keep-alive is an event of their own read `with_heartbeats` and
send it themselves; the others wrap their chunks in `with_keepalive`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

Item = TypeVar("Item")

OPENAI_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: parsers skip it


class Quiet:
    """What `with_heartbeats` yields when nothing arrived for its interval."""


QUIET = Quiet()


async def with_heartbeats(
    items: AsyncIterator[Item], interval: float
) -> AsyncIterator[Item | Quiet]:
    """`items`, with QUIET yielded whenever the next one takes over `interval` seconds
    (0: never). The pending read is one task awaited again after each heartbeat, so no
    item is lost or reordered; leaving early (the client left) cancels it and closes
    `items`, which cancels the request."""
    iterator = aiter(items)
    pending: asyncio.Task | None = None
    try:
        while True:
            if interval <= 0:
                try:
                    yield await anext(iterator)
                except StopAsyncIteration:
                    return
                continue
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield QUIET
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


async def with_keepalive(
    chunks: AsyncIterator[str], interval: float, keepalive: str = OPENAI_KEEPALIVE
) -> AsyncIterator[str]:
    """`chunks`, with `keepalive` sent whenever the stream is quiet for `interval`."""
    beats = with_heartbeats(chunks, interval)
    try:
        async for chunk in beats:
            yield keepalive if isinstance(chunk, Quiet) else chunk
    finally:
        await beats.aclose()
