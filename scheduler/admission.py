"""Fairness between API keys: who waits, who goes next, and who is paused.

The key is a request's `cache_scope` (the id of the API key it came with; "" on a
keyless server, where everyone is one caller and the queue is plain FIFO).

- `KeyCounts` (event loop side) caps the running + queued requests of one key, so one
  key cannot take every queue place and turn another key away with a 503.
- `FairQueue` (engine thread) hands the next free slot round-robin between keys: the
  key served longest ago goes first, each key's own requests in arrival order.
- `Backpressure` (engine thread) decides which streams to pause because their client
  has stopped reading, which to resume, and which have been paused too long.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class KeyCounts:
    """Requests in flight per key; touched on the event loop only."""

    limit: int
    counts: dict[str, int] = field(default_factory=dict)

    def full(self, key: str) -> bool:
        return bool(key) and self.counts.get(key, 0) >= self.limit

    def add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def remove(self, key: str) -> None:
        left = self.counts.get(key, 0) - 1
        if left > 0:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)


@dataclass
class FairQueue(Generic[T]):
    """Waiting requests in arrival order; `popleft` takes the oldest request of the key
    served longest ago (never-served keys first), so a key with many queued requests
    cannot keep another key's first request behind all of its own."""

    key_of: Callable[[T], str]
    _resuming: deque[T] = field(default_factory=deque)  # paused requests going back
    _items: deque[T] = field(default_factory=deque)
    _served: dict[str, int] = field(default_factory=dict)  # key -> turn it was last served
    _turn: int = 0

    def append(self, item: T) -> None:
        self._items.append(item)

    def appendleft(self, item: T) -> None:
        """Ahead of everyone (a paused request resuming: it had a slot already)."""
        self._resuming.append(item)

    def peek(self) -> T:
        """The item `popleft` would take."""
        if self._resuming:
            return self._resuming[0]
        # min() keeps the first of equals: ties go to the oldest request.
        return min(self._items, key=lambda item: self._served.get(self.key_of(item), -1))

    def popleft(self) -> T:
        if self._resuming:
            return self._resuming.popleft()
        return self.take(self.peek())

    def first(self, ready: Callable[[T], bool]) -> T | None:
        """The item `popleft` would take among those `ready` (None: none is)."""
        if self._resuming:
            return self._resuming[0]
        in_turn = sorted(self._items, key=lambda item: self._served.get(self.key_of(item), -1))
        return next((item for item in in_turn if ready(item)), None)  # asks no further

    def take(self, item: T) -> T:
        """`item` out of the queue, its key counted as served (as `popleft`)."""
        if item in self._resuming:
            self._resuming.remove(item)
            return item
        self._items.remove(item)
        self._turn += 1
        self._served[self.key_of(item)] = self._turn
        return item

    def remove(self, item: T) -> None:
        (self._resuming if item in self._resuming else self._items).remove(item)

    def __len__(self) -> int:
        return len(self._resuming) + len(self._items)

    def __bool__(self) -> bool:
        return bool(self._resuming or self._items)

    def __iter__(self) -> Iterator[T]:
        return iter([*self._resuming, *self._items])


@dataclass(frozen=True)
class Backpressure:
    """Pause a stream with more than `max_unread` events its client has not read;
    resume it once the client has read half of them; give up after `timeout` s."""

    max_unread: int
    timeout: float

    @property
    def enabled(self) -> bool:
        return self.max_unread > 0

    def to_pause(self, unread: Iterable[tuple[str, int]]) -> list[str]:
        return [rid for rid, count in unread if self.enabled and count > self.max_unread]

    def can_resume(self, unread: int) -> bool:
        return unread <= self.max_unread // 2

    def expired(self, paused_at: float, now: float) -> bool:
        return now - paused_at > self.timeout
