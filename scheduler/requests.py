"""Where each request the engine thread holds is: waiting, running or paused.

A request waits for a slot (fair per API key), runs (in the owning engine, or having
its prompt scored), or is paused out of the engine with its KV cache while its client
does not read. Cancel, expiry, a paused stream's timeout and ending everything all go
through one `remove`, so they cannot disagree on where a request was.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from scheduler.admission import FairQueue
from scheduler.tracking import TrackedRequest, key_of


class Place(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"


class RequestTable:
    """The three places. Owned by the engine thread: every field is changed there only;
    other threads read just the counts (`num_running`, `num_waiting`), where a stale
    count is harmless."""

    def __init__(self) -> None:
        self.waiting: FairQueue[TrackedRequest] = FairQueue(key_of)
        self.running: dict[str, TrackedRequest] = {}
        self.paused: dict[str, TrackedRequest] = {}  # out of the engine until read

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.paused)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def __iter__(self) -> Iterator[TrackedRequest]:
        """Every request held, running first."""
        return iter([*self.running.values(), *self.waiting, *self.paused.values()])

    def place_of(self, request_id: str) -> Place | None:
        if request_id in self.running:
            return Place.RUNNING
        if request_id in self.paused:
            return Place.PAUSED
        if any(t.request.request_id == request_id for t in self.waiting):
            return Place.WAITING
        return None

    def remove(self, request_id: str) -> tuple[TrackedRequest, Place] | None:
        """Take a request out of wherever it is (None if it is held nowhere: finished).
        A paused one drops its parked cache; the caller cancels a running one in the
        engine that holds it."""
        tracked = self.running.pop(request_id, None)
        if tracked is not None:
            return tracked, Place.RUNNING
        tracked = self.paused.pop(request_id, None)
        if tracked is not None:
            tracked.parked, tracked.paused_at = None, None
            return tracked, Place.PAUSED
        tracked = next((t for t in self.waiting if t.request.request_id == request_id), None)
        if tracked is None:
            return None
        self.waiting.remove(tracked)
        return tracked, Place.WAITING

    def pause(self, tracked: TrackedRequest, now: float) -> None:
        """A running request (its sequence already out of the engine, in `parked`)."""
        del self.running[tracked.request.request_id]
        tracked.paused_at = now
        self.paused[tracked.request.request_id] = tracked

    def requeue(self, tracked: TrackedRequest) -> None:
        """A paused or preempted request waits at the head of the queue to go back in."""
        self.paused.pop(tracked.request.request_id, None)
        self.running.pop(tracked.request.request_id, None)
        self.waiting.appendleft(tracked)

    def take_all(self) -> tuple[list[TrackedRequest], list[TrackedRequest]]:
        """Empty the table: (the running requests, every other one)."""
        running, others = list(self.running.values()), [*self.waiting, *self.paused.values()]
        self.waiting, self.running, self.paused = FairQueue(key_of), {}, {}
        return running, others
