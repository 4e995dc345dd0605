"""Where Tandem keeps what it builds or fetches once (demo models, GGUF imports), and
the content hash that keys them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tandem_cache_root() -> Path:
    """`$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def remembered_sha256(path: Path, memo_dir: Path) -> str:
    """`file_sha256(path)`, remembered in `memo_dir` by (path, size, mtime) so a second
    start of a 1 GB GGUF does not read it all again; a changed file is hashed afresh."""
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = memo_dir / hashlib.sha1(key.encode()).hexdigest()
    try:
        remembered = memo.read_text().strip()
        if len(remembered) == 64:
            return remembered
    except OSError:
        pass
    digest = file_sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # its paths name the user's files
    partial = memo.with_suffix(f".{os.getpid()}")
    partial.write_text(digest)
    partial.replace(memo)
    return digest
