"""The thread boundary: commands into the engine thread, events out to event loops.

Other threads never touch the engine thread's tables: they `send` a `Command`
(submit, cancel, abort_all, kv_budget, rank_lost), which the engine thread takes in
`wait` between steps. The engine thread `deliver`s each event to an outbox and
`flush`es a step's events to each event loop in one `call_soon_threadsafe`, so a
batch of B streams wakes the loop once per step, not B times.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from engines.sequence import FinishReason
from scheduler.admission import KeyCounts
from scheduler.stream import TokenEvent
from scheduler.tracking import Command, TrackedRequest

Events = list[tuple[TrackedRequest, TokenEvent]]


class Mailbox:
    """Both directions of the thread boundary.

    Thread ownership: `_inbox`, `stopping` and `_loops` are shared, read and changed
    only under `_wakeup`; `_outbox` belongs to the engine thread; `outstanding`,
    `per_key` and `_live` belong to the event loop (changed in `track` and in the
    callbacks `flush` and `end_streams` schedule on it)."""

    def __init__(self, per_key_limit: int) -> None:
        self._inbox: deque[Command] = deque()
        self._wakeup = threading.Condition()
        self.stopping = False
        self._loops: set[asyncio.AbstractEventLoop] = set()
        self._outbox: Events = []
        self.outstanding = 0  # submitted and not yet finished
        self.per_key = KeyCounts(per_key_limit)
        self._live: dict[int, TrackedRequest] = {}  # id(tracked) -> not yet finished

    # ---- into the engine thread (any thread) -------------------------------------

    def send(self, command: Command) -> None:
        with self._wakeup:
            self._inbox.append(command)
            self._wakeup.notify()

    def stop(self) -> None:
        """Tell the engine thread to leave its loop at its next wait."""
        with self._wakeup:
            self.stopping = True
            self._wakeup.notify()

    def wait(self, busy: bool, poll: bool, poll_s: float = 0.05) -> list[Command] | None:
        """The engine thread's wait for commands: none while it has work (`busy`), at
        most `poll_s` while it must look again soon (`poll`: paused requests), else
        until a command comes. None once stopping."""
        with self._wakeup:
            while not self._inbox and not busy and not self.stopping:
                if poll:
                    self._wakeup.wait(poll_s)
                    break
                self._wakeup.wait()
            if self.stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def take_submitted(self) -> list[TrackedRequest]:
        """Requests submitted but never taken in (the engine thread is leaving)."""
        with self._wakeup:
            submitted = [c.tracked for c in self._inbox if c.kind == "submit"]
            self._inbox = deque(c for c in self._inbox if c.kind != "submit")
            return submitted

    # ---- the event loop's side ------------------------------------------------------

    def track(self, tracked: TrackedRequest) -> None:
        """A request is submitted (on its event loop)."""
        self.outstanding += 1
        self.per_key.add(tracked.request.cache_scope)
        self._live[id(tracked)] = tracked
        with self._wakeup:
            self._loops.add(tracked.loop)

    def _put_all(self, events: Events) -> None:
        for tracked, event in events:
            if id(tracked) not in self._live:
                continue  # ended already (`end_streams`)
            if event.final:
                self._ended(tracked)
            tracked.stream.put(event)

    def _ended(self, tracked: TrackedRequest) -> None:
        del self._live[id(tracked)]
        self.outstanding -= 1
        self.per_key.remove(tracked.request.cache_scope)

    def end_streams(self, reason: str) -> None:
        """End every stream not yet ended with an error event, from any thread, touching
        nothing of the engine thread's: the last resort when that thread is stuck (a
        collective on a broken ring across ranks never returns)."""
        with self._wakeup:
            loops = list(self._loops)
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._end_live, loop, reason)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _end_live(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        for tracked in [t for t in self._live.values() if t.loop is loop]:
            self._ended(tracked)
            tracked.stream.put(
                TokenEvent(
                    request_id=tracked.request.request_id,
                    token_ids=[],
                    text="",
                    prompt_tokens=len(tracked.request.prompt_tokens),
                    completion_tokens=tracked.completion_tokens,
                    finish_reason=FinishReason.CANCELLED,
                    error=reason,
                    error_kind="aborted",
                )
            )

    # ---- out of the engine thread ---------------------------------------------------

    def deliver(self, tracked: TrackedRequest, event: TokenEvent) -> None:
        """Queue an event for `flush` (engine thread)."""
        tracked.delivered += 1
        self._outbox.append((tracked, event))

    def flush(self) -> None:
        """Hand the queued events to their event loops, one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, Events] = {}
        for tracked, event in self._outbox:
            by_loop.setdefault(tracked.loop, []).append((tracked, event))
        self._outbox = []
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._put_all, events)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass
