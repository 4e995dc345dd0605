"""Keep-alive events for streams that are quiet for a while.

A long prompt can prefill for seconds to minutes before its first token (an agent's
20k-token prompt on a CPU; or a request waiting in the queue), and clients and proxies
with idle timeouts give up on a silent stream: Claude Code cancelled and re-sent an
11.8k-token request twice while its prefill ran. So a stream that has sent nothing for
`interval` seconds sends a keep-alive its client ignores: Anthropic's `ping` event, an
SSE comment on the OpenAI surfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

OPENAI_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: parsers skip it
ANTHROPIC_KEEPALIVE = 'event: ping\ndata: {"type":"ping"}\n\n'


async def with_keepalive(
    chunks: AsyncIterator[str], interval: float, keepalive: str
) -> AsyncIterator[str]:
    """`chunks`, with `keepalive` sent whenever the next one takes over `interval`
    seconds (0: never). The pending read is one task awaited again after each
    keep-alive, so no chunk is lost or reordered; leaving early (the client left)
    cancels it and closes `chunks`, which cancels the request."""
    if interval <= 0:
        async for chunk in chunks:
            yield chunk
        return
    iterator = aiter(chunks)
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield keepalive
                continue
            task, pending = pending, None
            try:
                chunk = task.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
