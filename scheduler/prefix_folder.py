"""The folder the prefix cache's disk tier owns, and how it tells its files from others'.

`--prefix-cache-dir` may name any folder: a model's, a shared cache. The tier touches
nothing there: it works in a subfolder of its own (`SUBFOLDER`, made 0700, holding a
`MARKER` file that says it is Tandem's) and never changes the given folder's mode. It
refuses to start (`UnsafeFolder`, naming the path) on a subfolder others could write
into (group- or world-writable, another user's, a link) or one without the marker that
holds something: it would have to trust files anyone could plant.

Inside, the tier's own files are those named in its patterns: entries (`ENTRY` in
prefix_files.py; their headers are checked too, prefix_disk.py), the marker, the scope
salt, and temps of writes in progress (`temp_name`: the file they become, this host,
the writer's pid, a random part). A temp is removed only as a crash's leftover
(`stale_temp`: written on this host by a process that is gone), never a live writer's:
servers sharing the folder do not delete each other's writes.

The scope salt (`scope_salt`): an API key's id (server/auth.py) is an HMAC under it, and
the entries of a key are named by that id. Kept here (0600) it gives a key the same
scope after a restart, while ids still reveal nothing of the keys. A fingerprint of the
set of keys, keyed by the salt, is kept beside it: another set of keys gets a new salt,
so no entry of an earlier set is served again. Servers starting together take a lock
and agree on one salt.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scheduler.prefix_files import ENTRY

log = logging.getLogger(__name__)

SUBFOLDER = "tandem-prefix-cache"
MARKER = "TANDEM-PREFIX-CACHE"
SALT = "scope-salt"
_MARKER_TEXT = (
    "This folder is the prefix cache on disk of Tandem (tandem serve --prefix-cache-dir).\n"
    "Tandem writes and deletes the files in it; delete the whole folder to empty it.\n"
)
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMP = re.compile(
    rf"(?P<name>{ENTRY.pattern}|{SALT})\.(?P<host>[0-9a-f]{{8}})\.(?P<pid>[0-9]{{1,10}})"
    r"\.[0-9a-f]{8}\.tmp"
)


class UnsafeFolder(SystemExit):
    """A folder the tier would have to trust, though others can write into it (or it
    is not the tier's)."""


def own_folder(given: Path) -> Path:
    """The tier's subfolder of `given`, made (0700, marked) if new, checked if not."""
    given.mkdir(parents=True, exist_ok=True)  # its mode is the user's umask's, never changed
    folder = given / SUBFOLDER
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    problem = _unsafe(os.lstat(folder))
    if problem is None and not (folder / MARKER).is_file() and any(folder.iterdir()):
        problem = f"it holds files but no {MARKER} file: it is not Tandem's"
    if problem is not None:
        raise UnsafeFolder(
            f"tandem serve: refusing the prefix cache folder {folder}: {problem}. "
            "Give --prefix-cache-dir another folder, or make this one yours alone."
        )
    try:
        fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # marked already (or by a server starting beside this one)
        return folder
    with os.fdopen(fd, "w") as handle:
        handle.write(_MARKER_TEXT)
    return folder


def _unsafe(info: os.stat_result) -> str | None:
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder (a link or a file)"
    if info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        return f"others can write into it (mode {mode:o})"
    return None


# ---- temps ----------------------------------------------------------------------------


def temp_name(name: str, pid: int | None = None) -> str:
    """Where a write of `name` goes first (then renamed over it): unique to the writer."""
    return f"{name}.{_HOST}.{os.getpid() if pid is None else pid}.{secrets.token_hex(4)}.tmp"


def stale_temp(name: str) -> bool:
    """A temp the tier names, left on this host by a writer that is gone (a crash)."""
    match = _TEMP.fullmatch(name)
    return match is not None and match["host"] == _HOST and not _alive(int(match["pid"]))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process of its own: keep its temp
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def write_private(path: Path, data: bytes) -> None:
    """`data` as `path` (0600), whole or not at all, however many servers write beside."""
    partial = path.with_name(temp_name(path.name))
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


# ---- the scope salt ---------------------------------------------------------------------


def scope_salt(folder: Path, keys: tuple[str, ...]) -> bytes:
    """The salt of API-key ids for this set of `keys`: the one kept in `folder` when it
    was made for the same set, else a new one, kept there from now on."""
    path = folder / SALT
    with _locked(folder / MARKER):
        kept = _read_salt(path)
        if kept is not None and hmac.compare_digest(kept[1], _fingerprint(kept[0], keys)):
            return kept[0]
        salt = secrets.token_bytes(32)
        write_private(path, f"{salt.hex()} {_fingerprint(salt, keys).hex()}\n".encode())
    if kept is not None:
        log.info("prefix cache on disk: the API keys changed; earlier keys' entries are not served")
    return salt


def read_scope_salt(folder: Path) -> bytes | None:
    """The salt kept in `folder` (read only: nothing made or changed), or None."""
    kept = _read_salt(folder / SALT)
    return kept[0] if kept is not None else None


def scope_id(key: str, salt: bytes) -> str:
    """The id an API key's requests and entries go by: an HMAC of the key under `salt`,
    the same for the same key only under the same salt, not reversible to the key."""
    return hmac.new(salt, key.encode(), "sha256").hexdigest()[:24]


def _fingerprint(salt: bytes, keys: tuple[str, ...]) -> bytes:
    joined = b"\0".join(sorted({key.encode() for key in keys}))
    return hmac.new(salt, b"tandem-key-set\0" + joined, "sha256").digest()


def _read_salt(path: Path) -> tuple[bytes, bytes] | None:
    try:
        salt, fingerprint = (bytes.fromhex(part) for part in path.read_text().split())
    except (OSError, ValueError):  # none yet, or damaged: made anew
        return None
    return (salt, fingerprint) if len(salt) == len(fingerprint) == 32 else None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def keys_from_file(path: str | None) -> list[str]:
    """One key per line; blank lines and comment lines (`#`, indented or not) are not
    keys. `tandem serve --api-key-file` and `tandem draft train --traffic-key-file`
    both read keys here: a key's entries are found by the id its exact text gives."""
    if not path:
        return []
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]
