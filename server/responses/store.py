"""Recent Responses API responses, for `previous_response_id` and GET/DELETE.

Each entry is kept as compact JSON bytes (what GET returns, and the conversation a
follow-up renders), so the store can count exactly what it holds and bound it by bytes
as well as by entries. Entries belong to the API key that made them (its `key_id`; one
shared scope when the server has no keys): another key cannot see, continue or delete
them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_STORE_SIZE = 256
DEFAULT_STORE_BYTES = 32 << 20


def compact_json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8"
    )


@dataclass(frozen=True)
class StoredResponse:
    conversation: bytes  # JSON: every turn so far, the model's output included; no instructions
    body: bytes  # JSON: the response object, as GET returns it
    # the conversation's images: each request's stand-in text (`PromptImages.sentinel`)
    # with its images in order, so a later turn's model still sees them
    images: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    @classmethod
    def of(cls, conversation: list[dict], body: dict, images: tuple = ()) -> StoredResponse:
        return cls(compact_json(conversation), compact_json(body), images)

    @property
    def size(self) -> int:
        pictures = sum(len(i.data) for _, group in self.images for i in group if i is not None)
        return len(self.conversation) + len(self.body) + pictures

    def messages(self) -> list[dict]:
        return json.loads(self.conversation)


class ResponseStore:
    """Recent responses by (scope, id): at most `capacity` entries and `max_bytes`
    bytes, so memory stays bounded however many (and however large) responses a server
    answers. An entry larger than `max_bytes` is not kept. When full, the scope holding
    the most gives up its least recently used entry: one key that fills the store
    evicts its own responses, not another key's (with one scope this is a plain LRU).
    Requests read it while their prompt is built in a worker thread, hence the lock."""

    def __init__(
        self, capacity: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, scope: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get((scope, response_id))
            if entry is not None:
                self._entries.move_to_end((scope, response_id))
            return entry

    def put(self, scope: str, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the least recently used; False if it alone is too big."""
        if entry.size > self.max_bytes:
            return False
        with self._lock:
            self._pop((scope, response_id))
            self._entries[(scope, response_id)] = entry
            self.bytes += entry.size
            while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
                self._pop(self._victim(keep=(scope, response_id)))
            return True

    def delete(self, scope: str, response_id: str) -> bool:
        with self._lock:
            return self._pop((scope, response_id)) is not None

    def _victim(self, keep: tuple[str, str]) -> tuple[str, str]:
        """The least recently used entry (never `keep`, the one just stored) of the scope
        holding the most: entries while over `capacity`, else bytes. Ties go to the
        scope with the oldest entry."""
        by_bytes = len(self._entries) <= self.capacity
        held: dict[str, int] = {}  # in LRU order of each scope's oldest entry
        for key, entry in self._entries.items():
            if key != keep:
                held[key[0]] = held.get(key[0], 0) + (entry.size if by_bytes else 1)
        scope = max(held, key=held.__getitem__)
        return next(key for key in self._entries if key[0] == scope and key != keep)

    def _pop(self, key: tuple[str, str]) -> StoredResponse | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry
