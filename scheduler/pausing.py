"""Taking running requests out of the engine and back, KV cache kept (a mixin of
`Scheduler`, run on the engine thread).

Backpressure: a stream whose client stopped reading is paused (its sequence leaves the
engine with its KV cache, freeing the slot), resumes ahead of the queue once read,
and is cancelled once paused past `unread_timeout`. Only models whose caches roll back
pause: a row must leave the batch holding exactly its committed tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engines.sequence import FinishReason
from scheduler.tracking import TrackedRequest

if TYPE_CHECKING:
    from scheduler.admission import Backpressure
    from scheduler.engine_pair import EnginePair
    from scheduler.requests import RequestTable


class Pausing:
    """Backpressure's pauses and resumes. It keeps no state of its own: it moves
    requests between the scheduler's table's places (`RequestTable`), which the engine
    thread owns, and the policy (`Backpressure`) is immutable."""

    _backpressure: Backpressure
    requests: RequestTable
    engines: EnginePair

    def _apply_backpressure(self) -> None:
        """Pause running streams whose clients stopped reading (the sequence leaves the
        engine with its KV cache, freeing the slot), resume them once read, and cancel
        those paused past `unread_timeout`. Only models whose caches roll back pause."""
        policy = self._backpressure
        if not policy.enabled or not self.rows_roll_back or self.engines.spec is None:
            return
        now = time.monotonic()
        engine = self._engine()
        running = self.requests.running
        in_engine = set(engine.active_ids) if engine is not None else set()
        unread = [(rid, t.unread) for rid, t in running.items() if rid in in_engine]
        for request_id in policy.to_pause(unread):
            self._pause(running.get(request_id), engine, now)
        for request_id, tracked in list(self.requests.paused.items()):
            if policy.can_resume(tracked.unread):
                self.requests.requeue(tracked)
            elif policy.expired(tracked.paused_at, now):
                self._remove(request_id)
                self._finish(
                    tracked,
                    FinishReason.CANCELLED,
                    error=f"the client stopped reading this stream for {policy.timeout:g}s",
                    error_kind="aborted",
                )

    def _pause(self, tracked: TrackedRequest | None, engine, now: float) -> None:
        if tracked is None:
            return  # finished: an earlier pause's settle committed its last token
        request_id = tracked.request.request_id
        state, result = engine.hand_over(request_id)  # a step in flight commits first
        self._absorb(result)
        if request_id not in self.requests.running:
            return  # its last token, committed on the way out, finished it
        tracked.parked = state
        self.requests.pause(tracked, now)
