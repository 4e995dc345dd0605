"""Recent Responses API responses, for `previous_response_id` and GET/DELETE."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_STORE_SIZE = 256


@dataclass
class StoredResponse:
    conversation: list[dict]  # every turn so far, the model's output included; no instructions
    body: dict  # the response object, for GET


class ResponseStore:
    """Recent responses by id, for previous_response_id and GET: an LRU of `capacity`
    entries, so memory stays bounded however many responses a server answers. Requests
    read it while their prompt is built in a worker thread, hence the lock."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None
