"""Disk prefix entries read in the background, so a disk hit never pauses the engine
thread (a 12k-token entry of a 0.5B model is ~300 MB: read and checksummed, ~1 s).

A waiting request whose prompt an entry on disk serves further than memory asks for
the file (`request`) and waits, while the others start and decode; a reader thread
reads it and checks its checksum (file I/O and hashing, no MLX); once `pending` is
False the engine thread takes the result (`take`) and turns it into cache layers
(`DiskTier.load`). Results nobody takes (the request was cancelled meanwhile, or memory
came to serve it better) are dropped oldest first beyond `MAX_RESULTS`: host memory
holds at most that many whole entries.

Threads: `request`, `pending` and `take` run on the engine thread, `_work` on the
reader thread; `_asked` and `_results` are shared under `_lock`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_RESULTS = 2  # entries read and not yet taken, held in host memory


@dataclass
class ReadResult:
    read: Any = None  # what `read` returned for the file
    error: Exception | None = None  # or what it raised (the engine thread handles it)


class DiskReads:
    def __init__(self, read: Callable[[Path], Any]) -> None:
        self._read = read  # a whole file, checked (`prefix_files.read_entry`)
        self.read_seconds = 0.0  # reader thread: files read and checked
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._asked: set[Path] = set()  # queued or being read
        self._results: OrderedDict[Path, ReadResult] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def request(self, path: Path) -> None:
        """Read `path` in the background, unless it is being read or was read."""
        with self._lock:
            if path in self._asked or path in self._results:
                return
            self._asked.add(path)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name="tandem-prefix-read", daemon=True
            )
            self._thread.start()
        self._queue.put(path)

    @property
    def busy(self) -> bool:
        """A file is queued or being read."""
        with self._lock:
            return bool(self._asked)

    def pending(self, path: Path) -> bool:
        """Whether `path` is still queued or being read."""
        with self._lock:
            return path in self._asked

    def take(self, path: Path) -> ReadResult | None:
        """The read of `path`, once (None: not read in the background)."""
        with self._lock:
            return self._results.pop(path, None)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)

    def _work(self) -> None:
        while (path := self._queue.get()) is not None:
            started = time.perf_counter()
            try:
                result = ReadResult(read=self._read(path))
            except Exception as error:  # noqa: BLE001 - handed to the engine thread as is
                result = ReadResult(error=error)
            self.read_seconds += time.perf_counter() - started
            with self._lock:
                self._asked.discard(path)
                self._results[path] = result
                while len(self._results) > MAX_RESULTS:
                    dropped, _ = self._results.popitem(last=False)
                    log.debug("prefix cache on disk: read of %s not taken", dropped.name)
