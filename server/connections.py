"""Connection limits below the ASGI app: how long a client may take to send a request,
and how many connections the process holds.

uvicorn arms no timer until its first response, so a socket that sends nothing, or half
a request head, stays open for ever; mlx-lm raises the open-file limit to 2048 at
import, so ~2,000 such sockets take the server off the air before any key is checked.
`guarded_protocol` returns uvicorn's h11 protocol with three bounds:

- a request head must arrive within `header_timeout` of the connection opening or of
  the previous response finishing;
- a request body must arrive within `body_timeout` of its head (the app answers 408
  first when it is reading; this is the backstop for bodies nobody reads);
- at `max_connections`, a new connection evicts the longest-idle one (no request under
  way); when every connection is busy the new one is closed at once.

Idle keep-alive connections are bounded by uvicorn's own `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

FILES_KEPT_FOR_THE_PROCESS = 128  # model files, logs, pipes: what sockets must leave free


# asyncio accepts up to this many connections in one go, each holding a descriptor
# before a full server can close it: uvicorn's default (2048) alone would fill the limit.
ACCEPT_BACKLOG = 256


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: int = 5
    max_connections: int = 1024
    backlog: int = ACCEPT_BACKLOG


def fitting_open_file_limit(wanted: int) -> int:
    """`wanted`, lowered so sockets (held, and being accepted) cannot use up the
    process's file descriptors."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(16, soft - FILES_KEPT_FOR_THE_PROCESS - ACCEPT_BACKLOG)
    if wanted > room:
        log.warning("--max-connections %d lowered to %d (open-file limit %d)", wanted, room, soft)
    return min(wanted, room)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines above; `limits` is set by
    `guarded_protocol` on a subclass."""

    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: object = None  # the h11 state the deadline is for
        self.idle_since = time.monotonic()
        if len(self.connections) >= self.limits.max_connections and not self._evict_idle():
            transport.close()
            return
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = time.monotonic()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.transport is not None:  # refused connections never joined
            super().connection_lost(exc)

    def is_idle(self) -> bool:
        """No request under way: waiting for (or partway through) a request head."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return self.conn.their_state is h11.IDLE and not busy

    def _watch(self) -> None:
        """Keep one deadline armed for the part of a request the client still owes."""
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()
            return
        if state is h11.IDLE and not self.is_idle():
            self._disarm()  # a response is being written; the head timer restarts after it
            return
        if self._deadline is not None and self._waiting_for is state:
            return
        self._disarm()
        timeout = self.limits.header_timeout if state is h11.IDLE else self.limits.body_timeout + 1
        self._waiting_for = state
        self._deadline = self.loop.call_later(timeout, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
        self._deadline = None
        self._waiting_for = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def _evict_idle(self) -> bool:
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.is_idle()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        oldest.transport.close()
        self.connections.discard(oldest)  # its slot is free now, not when the loop gets to it
        return True


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn should build connections with (`http=` in its config)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
