"""The prefix cache's disk tier: entries kept across restarts, bounded in bytes, LRU.

Behind the in-memory prefix cache (scheduler/prefix_cache.py): what it stores is also
written here (prompts of at least `MIN_TOKENS`; a shorter prefill costs less than the
copy), and a prompt that extends an entry on disk further than any entry in memory is
read back from here instead of prefilled. Files live in a folder the tier owns inside
the one it is given (scheduler/prefix_folder.py), one entry per file (0600,
scheduler/prefix_files.py), named by hashes of the model's identity, the API-key scope
and the tokens; one key's entries are never served to another.

Threads: the engine thread copies an entry's arrays to host memory (`save`) and turns
a file read back into cache layers at a hit (`best`, `load`). The file itself is read
and checked by a reader thread while the request waits (`prefetch`, prefix_reads.py);
only a hit nobody asked for ahead is read on the engine thread. One writer thread does
the rest: first the model's identity (hashing the weights, once per
file thanks to a memo) and the index, rebuilt from the files' headers; then the writes,
from a bounded queue (a full queue drops the write: the engine thread never waits), and
the evictions. The index is shared by the two, under one lock.

The tier touches only its own files: named as it names them, with a header it wrote.
Anything else in its folder is left alone and not counted. A file named as this
model's that cannot be read, fails its checksum or claims another model is deleted and
logged, never loaded. Entries of other models (another server sharing the folder) are
not served, but count toward the bound, oldest first out.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.drafting.feature_drafters import drafter_folder
from engines.model.identity import model_identity, parameter_dtypes
from engines.model.mtp import local_folder
from scheduler.prefix_files import (
    ENTRY,
    BadEntry,
    Header,
    Snapshot,
    Unsupported,
    decode,
    encode,
    file_name,
    read_entry,
    read_header,
    scope_hash,
    snapshot,
)
from scheduler.prefix_folder import own_folder, scope_salt, stale_temp, write_private
from scheduler.prefix_reads import DiskReads

log = logging.getLogger(__name__)

MIN_TOKENS = 256  # shorter prompts prefill faster than their entry is copied and read
QUEUE_ENTRIES = 4  # writes waiting; more are dropped
GB = 1 << 30


@dataclass
class DiskEntry:
    path: Path
    nbytes: int
    used: float  # last use, as the file's mtime
    header: Header | None  # None: another model's file (counted, never served)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


@dataclass
class Loaded:
    tokens: list[int]
    kind: str
    target_layers: int
    layers: list  # the target's, then the draft's when the draft is this server's


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int, min_tokens: int = MIN_TOKENS) -> None:
        """Takes (or makes) the tier's folder in `directory` at once: an unsafe one
        stops the server at start (`UnsafeFolder`), before anything is served."""
        self.directory = own_folder(Path(directory))
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.identity = ""
        self.draft_identity = ""
        self.writes = 0
        self.write_drops = 0  # the queue was full
        self.rejected = 0  # files deleted as corrupt, truncated or mislabelled
        self.copy_seconds = 0.0  # engine thread: entries copied to host memory
        self.load_seconds = 0.0  # engine thread: files decoded (and read, if not ahead)
        self.reads = DiskReads(read_entry)  # files read ahead of their hits
        self._entries: dict[str, DiskEntry] = {}  # file name -> entry
        self._pending: set[str] = set()  # queued, not yet written
        self._lock = threading.Lock()
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(QUEUE_ENTRIES)
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------

    def open(self, identify: Callable[[], tuple[str, str]]) -> None:
        """Start the writer thread; until it has the identity and the index, the tier
        neither serves nor writes (a first start may hash gigabytes of weights)."""
        self._thread = threading.Thread(
            target=self._work, args=(identify,), name="tandem-prefix-disk", daemon=True
        )
        self._thread.start()

    def scope_salt(self, keys: tuple[str, ...]) -> bytes:
        """The salt of API-key ids kept with the entries: a key's entries serve it
        after a restart, until the set of keys changes (prefix_folder.py)."""
        return scope_salt(self.directory, keys)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queued writes are on disk; False if they were not in time."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pending

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (up to `timeout`) and stop the writer thread."""
        self.reads.close()
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("prefix cache on disk: queued writes not finished at shutdown")
            return
        self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------

    def best(self, tokens: list[int], scope: str, at_least: int) -> tuple[DiskEntry, int] | None:
        """The entry of `scope` that serves the most of `tokens` (as the in-memory
        lookup would: a prefix of them, or a trimmable entry cut back to what it
        shares, one token always left to feed), if that is clearly more than
        `at_least` (what memory serves): a few shared tokens are not worth a file."""
        if not self._ready.is_set() or len(tokens) < 2:
            return None
        wanted, prompt = scope_hash(scope), np.asarray(tokens, dtype=np.int32)
        best: tuple[DiskEntry, int] | None = None
        with self._lock:
            candidates = [
                e for e in self._entries.values() if e.header and e.header.scope == wanted
            ]
        at_least += self.min_tokens // 4  # a whole file read back serves this many more
        for entry in candidates:
            served = _served(entry.tokens, prompt, entry.header.trimmable)
            if served > at_least and (best is None or served > best[1]):
                best = (entry, served)
        return best

    def prefetch(self, entry: DiskEntry) -> None:
        """Read `entry`'s file in the background; `load` takes it once `reading` is
        False."""
        self.reads.request(entry.path)

    def reading(self, entry: DiskEntry | None = None) -> bool:
        """Whether `entry`'s file (None: any file) is being read ahead."""
        return self.reads.busy if entry is None else self.reads.pending(entry.path)

    def load(self, entry: DiskEntry) -> Loaded | None:
        """The entry's caches, read and checked (by the reader thread, if `prefetch`
        asked for it); a bad file is deleted and logged."""
        started = time.perf_counter()
        try:
            ahead = self.reads.take(entry.path)
            if ahead is None:
                header, spec, tensors = read_entry(entry.path)
            elif ahead.error is not None:
                raise ahead.error
            else:
                header, spec, tensors = ahead.read
            if header.identity != self.identity or header.scope != entry.header.scope:
                raise BadEntry("made for another model or key than its name says")
            layers = decode(spec, tensors)
        except FileNotFoundError:  # evicted meanwhile
            self._forget(entry.path.name)
            return None
        except (BadEntry, KeyError, ValueError) as error:
            self._reject(entry.path, error)
            return None
        if header.draft_identity != self.draft_identity:
            layers = layers[: header.target_layers]  # not this server's draft model
        self.load_seconds += time.perf_counter() - started
        now = time.time()
        entry.used = now
        try:
            os.utime(entry.path, (now, now))
        except OSError:
            pass
        return Loaded(header.tokens, header.kind, header.target_layers, layers)

    def save(self, tokens: list[int], layers: list, scope: str, kind: str, target: int) -> None:
        """Queue `layers` (holding exactly `tokens`) to be written, unless it is short,
        already on disk or queued; copies the arrays to host memory now."""
        if not self._ready.is_set() or len(tokens) < self.min_tokens:
            return
        name = file_name(self.identity, scope_hash(scope), tokens)
        with self._lock:
            known = self._entries.get(name)
            if name in self._pending or (
                known is not None and known.header and known.header.tokens == list(tokens)
            ):
                return
        started = time.perf_counter()
        try:
            entry = snapshot(tokens, layers, scope, kind, target)
        except Unsupported as error:
            log.debug("prefix cache on disk: not written: %s", error)
            return
        finally:
            self.copy_seconds += time.perf_counter() - started
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            try:
                self._queue.put_nowait(entry)
            except queue.Full:
                self.write_drops += 1
                return
            self._pending.add(name)

    # ---- writer thread --------------------------------------------------------------

    def _work(self, identify: Callable[[], tuple[str, str]]) -> None:
        try:
            self.identity, self.draft_identity = identify()
            self._scan()
        except Exception:  # noqa: BLE001 - the tier is an optimisation: serve without it
            log.exception("prefix cache on disk: off (could not open %s)", self.directory)
            return
        self._ready.set()
        while (entry := self._queue.get()) is not None:
            name = file_name(self.identity, entry.scope, entry.tokens)
            try:
                self._write(name, entry)
            except OSError as error:
                log.warning("prefix cache on disk: could not write %s: %s", name, error)
            finally:
                with self._lock:
                    self._pending.discard(name)

    def _scan(self) -> None:
        """The index, from the headers of the tier's files; a crashed writer's temps
        go. What the tier did not write is left alone."""
        others = 0
        for path in self.directory.iterdir():
            if stale_temp(path.name):
                path.unlink(missing_ok=True)
                continue
            try:
                if self._indexed(path) == "other":
                    others += 1
            except OSError:  # removed meanwhile (another server sharing the folder)
                continue
        log.info(
            "prefix cache on disk: %s, %d entries of this model, %d of others, %.2f of %.2f GB",
            self.directory,
            len(self._entries) - others,
            others,
            self.nbytes / GB,
            self.max_bytes / GB,
        )
        with self._lock:
            self._evict()

    def _indexed(self, path: Path) -> str | None:
        """Index `path` if it is an entry: "mine" (this model's), "other" (another
        model's, counted), None (not the tier's, or a bad file of this model's, deleted)."""
        named = ENTRY.fullmatch(path.name)
        if named is None:
            return None
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            return None
        mine = named[1] == self.identity[:16]
        try:
            header = read_header(path)
            if file_name(header.identity, header.scope, header.tokens) != path.name:
                raise BadEntry("its header is not the one its name says")
            if mine and header.identity != self.identity:
                raise BadEntry("made for another model than its name says")
        except BadEntry as error:
            gone = isinstance(error.__cause__, FileNotFoundError)  # evicted by a server beside
            if mine and not gone:  # named as this model's entry, in the tier's own folder
                self._reject(path, error)
            return None
        self._add(path, info.st_size, info.st_mtime, header if mine else None)
        return "mine" if mine else "other"

    def _write(self, name: str, entry: Snapshot) -> None:
        data = encode(entry, self.identity, self.draft_identity)
        if len(data) > self.max_bytes:
            return
        path = self.directory / name
        write_private(path, data)
        header = Header(
            self.identity,
            self.draft_identity,
            entry.scope,
            entry.kind,
            entry.tokens,
            entry.target_layers,
            entry.trimmable,
        )
        self.writes += 1
        with self._lock:
            self._add(path, len(data), time.time(), header)
            if entry.trimmable:
                self._drop_prefixes_of(name)
            self._evict()

    # ---- index (under the lock, except at scan) --------------------------------------

    def _add(self, path: Path, nbytes: int, used: float, header: Header | None) -> None:
        tokens = np.asarray(header.tokens if header else [], dtype=np.int32)
        self._entries[path.name] = DiskEntry(path, nbytes, used, header, tokens)

    def _drop_prefixes_of(self, name: str) -> None:
        """A trimmable entry serves every prefix of its tokens: shorter trimmable
        entries of the same scope that it extends only take room (as in memory)."""
        new = self._entries[name]
        for other_name, other in list(self._entries.items()):
            h = other.header
            if other_name == name or h is None or h.scope != new.header.scope:
                continue
            n = len(other.tokens)
            if h.trimmable and n < len(new.tokens) and np.array_equal(new.tokens[:n], other.tokens):
                self._delete(other_name)

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self._entries:
            self._delete(min(self._entries, key=lambda n: self._entries[n].used))

    def _delete(self, name: str) -> None:
        entry = self._entries.pop(name)
        entry.path.unlink(missing_ok=True)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def _reject(self, path: Path, error: Exception) -> None:
        log.warning("prefix cache on disk: dropped %s: %s", path.name, error)
        self.rejected += 1
        with self._lock:
            self._entries.pop(path.name, None)
        path.unlink(missing_ok=True)

    # ---- any thread ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in list(self._entries.values()))

    def stats(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "ready": self._ready.is_set(),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "files": len(self._entries),
            "writes": self.writes,
            "write_drops": self.write_drops,
            "rejected_files": self.rejected,
            "copy_seconds": round(self.copy_seconds, 6),
            "load_seconds": round(self.load_seconds, 6),
            "read_ahead_seconds": round(self.reads.read_seconds, 6),
        }


def _served(entry: np.ndarray, prompt: np.ndarray, trimmable: bool) -> int:
    """Prompt tokens an entry holding `entry` serves (0: none), one always left to feed."""
    n, length = len(entry), len(prompt)
    shared = min(n, length)
    mismatch = np.flatnonzero(entry[:shared] != prompt[:shared])
    common = int(mismatch[0]) if mismatch.size else shared
    if common == n and n < length:
        return n
    return min(common, length - 1) if trimmable else 0


def default_directory() -> Path:
    """`$XDG_CACHE_HOME/tandem/prefix`, else `~/.cache/tandem/prefix`."""
    from engines.model.cache_paths import tandem_cache_root

    return tandem_cache_root() / "prefix"


def disk_tier(directory: str | None, max_bytes: int, distributed: str | None) -> DiskTier | None:
    """The tier the settings ask for; none when off (0 bytes), sharded across ranks
    (each rank holds only its shard of the caches) or its folder cannot be made. An
    unsafe folder stops the server (`UnsafeFolder`)."""
    if max_bytes <= 0 or distributed:
        return None
    given = Path(directory).expanduser() if directory else default_directory()
    try:
        return DiskTier(given, max_bytes)
    except OSError as error:  # the tier is an optimisation: serve without it
        log.warning("prefix cache on disk: off (could not open %s: %s)", given, error)
        return None


MEMO = ".hashes"  # in the tier's folder: the model files' remembered hashes


def target_identity(folder: str, dtypes: str, memo_dir: Path) -> str:
    """The identity the entries of the target loaded from `folder` at `dtypes` carry."""
    return model_identity(local_folder(folder), dtypes, memo_dir)


def identities(registry: Any, draft_vocab: int | None, memo_dir: Path) -> Callable:
    """The target's and the draft model's identities, for the writer thread to compute
    (the dtypes are read here, on the engine thread)."""
    target = registry.target
    target_dtypes = parameter_dtypes(target.model)
    draft = registry.draft
    draft_dtypes = parameter_dtypes(draft.model) if draft is not None else ""
    # a feature drafter's entries keep its context K/V (DFlash) beside the target's
    feature = registry.feature_drafter
    feature_dtypes = parameter_dtypes(feature.module) if feature is not None else ""

    def identify() -> tuple[str, str]:
        target_id = target_identity(target.folder, target_dtypes, memo_dir)
        if feature is not None:
            extra = f"{feature.kind} drafter of {target_id}"
            folder = drafter_folder(feature.path)
            return target_id, model_identity(folder, feature_dtypes, memo_dir, extra)
        if draft is None:
            return target_id, ""
        extra = f"draft of {target_id}, vocabulary {draft_vocab}"
        return target_id, model_identity(local_folder(draft.folder), draft_dtypes, memo_dir, extra)

    return identify
