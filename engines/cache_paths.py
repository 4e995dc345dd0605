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
